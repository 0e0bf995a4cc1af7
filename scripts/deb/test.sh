#!/usr/bin/env bash
# The Debian packages from end to end, as an operator meets them (scripts/test.sh runs it; it
# never skips: a missing tool is installed, a failed step fails the run):
#   1. builds both packages (scripts/deb/build.sh) and has lintian find no error;
#   2. builds them again from a later commit, whose shipped server config differs (the upgrade);
#   3. installs the first build with apt in a clean Debian 12 chroot (debootstrap, cached in
#      $RTRS_VM_CACHE/chroot/bookworm, copied for each run), which pulls in the dependencies;
#   4. checks the files, -version against dpkg, the verbs libraries linked, the units
#      (systemd-analyze verify, enabled, never started by the package), the conffiles and the
#      man pages (man -l with warnings on, every flag of -h and every docs/ABI file in them);
#   5. edits both configs as the README says and runs the installed daemons on them: the client
#      maps a device from the server over loopback, data goes through, `cat` shows the path;
#   6. upgrades: the client's edited config (unchanged in the package) is kept with no prompt,
#      the server's (changed in both) is kept as unattended upgrades do, the new one beside it;
#   7. purges both (and the dependencies they pulled in), and finds nothing left.
# Usage: scripts/deb/test.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/vm/lib.sh
export RTRS_VM_CACHE=${RTRS_VM_CACHE:-/var/cache/rtrs-vmtest}
[ "$(id -u)" = 0 ] || { echo "debtest: run as root (chroot, FUSE)" >&2; exit 1; }
work=$(mktemp -d /var/tmp/rtrs-debtest.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/root
step() { echo "-- deb: $*"; }
fail() { echo "deb: FAIL: $*" >&2; exit 1; }
in_root() { vm_chroot "$root" "$@"; }
# apt_in_root ARGS...: apt-get in the chroot with no stdin (a question would fail it); its
# output goes to a log, shown when it fails, its summary and dpkg's notes when it does not.
apt_in_root() {
	in_root apt-get -q "$@" </dev/null >"$work/apt.log" 2>&1 || { cat "$work/apt.log"; fail "apt-get $* failed (above)"; }
	grep -E '^[0-9]+ upgraded|^Created symlink|^Removed|^Configuration file|^ ==>' "$work/apt.log" || true
}
daemons=(rtrs-serverd rtrs-clientd)

step "version.sh: from git describe, sorted as the commits"
git init -q "$work/vt"
vt() { git -C "$work/vt" -c user.name=t -c user.email=t@localhost "$@"; }
GIT_COMMITTER_DATE=@1700000000 vt commit -q --allow-empty -m one
a=$(scripts/version.sh "$work/vt")
[ "$a" = "0.0~git20231114.221320.$(vt rev-parse --short=7 HEAD)" ] || fail "no tag: $a"
vt tag v1.2.3
[ "$(scripts/version.sh "$work/vt")" = 1.2.3 ] || fail "on v1.2.3: $(scripts/version.sh "$work/vt")"
touch "$work/vt/new" # a file git does not track yet is in the package, so it makes the tree dirty
t=$(scripts/version.sh "$work/vt")
[ "$t" = 1.2.3+0.dirty ] || fail "on v1.2.3 with a new file: $t"
rm "$work/vt/new"
GIT_COMMITTER_DATE=@1700000060 vt commit -q --allow-empty -m two
b=$(scripts/version.sh "$work/vt")
[ "$b" = "1.2.3+1.g$(vt rev-parse --short=7 HEAD)" ] || fail "after v1.2.3: $b"
touch "$work/vt/f" && vt add f
c=$(scripts/version.sh "$work/vt")
[ "$c" = "$b+dirty" ] || fail "uncommitted: $c"
prev=
for v in "$a" 1.2.3 "$t" "$b" "$c"; do
	[ -z "$prev" ] || dpkg --compare-versions "$prev" lt "$v" || fail "$prev does not sort below $v"
	prev=$v
done
vt tag v2.0-beta
vt commit -q -m three && vt tag -d v1.2.3 >/dev/null
! scripts/version.sh "$work/vt" 2>/dev/null || fail "tag v2.0-beta taken as a version"

step "build"
scripts/deb/build.sh "$work/v1"
v1=$(scripts/version.sh)
command -v lintian >/dev/null || scripts/apt-install.sh lintian
step "lintian (errors fail)"
rc=0
lintian --fail-on error "$work"/v1/rtrs_*.changes >"$work/lintian.out" 2>&1 || rc=$?
grep -v 'running with root privileges' "$work/lintian.out" || true
[ "$rc" = 0 ] || fail "lintian found errors (above)"

step "build again from a later commit, its server config changed"
git clone -q . "$work/src2"
# The checkout as it is, uncommitted changes included, then a commit a minute after HEAD.
scripts/deb/copy-tree.sh "$work/src2"
echo "# shipped by the upgrade" >>"$work/src2/deploy/config/rtrs-serverd.conf"
when=$(($(git log -1 --format=%ct HEAD) + 60))
git -C "$work/src2" add -A
GIT_COMMITTER_DATE="@$when" GIT_AUTHOR_DATE="@$when" git -C "$work/src2" -c user.name=debtest \
	-c user.email=debtest@localhost commit -q -m "debtest: the upgrade"
"$work/src2/scripts/deb/build.sh" "$work/v2"
v2=$(scripts/version.sh "$work/src2")
dpkg --compare-versions "$v2" gt "$v1" || fail "the rebuild's version $v2 is not above $v1"

step "a clean Debian 12 chroot"
vm_chroot_ensure "$RTRS_VM_CACHE/chroot/bookworm" bookworm
cp -a "$RTRS_VM_CACHE/chroot/bookworm" "$root"
apt_in_root update
# What the checks use: systemd-analyze and man.
apt_in_root install -y --no-install-recommends systemd man-db
snapshot() { # every file and directory of the chroot but the package manager's own books
	in_root find / -xdev \( -path /proc -o -path /dev -o -path /sys -o -path /run -o -path /tmp \
		-o -path /var/lib/apt -o -path /var/cache -o -path /var/log -o -path /var/lib/dpkg \) -prune -o -print | sort
}
snapshot >"$work/before"
# deb VERSION DAEMON: the package's path in the chroot.
deb() { echo "/tmp/${2}_${1}_amd64.deb"; }
for v in "$v1" "$v2"; do
	for d in "${daemons[@]}"; do
		f=$(find "$work/v1" "$work/v2" -name "$(basename "$(deb "$v" "$d")")")
		[ -n "$f" ] || fail "no $(deb "$v" "$d") was built"
		cp "$f" "$root/tmp/"
	done
done

step "install $v1 with apt"
apt_in_root install -y --no-install-recommends "$(deb "$v1" rtrs-serverd)" "$(deb "$v1" rtrs-clientd)"

# check_installed VERSION: what each package holds, as installed.
check_installed() {
	local v=$1 d got
	for d in "${daemons[@]}"; do
		got=$(in_root dpkg-query -W -f '${Status} ${Version}' "$d")
		[ "$got" = "install ok installed $v" ] || fail "$d: dpkg says $got, want $v"
		got=$(in_root "/usr/sbin/$d" -version)
		[ "$got" = "$d $v" ] || fail "$d -version says $got, the package is $v"
		for f in "/usr/sbin/$d" "/lib/systemd/system/$d.service" "/etc/rtrs/$d.conf" \
			"/usr/share/man/man8/$d.8.gz" "/usr/share/doc/$d/copyright" "/usr/share/doc/$d/README.md.gz" \
			"/usr/share/doc/$d/THIRD-PARTY-LICENSES.gz" "/usr/share/doc/$d/docs/ABI"; do
			in_root dpkg -S "$f" >/dev/null 2>&1 || fail "$d: $f is not installed by a package"
		done
		got=$(in_root dpkg-query -W -f '${Depends}' "$d")
		[[ $got == *libibverbs1* && $got == *librdmacm1* ]] || fail "$d depends on $got"
		# Output taken whole, then searched: under pipefail, `ldd | grep -q` fails when grep
		# exits at the first match while ldd still writes (SIGPIPE), as it did on one run.
		got=$(in_root ldd "/usr/sbin/$d")
		grep -q 'libibverbs.so' <<<"$got" || fail "$d is built without the verbs provider"
		! grep 'not found' <<<"$got" || fail "$d: a library is missing"
		got=$(in_root dpkg-query -W -f '${Conffiles}\n' "$d")
		grep -q "^ /etc/rtrs/$d.conf " <<<"$got" ||
			fail "$d: /etc/rtrs/$d.conf is not a conffile"
		got=$(in_root systemctl is-enabled "$d.service" 2>&1) || true
		[ "$got" = enabled ] || fail "$d.service is $got, not enabled"
		# Enabled, never started or restarted by the package (postinst invokes nothing), and
		# stopped on removal only (prerm).
		! grep -n 'deb-systemd-invoke\|systemctl.* \(start\|restart\|try-restart\)' "$root/var/lib/dpkg/info/$d.postinst" ||
			fail "$d.postinst starts or restarts the service (above)"
		sed -n '/^if \[ "$1" = remove \]/,/^fi/p' "$root/var/lib/dpkg/info/$d.prerm" |
			grep -q "deb-systemd-invoke stop $d.service" || fail "$d.prerm does not stop the service on removal"
	done
}
check_installed "$v1"

step "units: systemd-analyze verify"
for d in "${daemons[@]}"; do
	out=$(in_root systemd-analyze verify "/lib/systemd/system/$d.service" 2>&1) || fail "systemd-analyze verify $d.service: $out"
	! grep -F "$d" <<<"$out" || fail "systemd-analyze verify $d.service warns (above)"
	grep -q '^ExecStart=/usr/sbin/'"$d"' ' "$root/lib/systemd/system/$d.service" || fail "$d.service runs another binary"
done

step "man pages: man -l with warnings, every flag and every tree file in them"
declare -A abi=([rtrs-serverd]="sysfs-class-rtrs-server sysfs-class-rnbd-server"
	[rtrs-clientd]="sysfs-class-rtrs-client sysfs-class-rtrs-devices")
for d in "${daemons[@]}"; do
	page=$(in_root env MANWIDTH=1000 man --warnings -l "/usr/share/man/man8/$d.8.gz" 2>"$work/man.err")
	[ ! -s "$work/man.err" ] || { cat "$work/man.err"; fail "man -l $d.8 warns (above)"; }
	in_root man -w "$d" >/dev/null || fail "man $d finds no page"
	while read -r flag; do
		grep -qE -- "^ +$flag( |\$)" <<<"$page" || fail "$d.8 lacks $flag"
	done < <(in_root "/usr/sbin/$d" -h 2>&1 | grep -oE '^  -[a-z0-9-]+')
	for a in ${abi[$d]}; do
		while read -r path; do
			grep -qF -- "$path" <<<"$page" || fail "$d.8 lacks $path (docs/ABI/$a)"
		done < <(sed -n 's/^What:[[:space:]]*//p' "docs/ABI/$a")
	done
done

step "the operator's edits, and the installed daemons running on them"
port=$((20000 + RANDOM % 20000))
# shellcheck disable=SC2016 # expanded in the chroot
in_root bash -c '
	set -eu
	port=$1
	sed -i "s/^listen = .*/listen = 127.0.0.1:$port/" /etc/rtrs/rtrs-serverd.conf
	sed -i -e "s/^#open_session .*/open_session sessname=store1 dest_port=$port path=ip:127.0.0.1 mpath_policy=min-inflight/" \
		-e "s/^#map_device /map_device /" -e "s/^io-timeout = .*/io-timeout = 45s/" /etc/rtrs/rtrs-clientd.conf
	mkdir -p /srv/rtrs && truncate -s 64M /srv/rtrs/vol1
	pids=
	trap "[ -z \"\$pids\" ] || kill \$pids; wait" EXIT
	/usr/sbin/rtrs-serverd -provider soft >/tmp/serverd.log 2>&1 & pids="$pids $!"
	/usr/sbin/rtrs-clientd -provider soft >/tmp/clientd.log 2>&1 & pids="$pids $!"
	for _ in $(seq 100); do [ -e /run/rtrs/dev/store1/vol1 ] && break; sleep 0.2; done
	[ -e /run/rtrs/dev/store1/vol1 ] || { cat /tmp/serverd.log /tmp/clientd.log; exit 1; }
	echo "state: $(cat /run/rtrs/rtrs-client/store1/paths/*/state)"
	[ "$(cat /run/rtrs/rtrs-client/store1/paths/*/state)" = connected ]
	ls /run/rtrs/rtrs-server/store1/paths
	head -c 1048576 /dev/urandom >/tmp/data
	dd if=/tmp/data of=/run/rtrs/dev/store1/vol1 bs=64k conv=fsync status=none
	cmp /tmp/data /srv/rtrs/vol1 -n 1048576
	echo "stats/rdma: $(cat /run/rtrs/rtrs-client/store1/paths/*/stats/rdma)"
	kill -TERM $pids && wait && pids=
	if grep " /run/rtrs/" /proc/self/mounts; then echo "mounts left (above)"; exit 1; fi
	[ -s /var/lib/rtrs/sessions.json ] || { echo "no session names in /var/lib/rtrs"; ls -la /var/lib/rtrs; exit 1; }
	rm -rf /srv/rtrs /tmp/data /tmp/serverd.log /tmp/clientd.log
' smoke "$port" || fail "the installed daemons did not map a device and move data (above)"
for d in "${daemons[@]}"; do cp "$root/etc/rtrs/$d.conf" "$work/$d.conf.edited"; done

step "upgrade to $v2, the edited configs kept"
# The client's config is the same in both packages: kept without a question (no stdin at all).
apt_in_root install -y --no-install-recommends "$(deb "$v2" rtrs-clientd)"
# The server's changed on both sides: kept, as unattended upgrades do, the new one beside it.
apt_in_root install -y --no-install-recommends -o Dpkg::Options::=--force-confdef \
	-o Dpkg::Options::=--force-confold "$(deb "$v2" rtrs-serverd)"
check_installed "$v2"
for d in "${daemons[@]}"; do
	cmp "$root/etc/rtrs/$d.conf" "$work/$d.conf.edited" || fail "the upgrade changed the edited /etc/rtrs/$d.conf"
done
grep -q '^# shipped by the upgrade' "$root/etc/rtrs/rtrs-serverd.conf.dpkg-dist" ||
	fail "the upgrade's server config is not beside the kept one"

step "purge: nothing left"
apt_in_root purge -y "${daemons[@]}"
for d in "${daemons[@]}"; do
	st=$(in_root dpkg-query -W -f '${db:Status-Status}' "$d" 2>/dev/null) || st=
	[ -z "$st" ] || [ "$st" = not-installed ] || fail "$d is $st after the purge"
done
# The dependencies the install pulled in go too; then the chroot is as it was.
apt_in_root autoremove --purge -y
snapshot >"$work/after"
left=$(comm -13 "$work/before" "$work/after")
[ -z "$left" ] || fail "left behind by the purge: $left"
echo "deb: packages $v1 and $v2: built, linted, installed, run, upgraded and purged"
