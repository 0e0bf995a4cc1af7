#!/bin/busybox sh
# shellcheck shell=sh
# /init of the test bed's initramfs (busybox only). Loads the kernel modules listed in
# /modules/list (in dependency order, put there by vmtest.sh), mounts the host's root read-only
# and the run's work folder read-write over 9p, and hands over to the guest runner in the host's
# tree. Any failure powers the VM off, so qemu ends and the host reports the missing results.
/bin/busybox --install -s /bin
export PATH=/bin

fail() {
	echo "rtrs-vmtest init: FAILED: $*"
	poweroff -f
	sleep 60
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

while read -r m; do
	insmod "/modules/$m" || fail "insmod $m"
done </modules/list

# The work folder's path in the guest comes on the kernel command line (rtrs_work=PATH).
work=$(sed -n 's/.*rtrs_work=\([^ ]*\).*/\1/p' /proc/cmdline)
[ -n "$work" ] || fail "no rtrs_work= on the kernel command line"

opts=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /newroot
# The host's files do not change while the VM runs: read-only shares are cached in the guest
# (cache=loose), which made the nbd and smoke suites 15 % faster (an exec reads its binary and
# libraries over 9p again without it). The work folder, which both sides write, is not cached.
mount -t 9p -o "$opts,ro,cache=loose" hostroot /newroot || fail "mount hostroot"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs shm /newroot/dev/shm
# The shared root is read-only: everything written in the guest goes to tmpfs or the work folder.
mount -t tmpfs run /newroot/run
mount -t tmpfs tmp /newroot/tmp
mkdir -p "/newroot$work"
mount -t 9p -o "$opts" work "/newroot$work" || fail "mount work"
# A repository under the host's /tmp or /run comes as its own share (rtrs_repo=PATH).
repo=$(sed -n 's/.*rtrs_repo=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$repo" ]; then
	mkdir -p "/newroot$repo"
	mount -t 9p -o "$opts,ro,cache=loose" repo "/newroot$repo" || fail "mount repo"
fi
[ -f "/newroot$work/vm/guest.sh" ] || fail "no $work/vm/guest.sh"
exec switch_root /newroot /bin/bash "$work/vm/guest.sh"
