#!/bin/bash
# The guest runner: PID 1 of the VM after switch_root into the host's (read-only) tree. Sets up
# the veth pair and the rxe device, runs each suite's guest part in its own shell and writes
# results/NAME.{log,rc,time} into the work folder, then powers off in every case (no -e: a
# failing step must never skip the power-off; the EXIT trap is the last resort).
set -uo pipefail

W=$(dirname "$(dirname "$(readlink -f "$0")")") # this file is $W/vm/guest.sh
export PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp TMPDIR=/tmp LANG=C.UTF-8

finish() {
	sync
	echo "rtrs-vmtest: powering off"
	busybox poweroff -f
	sleep 60 # poweroff -f does not return; if it did, PID 1 exiting panics (panic=-1, -no-reboot)
}
trap finish EXIT

# shellcheck source=/dev/null
. "$W/env.sh"
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$W/vm/lib.sh"
R=$RTRS_VM_WORK/results
mkdir -p "$R"

echo "rtrs-vmtest: guest up at $(cut -d' ' -f1 /proc/uptime) s of uptime, kernel $(uname -r)"
cut -d' ' -f1 /proc/uptime >"$R/boot-uptime"

# Guest-side watchdog: powers off RTRS_VM_GUEST_TIMEOUT seconds after the kernel started, a
# little before the host kills qemu, so the results written so far reach the host and the VM
# ends cleanly.
(
	up=$(cut -d. -f1 /proc/uptime)
	sleep $((RTRS_VM_GUEST_TIMEOUT > up ? RTRS_VM_GUEST_TIMEOUT - up : 1))
	echo "rtrs-vmtest: guest watchdog: ${RTRS_VM_GUEST_TIMEOUT} s of uptime passed, powering off"
	sync
	busybox poweroff -f
) &

# Suites and setup run in fresh bash processes with -e in force (it would be off in a function
# called from a condition); timeout puts each in its own process group and kills it whole.
run_shell() { # run_shell LOG SECONDS FUNCTION [FILE-DEFINING-IT]
	# shellcheck disable=SC2016 # expanded by the child shell
	timeout -k 10 "$2" bash -c '
		set -euo pipefail
		. "$1"
		[ -z "$3" ] || . "$3"
		trap vm_cleanup EXIT
		cd /tmp
		"$2"' vmtest "$W/vm/lib.sh" "$3" "${4:-}" >"$1" 2>&1 </dev/null
}

t0=$(vm_now)
run_shell "$R/setup.log" 120 vm_guest_setup
rc=$?
echo "$rc" >"$R/setup.rc"
echo "rtrs-vmtest: setup rc=$rc in $(vm_since "$t0") s"
if [ "$rc" != 0 ]; then
	cat "$R/setup.log"
	exit 1
fi

for s in ${RTRS_VM_SUITES:?}; do
	echo "rtrs-vmtest: suite $s: running"
	t0=$(vm_now)
	export RTRS_VM_SUITE=$s
	run_shell "$R/$s.log" "$RTRS_VM_SUITE_TIMEOUT" guest "$W/vm/suites/$s.sh"
	rc=$?
	vm_since "$t0" >"$R/$s.time"
	echo "$rc" >"$R/$s.rc"
	echo "rtrs-vmtest: suite $s: rc=$rc in $(cat "$R/$s.time") s"
done
touch "$R/done"
