#!/usr/bin/env bash
# The project's test command: installs what it needs on a fresh Debian machine (as root), then
# checks formatting, vets (with and without the verbs provider), runs every test under the race
# detector, the Debian packages' test (scripts/deb/test.sh), the VM suites over real verbs
# (scripts/vmtest.sh) and a short run of each fuzz target. Usage: scripts/test.sh [--no-fuzz]
set -euo pipefail
cd "$(dirname "$0")/.."

fuzz=1
[ "${1:-}" = "--no-fuzz" ] && fuzz=0

# fuzz_target PKG NAME: a short fuzz run of one target. Any failure fails, a crasher above all:
# the fuzz engine writes it under the package's testdata/fuzz/NAME, where it stays a seed that
# fails every later `go test`, and it is never run again to see whether it "reproduces". The
# one thing tried again (twice at most) is the engine failing to start a worker, which it
# reports as "fuzzing process terminated without fuzzing" and for which it records no input.
# The run is a count of inputs, not a duration: Go's coordinator (up to 1.26) can fail a target
# that found nothing with "context deadline exceeded" when a -fuzztime duration ends
# (go.dev/issue/75804); a count sets no deadline. 100000 inputs take 2 to 12 s per target here.
fuzz_target() {
	local pkg=$1 f=$2 try out
	for try in 1 2 3; do
		if out=$(go test -run '^$' -fuzz "^$f\$" -fuzztime "${FUZZTIME:-100000x}" "$pkg" 2>&1); then
			return 0
		fi
		printf '%s\n' "$out" | tail -n 40
		if grep -q 'Failing input written to' <<<"$out"; then
			echo "-- $pkg $f: CRASH, input saved: $(grep -o 'testdata/fuzz/[^ ]*' <<<"$out" | head -1)"
			return 1
		fi
		if ! grep -q 'fuzzing process terminated without fuzzing' <<<"$out"; then
			echo "-- $pkg $f: FAILED"
			return 1
		fi
		echo "-- $pkg $f: the fuzz engine could not run its worker (above, no input recorded); try $((try + 1))"
	done
	echo "-- $pkg $f: the fuzz engine failed three times"
	return 1
}

# Go: /usr/local/go's when there is one; without any, Debian's golang-go, which is older than
# go.mod asks for and fetches the Go release go.mod names (scripts/go-toolchain.sh, below).
[ -x /usr/local/go/bin/go ] && export PATH="/usr/local/go/bin:$PATH"
need=()
command -v go >/dev/null || need+=(golang-go)
[ -f /etc/ssl/certs/ca-certificates.crt ] || need+=(ca-certificates) # Go's module proxy is https
command -v gcc >/dev/null || need+=(gcc libc6-dev) # the race detector needs cgo
command -v ip >/dev/null || need+=(iproute2)
# NBD clients the block-service tests drive, and the peers of the benchmarks.
command -v nbdinfo >/dev/null || need+=(libnbd-bin)
command -v nbdkit >/dev/null || need+=(nbdkit)
command -v fio >/dev/null || need+=(fio)
command -v qemu-img >/dev/null || need+=(qemu-utils)
# What the end-to-end tests drive: namespaces, users, loop devices, file systems.
command -v nsenter >/dev/null || need+=(util-linux)
command -v losetup >/dev/null || need+=(mount)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v tc >/dev/null || need+=(iproute2)
command -v promtool >/dev/null || need+=(prometheus) # e2e TestMetrics lints the scrapes
command -v curl >/dev/null || need+=(curl)
# rdma-core's development files: the verbs provider is vetted and built on every run (its
# tests run in the VM, scripts/vmtest.sh).
[ -f /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
[ -f /usr/include/rdma/rdma_cma.h ] || need+=(librdmacm-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
# Shows what it installs; waits for a held apt or dpkg lock instead of failing.
scripts/apt-install.sh ${need[@]+"${need[@]}"}
# A go command that builds the module: go.mod's release, fetched through the Go module proxy
# and checked against the checksum database when the go found is older.
. scripts/go-toolchain.sh
rtrs_use_go
go version
export CGO_ENABLED=1
# The NBD clients were installed above: a test that cannot find one fails instead of skipping.
export RTRS_REQUIRE_TOOLS=1
go mod download

echo "== gofmt"
bad=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$bad" ]; then
	echo "gofmt would change:"; echo "$bad"; exit 1
fi
echo "== go vet"
go vet ./...
go vet -tags verbs ./...
echo "== staticcheck"
# Pinned; built from the module proxy into the Go cache's bin directory.
sc_bin="$(go env GOPATH)/bin/staticcheck"
[ -x "$sc_bin" ] || go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
"$sc_bin" ./...
"$sc_bin" -tags verbs ./...
echo "== go test -race"
go test -race -count=1 -timeout 20m ./...
echo "== load: 64 clients × 2 paths × QD128 at once, the server restarted under them (no race detector)"
go test -count=1 -timeout 10m -run '^TestLoadStorm$' -v ./pkg/transport | tee /tmp/rtrs-loadstorm.log |
	grep -E '^(=== RUN|--- |ok|FAIL|PASS)|load_test'
# Selected by name: a renamed test must not pass as "no tests to run".
grep -q '^--- PASS: TestLoadStorm ' /tmp/rtrs-loadstorm.log || { echo "TestLoadStorm did not run and pass"; exit 1; }

echo "== Debian packages: built, linted, installed in a Debian 12 chroot, run, upgraded, purged"
scripts/deb/test.sh

echo "== VM bed helpers (host side, made-up inputs)"
scripts/vm/selftest.sh
echo "== VM suites on each kernel (rxe verbs in a qemu VM: scripts/vmtest.sh)"
# Real RDMA: Debian's kernels with Soft-RoCE in a VM, the verbs provider's conformance and
# engine tests, both daemons over verbs, rdma-perf beside perftest, interoperation with the
# kernel's RTRS/RNBD, NBD block devices, ublk. One VM after another (two at once on two cores
# run slower than in turn: each VM's two emulated CPUs wait on each other). Every suite runs on
# 6.12, bookworm-backports' LTS; 6.1 and 7.2 run every suite but nbd (the kernel's NBD driver
# is driven on every kernel by the interop suite's RNBD 2.2 checks through our export), without
# the interop suite's mpath_policy check and the verbs suite's rdma-perf figures (neither
# depends on the kernel): all of it on the three kernels no longer fit CI's 90 minutes on a
# slow machine. Any failure fails the run, after both runs.
vm_rc=0
scripts/vmtest.sh -k 6.12 || vm_rc=1
INTEROP_POLICIES=0 VERBS_PERF=0 scripts/vmtest.sh -k 6.1,7.2 interop smoke ublk verbs || vm_rc=1
[ "$vm_rc" = 0 ] || { echo "VM suites failed (above)"; exit 1; }

if [ "$fuzz" = 1 ]; then
	echo "== fuzz (short runs of every target)"
	fuzz_fail=()
	# Each target runs from its committed seed corpus plus 100000 new inputs.
	for pkg in $(go list ./...); do
		dir=$(go list -f '{{.Dir}}' "$pkg")
		for f in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //'); do
			echo "-- $pkg $f"
			fuzz_target "$pkg" "$f" || fuzz_fail+=("$pkg $f")
		done
	done
	if [ ${#fuzz_fail[@]} -gt 0 ]; then
		printf 'fuzz failed: %s\n' "${fuzz_fail[@]}"
		exit 1
	fi
fi
echo "all tests passed"
