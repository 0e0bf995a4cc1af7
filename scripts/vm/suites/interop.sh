# shellcheck shell=bash
# Interoperation with the kernel's RTRS/RNBD (issue 12), first parts, both directions over
# verbs on two rxe paths:
# - the kernel's rnbd-client maps a file exported by our rtrs-serverd, with the server's
#   always_invalidate on and off: data written through /dev/rnbd0 reads back and lands in the
#   export, a file system made on it holds files, our server tree shows the kernel's session
#   and paths, and both sides count the same IO;
# - our rtrs-clientd opens a session to the kernel's rnbd-server (rtrs-server loaded with
#   always_invalidate Y, then N) and maps a loop device: data written through the device file
#   reads back and lands on the loop device, and both sides count the same IO.

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev e2fsprogs"

host() {
	vm_build_kernel_rtrs
	# ext4 and what it needs, from the VM's kernel (modules there, not built in).
	local kdir m
	kdir=$(ls -d "$RTRS_VM_CACHE"/kernel/*/lib/modules/"$RTRS_VM_KVER")
	for m in fs/mbcache fs/jbd2/jbd2 lib/crc16 crypto/crc32c_generic fs/ext4/ext4; do
		cp "$kdir/kernel/$m.ko" "$RTRS_VM_WORK/kmod/"
	done
	mkdir -p "$RTRS_VM_WORK/bin"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-serverd ./cmd/rtrs-clientd)
}

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	# The kernel's client side only: our server takes RNBD's port 1234.
	vm_load_kernel_rtrs rtrs-core rtrs-client rnbd-client
	local m
	for m in mbcache jbd2 crc16 crc32c_generic ext4; do
		vm_insmod "$RTRS_VM_WORK/kmod/$m.ko"
	done
	kernel_client_our_server true
	kernel_client_our_server false
	# Now the kernel's server takes port 1234.
	our_client_kernel_server Y
	our_client_kernel_server N
}

# our_client_kernel_server INV: rtrs-clientd against rnbd-server over rtrs-server loaded with
# always_invalidate=INV (a module parameter: read at load).
our_client_kernel_server() {
	local inv=$1 A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 T=/tmp/ks-$1 s=ks-$1 f
	echo "== rtrs-clientd -provider verbs → kernel rnbd-server, rtrs-server always_invalidate=$inv"
	vm_insmod "$RTRS_VM_WORK/kmod/rtrs-server.ko" always_invalidate="$inv"
	vm_insmod "$RTRS_VM_WORK/kmod/rnbd-server.ko"
	grep -q "$inv" /sys/module/rtrs_server/parameters/always_invalidate
	mkdir -p "$T"/cli "$T"/dev
	truncate -s 64M "$T"/disk
	local loop
	loop=$(losetup -f --show "$T"/disk)
	: >"$T"/clientd.conf
	rtrs-clientd -provider verbs -config "$T"/clientd.conf -mount "$T"/cli -dev-mount "$T"/dev \
		-nbd-socket "$T"/nbd.sock >"$T"/clientd.log 2>&1 &
	local cpid=$!
	vm_wait 30 mountpoint -q "$T"/dev || { cat "$T"/clientd.log; return 1; }
	echo "sessname=$s path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1" >"$T"/cli/ctl/open_session
	for f in "$T"/cli/"$s"/paths/*/state; do
		echo "$f: $(cat "$f")"
		[ "$(cat "$f")" = connected ]
	done
	echo "sessname=$s device_path=$loop access_mode=rw" >"$T"/dev/ctl/map_device
	# The device file is named by device_path without leading '/', each '/' shown as '!'.
	local dev
	dev="$T/dev/$s/$(printf '%s' "${loop#/}" | tr / '!')"
	head -c 16M /dev/urandom >"$T"/pat
	dd if="$T"/pat of="$dev" bs=1M conv=fsync status=none
	dd if="$dev" of="$T"/back bs=1M count=16 status=none
	cmp "$T"/pat "$T"/back
	dd if="$loop" of="$T"/onloop bs=1M count=16 iflag=direct status=none
	cmp "$T"/pat "$T"/onloop
	echo "kernel server stats/rdma: $(cat /sys/class/rtrs-server/"$s"/paths/*/stats/rdma | tr '\n' ' ')"
	echo "our client stats/rdma:    $(cat "$T"/cli/"$s"/paths/*/stats/rdma | tr '\n' ' ')"
	echo "sessname=$s device_path=$loop" >"$T"/dev/ctl/unmap_device
	echo "$s" >"$T"/cli/ctl/close_session
	kill $cpid
	wait $cpid
	busybox rmmod rnbd_server rtrs_server
	losetup -d "$loop"
}

# kernel_client_our_server INV: one mapping against rtrs-serverd -always-invalidate=INV.
kernel_client_our_server() {
	local inv=$1 A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 T=/tmp/kc-$1 s=kc-$1 f p
	echo "== kernel rnbd-client → rtrs-serverd -provider verbs -always-invalidate=$inv"
	mkdir -p "$T"/exports "$T"/srv "$T"/mnt
	truncate -s 256M "$T"/exports/disk
	rtrs-serverd -provider verbs -config /dev/null -listen "$A1:1234" -always-invalidate="$inv" \
		-dev-search-path "$T"/exports -mount "$T"/srv >"$T"/serverd.log 2>&1 &
	local spid=$!
	vm_wait 30 mountpoint -q "$T"/srv || { cat "$T"/serverd.log; return 1; }
	echo "sessname=$s path=ip:$A1 path=ip:$A2@ip:$A1 device_path=disk" >/sys/class/rnbd-client/ctl/map_device
	vm_wait 10 test -b /dev/rnbd0
	for f in /sys/class/rtrs-client/"$s"/paths/*/state; do
		echo "$f: $(cat "$f")"
		[ "$(cat "$f")" = connected ]
	done
	# Our tree names the kernel's session and paths as the kernel's own server tree would.
	for p in "ip:$A1@ip:$A1" "ip:$A2@ip:$A1"; do
		test -d "$T/srv/$s/paths/$p"
		echo "$p: hca_name $(cat "$T/srv/$s/paths/$p/hca_name") src_addr $(cat "$T/srv/$s/paths/$p/src_addr")"
	done
	# Random data, direct IO, in 1 MiB and 4 KiB blocks.
	head -c 16M /dev/urandom >"$T"/pat
	dd if="$T"/pat of=/dev/rnbd0 bs=1M oflag=direct status=none
	dd if="$T"/pat of=/dev/rnbd0 bs=4k seek=8192 count=1024 oflag=direct status=none
	dd if=/dev/rnbd0 of="$T"/back bs=1M count=16 iflag=direct status=none
	cmp "$T"/pat "$T"/back
	dd if=/dev/rnbd0 of="$T"/back4k bs=4k skip=8192 count=1024 iflag=direct status=none
	cmp_files "$T"/pat "$T"/back4k 4194304
	head -c 16M "$T"/exports/disk >"$T"/exp
	cmp "$T"/pat "$T"/exp
	# A file system over it.
	mkfs.ext4 -q -F /dev/rnbd0
	mount /dev/rnbd0 "$T"/mnt
	cp "$T"/pat "$T"/mnt/pattern
	mkdir "$T"/mnt/d && seq 1 20000 >"$T"/mnt/d/seq
	umount "$T"/mnt
	mount /dev/rnbd0 "$T"/mnt
	cmp "$T"/pat "$T"/mnt/pattern
	[ "$(seq 1 20000 | md5sum)" = "$(md5sum <"$T"/mnt/d/seq)" ]
	umount "$T"/mnt
	echo "client stats/rdma: $(cat /sys/class/rtrs-client/"$s"/paths/*/stats/rdma | tr '\n' ' ')"
	echo "server stats/rdma: $(cat "$T"/srv/"$s"/paths/*/stats/rdma | tr '\n' ' ')"
	echo normal >/sys/block/rnbd0/rnbd/unmap_device
	vm_wait 10 test ! -e /dev/rnbd0
	kill $spid
	wait $spid
}

# cmp_files A B N: the first N bytes of A against all of B (the guest has no /dev/fd for
# process substitution).
cmp_files() {
	head -c "$3" "$1" >"$2.want"
	cmp "$2.want" "$2"
}
