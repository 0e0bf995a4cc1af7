# shellcheck shell=bash
# Sourced (not run) by the scripts that build the project (scripts/test.sh, demo.sh, bench.sh,
# vmtest.sh); `rtrs_use_go` then puts on PATH a go command that can build this module, getting
# one if needed. By hand: `. scripts/go-toolchain.sh && rtrs_use_go`.
#
#   1. /usr/local/go/bin/go (the official tarball's place), then whatever `go` is on PATH, is used
#      when it is at least the version go.mod asks for (its `toolchain` line, else its `go` line).
#   2. Otherwise an older go, Debian 12's golang-go (Go 1.19) for instance, downloads the Go
#      release that go.mod names as the module golang.org/toolchain through the Go module proxy
#      ($GOPROXY, by default proxy.golang.org) and checks it against the checksum database
#      (sum.golang.org, reached through the proxy when it cannot be reached directly). This is
#      what Go 1.21 and later do themselves under GOTOOLCHAIN=auto, done by hand so that Go 1.19,
#      which does not know GOTOOLCHAIN, and distributions that set GOTOOLCHAIN=local, work too.
#      The release is unpacked into the module cache ($(go env GOMODCACHE)/golang.org/
#      toolchain@v0.0.1-go1.N.M.OS-ARCH), where a later run, or a Go 1.21+ that switches
#      toolchains itself, finds it.
#   3. With no go at all, as root, Debian's golang-go is installed first (scripts/apt-install.sh:
#      it shows what it installs and waits for a held apt or dpkg lock).
#
# RTRS_GO_VERSION=1.26.8 asks for a given release instead of go.mod's.

rtrs_go_log() { echo "go-toolchain: $*" >&2; }

# The release go.mod asks for, as 1.N.M.
rtrs_go_wanted() {
	local v='' mod
	mod="$(dirname "${BASH_SOURCE[0]}")/../go.mod"
	v=${RTRS_GO_VERSION:-}
	[ -n "$v" ] || v=$(sed -n 's/^toolchain[[:space:]]*go\([0-9][0-9.a-z]*\).*/\1/p' "$mod" | head -n 1)
	[ -n "$v" ] || v=$(sed -n 's/^go[[:space:]]*\([0-9][0-9.a-z]*\).*/\1/p' "$mod" | head -n 1)
	v=${v#go}
	# From Go 1.21 on "go 1.N" names the language; its first release is 1.N.0.
	case $v in
	1.*.*) ;;
	1.*) [ "${v#1.}" -ge 21 ] 2>/dev/null && v=$v.0 ;;
	esac
	echo "$v"
}

# Whether go version $1 (1.N.M, as `go env GOVERSION` prints it without "go") is at least $2.
rtrs_go_at_least() {
	[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]
}

rtrs_go_version() { # of the go on PATH, as 1.N.M
	local v=''
	v=$(go env GOVERSION 2>/dev/null) || return 1
	v=${v%% *}  # "go1.26.8 X:..." in experiments
	v=${v#go}
	echo "$v"
}

rtrs_use_go() {
	local want='' have='' modcache='' os='' arch='' mod='' dir='' tmp='' out='' sum=''
	want=$(rtrs_go_wanted)
	if [ -z "$want" ]; then
		rtrs_go_log "no go version in go.mod"
		return 1
	fi
	[ -x /usr/local/go/bin/go ] && export PATH="/usr/local/go/bin:$PATH"
	if ! command -v go >/dev/null; then
		if [ "$(id -u)" != 0 ]; then
			rtrs_go_log "no go command: install Go $want or later (or Debian's golang-go, as root: this script then fetches Go $want)"
			return 1
		fi
		rtrs_go_log "no go command: installing Debian's golang-go to fetch Go $want with"
		"$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" golang-go ca-certificates || return 1
	fi
	if have=$(rtrs_go_version) && [ -n "$have" ] && rtrs_go_at_least "$have" "$want"; then
		return 0
	fi
	case $have in devel*) return 0 ;; esac
	os=$(go env GOHOSTOS) && arch=$(go env GOHOSTARCH) && modcache=$(go env GOMODCACHE) || return 1
	[ -n "$modcache" ] || modcache="$(go env GOPATH | cut -d: -f1)/pkg/mod"
	mod="golang.org/toolchain@v0.0.1-go$want.$os-$arch"
	dir="$modcache/$mod"
	if [ ! -x "$dir/bin/go" ]; then
		if [ ! -f /etc/ssl/certs/ca-certificates.crt ] && [ "$(id -u)" = 0 ]; then
			"$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" ca-certificates || return 1
		fi
		rtrs_go_log "$(command -v go) is Go $have; go.mod asks for $want: downloading $mod through $(go env GOPROXY)"
		# Outside any module (Go 1.19 cannot read our go.mod); the checksum database is
		# consulted whatever the environment says, so that an unverified zip is never unpacked.
		tmp=$(mktemp -d) || return 1
		if ! out=$(cd "$tmp" && env GO111MODULE=on GOFLAGS= GOSUMDB=sum.golang.org \
			GONOSUMDB= GONOSUMCHECK= GOPRIVATE= GOINSECURE= GOTOOLCHAIN=local \
			go mod download -json "$mod"); then
			rmdir "$tmp"
			printf '%s\n' "$out" >&2
			rtrs_go_log "could not download $mod (above); GOPROXY is $(go env GOPROXY)"
			return 1
		fi
		rmdir "$tmp"
		sum=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Sum": "\(.*\)",*$/\1/p')
		rtrs_go_log "$mod $sum, verified against sum.golang.org"
		# Module zips carry no file modes: the commands are made executable, as Go's own
		# toolchain switch does (the files belong to us; the directories stay read-only).
		chmod a+x "$dir"/bin/* "$dir"/pkg/tool/*/* || return 1
	fi
	export PATH="$dir/bin:$PATH"
	# This toolchain, and no other one fetched behind our back.
	export GOTOOLCHAIN=local
	have=$(rtrs_go_version) || return 1
	if ! rtrs_go_at_least "$have" "$want"; then
		rtrs_go_log "$dir/bin/go says it is Go $have, not $want"
		return 1
	fi
	rtrs_go_log "using $(command -v go) (Go $have)"
}
