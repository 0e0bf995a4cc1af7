# shellcheck shell=bash
# Real block devices (issue 12 §4): pkg/nbd's Attach against the kernel's NBD (TestKernelAttach);
# then rtrs-serverd and rtrs-clientd with -provider verbs over two rxe paths, a mapped device as
# /dev/nbdX through
# - the kernel's nbd-client against rtrs-clientd's NBD socket, and
# - rtrs-clientd attaching it itself (map_device nbd=auto, the kernel's NBD netlink family);
# each time: ext4 made, mounted, files read back after a remount; fio with verify=crc32c
# (random 4 KiB writes, then sequential 1 MiB) while one of the two paths is disconnected and
# reconnected: no IO error, verify passes, the path comes back; the attached device resized
# after its export grew on the server (/sys/block/nbdX/size follows, IO past the old end reads
# back). Then: unmap while nbd-client
# or a loop device holds the device, or of a mounted attachment, is EBUSY, unmap detaches (/sys/block/nbdX/pid gone, size 0), losetup over the
# device file in the device view, a daemon killed with an attachment is cleaned up after by the
# next one (which attaches again from its written-back declarations), and a daemon that stops
# detaches what it attached.

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev nbd-client fio e2fsprogs"

host() {
	# ext4 and what it needs, from the VM's kernel (modules there, not built in; decompressed,
	# looked up where a kernel moved them, skipped where it has no such module).
	vm_kernel_module fs/mbcache fs/jbd2/jbd2 lib/crc16 crypto/crc32c_generic fs/ext4/ext4
	mkdir -p "$RTRS_VM_WORK/bin"
	(
		cd "$RTRS_VM_REPO" || exit
		go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-serverd ./cmd/rtrs-clientd
		go test -c -o "$RTRS_VM_WORK/bin/nbd.test" ./pkg/nbd
	)
}

T=/tmp/nbd
PORT=11235 # not RNBD's 1234: another suite may have loaded the kernel's rnbd-server

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local m rc=0
	for m in mbcache jbd2 crc16 crc32c_generic ext4; do
		vm_insmod "$RTRS_VM_WORK/kmod/$m.ko"
	done
	# The bed loads nbd; without it this suite proves nothing: fail, never skip.
	[ -d /sys/module/nbd ] || { echo "no nbd module in the guest"; return 1; }
	test -b /dev/nbd0
	nbd-client -V 2>&1 | sed -n 1p || true
	mkdir -p $T/exports $T/srv $T/cli $T/dev $T/mnt
	for m in disk1 disk2; do truncate -s 256M $T/exports/$m; done
	truncate -s 64M $T/exports/disk3
	truncate -s 16M $T/exports/disk4
	: >$T/clientd.conf
	# The body runs in the background so that errexit holds in it while a failure still
	# lets us print the daemons' logs.
	suite_body &
	wait $! || rc=$?
	if [ "$rc" != 0 ]; then
		echo "== FAILED (rc=$rc); rtrs-clientd log:"
		tail -60 $T/clientd.log || true
		echo "== rtrs-serverd log:"
		tail -30 $T/serverd.log || true
		echo "== dmesg:"
		dmesg | tail -40 || true
		for m in "$T"/fio-*.out; do
			if [ -e "$m" ]; then
				echo "== $m"
				tail -30 "$m"
			fi
		done
	fi
	# Whatever is still running (after a failure) goes.
	for m in $T/cpid $T/spid; do
		if [ -e "$m" ]; then kill "$(cat "$m")" 2>/dev/null || true; fi
	done
	cp $T/clientd.log $T/serverd.log "$RTRS_VM_WORK/results/" 2>/dev/null || true
	return "$rc"
}

