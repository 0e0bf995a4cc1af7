#!/usr/bin/env bash
# Host-side checks of lib.sh's helpers that need no VM, on made-up inputs (scripts/test.sh runs
# it): vm_require_tests against Go test logs that pass, and against each way a selection by
# name can come out empty or short.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fails=0

# expect WANT LOG NAME...: vm_require_tests' verdict on LOG is WANT (pass or fail).
expect() {
	local want=$1 got=pass
	shift
	vm_require_tests "$@" 2>"$t/err" || got=fail
	if [ "$got" != "$want" ]; then
		echo "FAIL: vm_require_tests $*: $got, want $want ($(tr '\n' ' ' <"$t/err"))"
		fails=$((fails + 1))
	fi
}

cat >"$t/ok" <<'LOG'
=== RUN   TestA
--- PASS: TestA (0.01s)
=== RUN   TestB
=== RUN   TestB/sub
    --- PASS: TestB/sub (0.00s)
--- PASS: TestB (1.20s)
PASS
LOG
expect pass "$t/ok" TestA TestB
expect pass "$t/ok" TestB/sub
# A name the selection was meant to run but did not (renamed): no PASS line for it.
expect fail "$t/ok" TestA TestC
# A prefix is not the name.
expect fail "$t/ok" TestB/su

printf 'testing: warning: no tests to run\nPASS\n' >"$t/none"
expect fail "$t/none" TestA

cat >"$t/skip" <<'LOG'
=== RUN   TestA
--- PASS: TestA (0.01s)
=== RUN   TestB
    b_test.go:9: no device
--- SKIP: TestB (0.00s)
PASS
LOG
expect fail "$t/skip" TestA
expect fail "$t/skip" TestA TestB

cat >"$t/failed" <<'LOG'
=== RUN   TestA
--- FAIL: TestA (0.01s)
FAIL
LOG
expect fail "$t/failed" TestA

: >"$t/empty"
expect fail "$t/empty" TestA
expect fail "$t/missing-file" TestA

# A PASS of the name in the middle of a line (a log message) does not count.
printf 'x.go:1: saw --- PASS: TestA (0.00s)\nPASS\n' >"$t/quoted"
expect fail "$t/quoted" TestA

# vm_check_layout: the work folder's copy as vmtest.sh makes it passes; without apt-install.sh
# (the copy of 4799879, which failed on a fresh machine only) or without a suite's file it fails.
here=$(dirname "${BASH_SOURCE[0]}")
layout() { # layout DIR: the scripts copied as vmtest.sh copies them
	mkdir -p "$1/vm/suites"
	cp "$here/lib.sh" "$here/guest.sh" "$1/vm/"
	cp "$here/../apt-install.sh" "$1/"
	cp "$here"/suites/*.sh "$1/vm/suites/"
}
check_layout() { # check_layout WANT DIR GENERATED...
	local want=$1 got=pass
	shift
	vm_check_layout "$@" 2>"$t/err" || got=fail
	if [ "$got" != "$want" ]; then
		echo "FAIL: vm_check_layout $*: $got, want $want ($(tr '\n' ' ' <"$t/err"))"
		fails=$((fails + 1))
	fi
}
layout "$t/w1"
check_layout pass "$t/w1" env.sh
check_layout fail "$t/w1" # env.sh is named by guest.sh and not there
rm "$t/w1/apt-install.sh"
check_layout fail "$t/w1" env.sh
layout "$t/w2"
rm "$t/w2/vm/lib.sh"
check_layout fail "$t/w2" env.sh

# vm_kernel_module and vm_insmod on a made-up kernel tree laid out as 7.2's (usr/lib/modules,
# .ko.xz), with names no host kernel has loaded (vm_insmod looks at /sys/module): xfs_ stands
# for ext4, xjbd for jbd2, xcache for mbcache, xcrc for crc16 (moved: lib/xcrc -> lib/crc/xcrc),
# xgone for crc32c_generic (gone: NAME.none, skipped by vm_insmod), xcore for a built-in
# dependency (left out). Dependencies are copied and loaded first.
check() { # check DESCRIPTION CMD...: CMD succeeds
	local d=$1
	shift
	"$@" 2>"$t/err" || {
		echo "FAIL: $d ($(tr '\n' ' ' <"$t/err"))"
		fails=$((fails + 1))
	}
}
fakemod() { # fakemod FILE DEPENDS: a "module" with a modinfo-like depends= field, xz-compressed
	mkdir -p "$(dirname "$1")"
	printf 'license=GPL\0depends=%s\0name=%s\0' "$2" "$(basename "$1")" | xz >"$1.ko.xz"
}
if command -v xz >/dev/null; then
	k=$t/kdir m=$t/kdir/usr/lib/modules/9.9.9-test/kernel
	fakemod "$m/fs/xfs_/xfs_" xjbd,xcrc,xcache
	fakemod "$m/fs/xjbd/xjbd" ""
	fakemod "$m/fs/xcache" ""
	fakemod "$m/lib/crc/xcrc" xcore
	printf 'kernel/lib/crc/xcore.ko\n' >"$m/../modules.builtin"
	(
		fails=0
		export RTRS_VM_KDIR=$k RTRS_VM_KVER=9.9.9-test RTRS_VM_WORK=$t/work
		check "vm_kernel_moddir" test "$(vm_kernel_moddir)" = "$k/usr/lib/modules/9.9.9-test"
		check "vm_kernel_module" vm_kernel_module fs/xcache lib/xcrc crypto/xgone fs/xfs_/xfs_
		check "xfs_ decompressed" grep -q 'depends=xjbd,xcrc,xcache' "$t/work/kmod/xfs_.ko"
		check "xjbd copied as a dependency" test -f "$t/work/kmod/xjbd.ko"
		check "xcrc found where it moved" test -f "$t/work/kmod/xcrc.ko"
		check "xgone marked missing" test -f "$t/work/kmod/xgone.none"
		check "no xcore (built in)" test ! -e "$t/work/kmod/xcore.ko"
		# shellcheck disable=SC2317 # called by vm_insmod
		busybox() { echo "$*" >>"$t/insmod.log"; } # the guest's insmod, recorded
		check "vm_insmod of a missing module" vm_insmod "$t/work/kmod/xgone.ko"
		check "vm_insmod xfs_" vm_insmod "$t/work/kmod/xfs_.ko" a=1
		check "dependencies first, parameters to the module named" test \
			"$(sed "s|$t/work/kmod/||" "$t/insmod.log" | tr '\n' ' ')" = \
			"insmod xjbd.ko insmod xcrc.ko insmod xcache.ko insmod xfs_.ko a=1 "
		exit "$fails"
	) || fails=$((fails + $?))
else
	echo "selftest: no xz here; vm_kernel_module not checked"
fi

if [ "$fails" -gt 0 ]; then
	echo "selftest: $fails failed"
	exit 1
fi
echo "selftest: vm_require_tests, vm_check_layout, vm_kernel_module and vm_insmod ok"