suite_body() {
	local A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 nbd idx cpid
	P1="$T/cli/s1/paths/ip:$A1@ip:$A1"
	P2="$T/cli/s1/paths/ip:$A2@ip:$A1"

	echo "== pkg/nbd's Attach against the kernel (TestKernelAttach)"
	RTRS_TEST_NBD=1 nbd.test -test.run '^TestKernelAttach$' -test.v -test.count 1 2>&1 | tee $T/kernel-test.out
	vm_require_tests $T/kernel-test.out TestKernelAttach

	rtrs-serverd -provider verbs -config /dev/null -listen "$A1:$PORT" -dev-search-path $T/exports \
		-mount $T/srv -rnbd-mount $T/rnbd -names-file $T/names.json >$T/serverd.log 2>&1 &
	echo $! >$T/spid
	start_clientd
	vm_wait 30 mountpoint -q $T/srv
	grep -q "provider verbs" $T/serverd.log
	echo "sessname=s1 dest_port=$PORT path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1" >$T/cli/ctl/open_session
	path_connected "$P1"
	path_connected "$P2"

	echo "== nbd-client → rtrs-clientd's NBD socket → s1/disk1"
	echo "sessname=s1 device_path=disk1" >$T/dev/ctl/map_device
	nbd-client -unix $T/nbd.sock /dev/nbd0 -name s1/disk1
	vm_wait 10 test -e /sys/block/nbd0/pid
	echo "/dev/nbd0: $(($(cat /sys/block/nbd0/size) * 512)) bytes, pid $(cat /sys/block/nbd0/pid)"
	[ "$(cat /sys/block/nbd0/size)" = $((256 << 11)) ]
	fs_check /dev/nbd0 a
	fio_check /dev/nbd0 nbdclient
	# The socket client holds the device: a normal unmap refuses, naming it.
	if echo "sessname=s1 device_path=disk1" >$T/dev/ctl/unmap_device 2>$T/err; then
		echo "unmap succeeded while nbd-client used the device"
		return 1
	fi
	grep -q "busy" $T/err
	grep -q "NBD client pid" $T/clientd.log
	nbd-client -d /dev/nbd0
	vm_wait 10 detached 0
	echo "sessname=s1 device_path=disk1" >$T/dev/ctl/unmap_device

	echo "== rtrs-clientd attaches s1/disk2 itself: map_device nbd=auto"
	# A bad token changes nothing.
	if echo "sessname=s1 device_path=disk2 nbd=nbd0" >$T/dev/ctl/map_device 2>$T/err; then
		echo "nbd=nbd0 accepted"
		return 1
	fi
	grep -q "Invalid argument" $T/err
	[ ! -e $T/dev/s1/disk2 ]
	[ -z "$(cat $T/dev/ctl/nbd_devices)" ]
	echo "sessname=s1 device_path=disk2 nbd=auto" >$T/dev/ctl/map_device
	cat $T/dev/ctl/nbd_devices
	nbd=$(awk '$1 == "s1/disk2" { print $2 }' $T/dev/ctl/nbd_devices)
	idx=${nbd#/dev/nbd}
	test -b "$nbd"
	echo "$nbd: $(($(cat /sys/block/nbd"$idx"/size) * 512)) bytes, backend \"$(cat /sys/block/nbd"$idx"/backend)\", $(find /sys/block/nbd"$idx"/mq/ -mindepth 1 -maxdepth 1 | wc -l) hardware queues"
	[ "$(cat /sys/block/nbd"$idx"/size)" = $((256 << 11)) ]
	grep -q "^rtrs-clientd\[[0-9]*\] s1/disk2 " /sys/block/nbd"$idx"/backend
	grep -q "nbd=auto" $T/clientd.conf # written back
	fs_check "$nbd" b
	fio_check "$nbd" attached
	echo "-- resize: s1/disk2 grown on the server, then the device (NBD_CMD_RECONFIGURE)"
	truncate -s 512M $T/exports/disk2
	echo $((512 << 11)) >$T/dev/ctl/mapped/disk2@s1/resize
	[ "$(cat /sys/block/nbd"$idx"/size)" = $((512 << 11)) ]
	[ "$(blockdev --getsize64 "$nbd")" = $((512 << 20)) ]
	head -c 1M /dev/urandom >$T/mb
	dd if=$T/mb of="$nbd" bs=1M seek=400 oflag=direct status=none
	dd if="$nbd" of=$T/mb.back bs=1M skip=400 count=1 iflag=direct status=none
	cmp $T/mb $T/mb.back
	grep -q "resized to $((512 << 20)) bytes" $T/clientd.log
	echo "$nbd: $(blockdev --getsize64 "$nbd") bytes after resize, 1 MiB at 400 MiB read back"
	# Mounted: unmap refuses (EBUSY) and leaves it attached. (fio overwrote the file system.)
	mkfs.ext4 -q -F "$nbd"
	mount "$nbd" $T/mnt
	if echo "sessname=s1 device_path=disk2" >$T/dev/ctl/unmap_device 2>$T/err; then
		echo "unmap of a mounted attachment succeeded"
		return 1
	fi
	grep -q "busy" $T/err
	grep -q "s1/disk2 $nbd" $T/dev/ctl/nbd_devices
	test -e /sys/block/nbd"$idx"/pid
	umount $T/mnt
	echo "sessname=s1 device_path=disk2" >$T/dev/ctl/unmap_device
	vm_wait 10 detached "$idx"
	echo "$nbd after unmap: size $(cat /sys/block/nbd"$idx"/size), no pid file"
	[ -z "$(cat $T/dev/ctl/nbd_devices)" ]
	[ ! -e $T/dev/s1/disk2 ]

	echo "== losetup over the device file (no NBD)"
	echo "sessname=s1 device_path=disk3" >$T/dev/ctl/map_device
	local loop
	loop=$(losetup -f --show $T/dev/s1/disk3)
	echo "$loop over $T/dev/s1/disk3: $(blockdev --getsize64 "$loop") bytes"
	[ "$(blockdev --getsize64 "$loop")" = $((64 << 20)) ]
	head -c 8M /dev/urandom >$T/pat8
	dd if=$T/pat8 of="$loop" bs=1M seek=4 oflag=direct status=none
	dd if=$T/dev/s1/disk3 of=$T/back8 bs=1M skip=4 count=8 status=none
	cmp $T/pat8 $T/back8
	head -c 12M $T/exports/disk3 | tail -c 8M >$T/exp8
	cmp $T/pat8 $T/exp8
	# The loop device holds the device file: a normal unmap refuses.
	if echo "sessname=s1 device_path=disk3" >$T/dev/ctl/unmap_device 2>$T/err; then
		echo "unmap succeeded under losetup"
		return 1
	fi
	grep -q "device view file" $T/clientd.log
	losetup -d "$loop"
	echo "sessname=s1 device_path=disk3" >$T/dev/ctl/unmap_device

	echo "== a daemon killed with an attachment; the next one cleans up and attaches again"
	echo "sessname=s1 device_path=disk4 nbd=auto" >$T/dev/ctl/map_device
	nbd=$(awk '$1 == "s1/disk4" { print $2 }' $T/dev/ctl/nbd_devices)
	idx=${nbd#/dev/nbd}
	test -e /sys/block/nbd"$idx"/pid
	head -c 4M /dev/urandom >$T/pat4
	dd if=$T/pat4 of="$nbd" bs=1M oflag=direct status=none
	grep "map_device sessname=s1 device_path=disk4 .*nbd=auto" $T/clientd.conf
	kill -9 "$cpid"
	wait "$cpid" || true
	# The kernel keeps the device configured, its sockets dead, until someone disconnects it.
	sleep 1
	test -e /sys/block/nbd"$idx"/pid
	echo "$nbd after kill -9: still configured, backend \"$(cat /sys/block/nbd"$idx"/backend)\""
	start_clientd
	grep "left attached by an rtrs-clientd that is gone" $T/clientd.log | sed 's/^/clientd: /'
	# The declarations written back bring the session and the attachment back.
	# (The old session may hold the device on the server until it notices the kill: the
	# declarations are retried.)
	vm_wait 120 grep -q "^s1/disk4 " $T/dev/ctl/nbd_devices
	nbd=$(awk '$1 == "s1/disk4" { print $2 }' $T/dev/ctl/nbd_devices)
	idx=${nbd#/dev/nbd}
	grep -q "^rtrs-clientd\[$cpid\] s1/disk4 " /sys/block/nbd"$idx"/backend
	dd if="$nbd" of=$T/back4 bs=1M count=4 iflag=direct status=none
	cmp $T/pat4 $T/back4
	echo "after the restart: s1/disk4 on $nbd again, the data written before the kill read back"

	echo "== a daemon that stops detaches what it attached"
	kill "$cpid"
	vm_wait 30 detached "$idx"
	vm_wait 30 not_mounted $T/dev
	echo "$nbd after rtrs-clientd stopped: size $(cat /sys/block/nbd"$idx"/size), no pid file"
	grep "detached" $T/clientd.log | sed 's/^/clientd: /'
	kill "$(cat $T/spid)"
	vm_wait 30 not_mounted $T/srv
	rm -f $T/cpid $T/spid
	# No NBD device is left connected.
	if ls /sys/block/nbd*/pid 2>/dev/null; then
		echo "NBD devices left connected"
		return 1
	fi
}

# start_clientd: rtrs-clientd in the background (pid in $cpid and $T/cpid), its tree mounted.
start_clientd() {
	rtrs-clientd -provider verbs -config $T/clientd.conf -mount $T/cli -dev-mount $T/dev \
		-nbd-socket $T/nbd.sock >>$T/clientd.log 2>&1 &
	cpid=$!
	echo $cpid >$T/cpid
	vm_wait 30 test -e $T/dev/ctl/map_device
	grep -q "provider verbs" $T/clientd.log
}

path_connected() { vm_wait 60 grep -qx connected "$1/state"; }
not_mounted() { ! mountpoint -q "$1"; }
# detached IDX: /dev/nbdIDX has no connection any more.
detached() { [ ! -e /sys/block/nbd"$1"/pid ] && [ "$(cat /sys/block/nbd"$1"/size)" = 0 ]; }

# fs_check DEV TAG: ext4 made on DEV, files written, read back after a remount.
fs_check() {
	local dev=$1 tag=$2
	mkfs.ext4 -q -F "$dev"
	mount "$dev" $T/mnt
	head -c 16M /dev/urandom >$T/pat-"$tag"
	cp $T/pat-"$tag" $T/mnt/pattern
	mkdir $T/mnt/d
	seq 1 20000 >$T/mnt/d/seq
	umount $T/mnt
	mount "$dev" $T/mnt
	cmp $T/pat-"$tag" $T/mnt/pattern
	[ "$(seq 1 20000 | md5sum)" = "$(md5sum <$T/mnt/d/seq)" ]
	df -h $T/mnt | tail -1
	umount $T/mnt
	echo "ext4 on $dev: files read back after a remount"
}

# fio_check DEV TAG: fio with verify=crc32c, random 4 KiB writes with path 2 disconnected and
# reconnected while it runs, then sequential 1 MiB with path 1; fio must finish without
# error, verify must pass, the kernel must log no IO error, and the paths come back.
fio_check() {
	local dev=$1 tag=$2
	fio_with_failover "$dev" "$tag"-rand4k "$P2" --rw=randwrite --bs=4k --size=24m --iodepth=32 \
		--verify_backlog=4096
	fio_with_failover "$dev" "$tag"-seq1m "$P1" --rw=write --bs=1M --size=64m --iodepth=8
}

# fio_with_failover DEV NAME PATHDIR FIO-ARGS...
fio_with_failover() {
	local dev=$1 name=$2 p=$3 out=$T/fio-$2.out n0 fp t0
	shift 3
	n0=$(dmesg | wc -l)
	t0=$(vm_now)
	fio --name="$name" --filename="$dev" --direct=1 --ioengine=libaio --verify=crc32c \
		--verify_fatal=1 --randrepeat=0 "$@" --output="$out" &
	fp=$!
	sleep 2
	if ! kill -0 $fp 2>/dev/null; then
		echo "fio $name ended before the path was disconnected"
		wait $fp || true
		cat "$out"
		return 1
	fi
	echo 1 >"$p/disconnect"
	echo "$name: disconnected $(basename "$p") after $(vm_since "$t0") s: $(cat "$p/state")"
	sleep 2
	echo 1 >"$p/reconnect"
	path_connected "$p"
	echo "$name: reconnected after $(vm_since "$t0") s, fio still running: $(kill -0 $fp 2>/dev/null && echo yes || echo no)"
	wait $fp
	echo "$name: fio done in $(vm_since "$t0") s"
	grep -E "err= *0|READ:|WRITE:|verify" "$out" | sed "s/^ */  /"
	grep -q "err= 0" "$out"
	if dmesg | tail -n +$((n0 + 1)) | grep -E "I/O error|nbd[0-9]+: (Connection timed out|Receive control failed|Send control failed|Dead connection)"; then
		echo "the kernel logged errors during fio $name"
		return 1
	fi
	echo "$name: reconnects $(cat "$p/stats/reconnects")"
}
