# shellcheck shell=bash
# Interoperation with the kernel's RTRS/RNBD (issue 12), both directions over verbs on two rxe
# paths:
# - the kernel's rnbd-client maps a file exported by our rtrs-serverd, with the server's
#   always_invalidate on and off: fio verifies (crc32c) random 4 KiB and sequential 1 MiB IO
#   on /dev/rnbd0, a file system holds files; with always_invalidate on, fio keeps verifying
#   while a path is disconnected from the kernel client's tree and another from our server's
#   tree, then our server is killed and restarted and the kernel client reconnects to it;
# - our rtrs-clientd maps a loop device from the kernel's rnbd-server (rtrs-server loaded with
#   always_invalidate Y, then N): fio verifies through the device file and through our NBD
#   export; with Y, fio keeps verifying while a path is disconnected from our tree and another
#   from the kernel server's tree, and while the kernel's modules are removed and loaded
#   again; mpath_policy is switched under load and each policy's split shows in stats/rdma;
# - force_close both ways: in our rnbd-server tree with the kernel's client on it, and in the
#   kernel's /sys/class/rnbd-server with our client on it (kc_force_close, ks_force_close);
# - the kernel's trees and ours are listed file by file and compared (compare_trees);
# - fio figures (4 KiB QD32, 1 MiB QD8) kernel→kernel, kernel→ours, ours→kernel
#   (results/interop-figures.md).

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev e2fsprogs fio"

host() {
	vm_build_kernel_rtrs
	# ext4 and what it needs, and netem that slows one path (policies), from the VM's kernel
	# (modules there, not built in).
	vm_kernel_module fs/mbcache fs/jbd2/jbd2 lib/crc16 crypto/crc32c_generic fs/ext4/ext4 \
		net/sched/sch_netem
	mkdir -p "$RTRS_VM_WORK/bin"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-serverd ./cmd/rtrs-clientd)
}

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	R=$RTRS_VM_WORK/results
	mkdir -p "$R"/trees
	# The kernel's client side only: our server takes RNBD's port 1234.
	vm_load_kernel_rtrs rtrs-core rtrs-client rnbd-client
	local m
	for m in mbcache jbd2 crc16 crc32c_generic ext4; do
		vm_insmod "$RTRS_VM_WORK/kmod/$m.ko"
	done
	kernel_client_our_server true faults
	kernel_client_our_server false
	# Now the kernel's server takes port 1234.
	our_client_kernel_server Y faults
	our_client_kernel_server N
	compare_trees
	figures | tee "$R"/interop-figures.md
}

# ---------------------------------------------------------------------------------------------
# fio

# fio_run NAME FILE ARGS...: one fio job on FILE (libaio, direct IO unless ARGS say otherwise),
# verifying with crc32c when ARGS ask for it; prints one line from fio's terse output and fails
# if fio does (any IO error or verify mismatch).
fio_run() {
	local n=$1 f=$2
	shift 2
	local file=()
	[ -n "$f" ] && file=(--filename="$f") # (fio's nbd engine takes a URI instead)
	if ! fio --name="$n" "${file[@]}" --ioengine=libaio --direct=1 --verify_fatal=1 \
		--verify_state_save=0 --group_reporting --output-format=terse --terse-version=3 \
		"$@" >/tmp/fio-"$n".out 2>&1; then
		echo "fio $n failed:"
		grep -v '^3;' /tmp/fio-"$n".out | tail -10
		fio_line "$n"
		# The daemons' side of the story.
		local l
		for l in ${DAEMON_LOGS:-}; do
			echo "--- $l"
			tail -30 "$l"
		done
		return 1
	fi
	fio_line "$n"
}

# fio_line NAME: "fio NAME: read N KiB N IOPS N KiB/s, write ..." from a terse v3 result.
fio_line() {
	# (A verify_backlog job's reads show a runtime of almost nothing, hence absurd rates: only
	# the amount read is printed for those.)
	grep '^3;' /tmp/fio-"$1".out | awk -F';' -v n="$1" '{
		r = sprintf("%d KiB", $6)
		if ($9 >= 1000) r = sprintf("%s %.0f IOPS %d KiB/s", r, $8, $7)
		printf "fio %s: error %s, read %s, write %d KiB %.0f IOPS %d KiB/s\n", n, $5, r, $47, $49, $48 }'
}

# fio_verify NAME FILE [ARGS...]: random 4 KiB writes at QD32, then sequential 1 MiB writes
# at QD8, each verified with crc32c after it is written.
fio_verify() {
	local n=$1 f=$2
	shift 2
	fio_run "$n-rand4k" "$f" --rw=randwrite --bs=4k --iodepth=32 --size=32m --verify=crc32c "$@"
	fio_run "$n-seq1m" "$f" --rw=write --bs=1m --iodepth=8 --size=64m --verify=crc32c "$@"
}

# fio_background NAME FILE SECONDS [ARGS...]: random 4 KiB writes at QD32 for SECONDS, each
# block verified soon after it is written (verify_backlog), in the background; sets FIO_PID.
fio_background() {
	local n=$1 f=$2 secs=$3
	shift 3
	fio_run "$n" "$f" --rw=randwrite --bs=4k --iodepth=32 --size=32m --time_based \
		--runtime="$secs" --verify=crc32c --verify_backlog=128 "$@" &
	FIO_PID=$!
}

# ---------------------------------------------------------------------------------------------
# Kernel client, our server

# kernel_client_our_server INV [faults]: the kernel's rnbd-client against rtrs-serverd
# -always-invalidate=INV.
kernel_client_our_server() {
	local inv=$1 faults=${2:-} A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 T=/tmp/kc-$1 s=kc-$1 f p
	echo "== kernel rnbd-client → rtrs-serverd -provider verbs -always-invalidate=$inv"
	mkdir -p "$T"/exports "$T"/srv "$T"/mnt
	truncate -s 256M "$T"/exports/disk
	start_our_server "$T" "$inv"
	echo "sessname=$s path=ip:$A1 path=ip:$A2@ip:$A1 device_path=disk" >/sys/class/rnbd-client/ctl/map_device
	vm_wait 10 test -b /dev/rnbd0
	local K=/sys/class/rtrs-client/$s
	paths_connected "$K"
	# Our tree names the kernel's session and paths as the kernel's own server tree would.
	for p in "ip:$A1@ip:$A1" "ip:$A2@ip:$A1"; do
		test -d "$T/srv/$s/paths/$p"
		echo "$p: hca_name $(cat "$T/srv/$s/paths/$p/hca_name") src_addr $(cat "$T/srv/$s/paths/$p/src_addr")"
	done
	# Random data, direct IO, in 1 MiB and 4 KiB blocks, compared with the export.
	head -c 16M /dev/urandom >"$T"/pat
	dd if="$T"/pat of=/dev/rnbd0 bs=1M oflag=direct status=none
	dd if="$T"/pat of=/dev/rnbd0 bs=4k seek=8192 count=1024 oflag=direct status=none
	dd if=/dev/rnbd0 of="$T"/back bs=1M count=16 iflag=direct status=none
	cmp "$T"/pat "$T"/back
	dd if=/dev/rnbd0 of="$T"/back4k bs=4k skip=8192 count=1024 iflag=direct status=none
	cmp_files "$T"/pat "$T"/back4k 4194304
	head -c 16M "$T"/exports/disk >"$T"/exp
	cmp "$T"/pat "$T"/exp
	fio_verify "kc-$inv" /dev/rnbd0
	if [ -n "$faults" ]; then
		kc_faults "$T" "$s" "$inv"
	fi
	# Counted from here on both sides (a reconnected path starts new counts on the server).
	reset_rdma "$K"
	reset_rdma "$T/srv/$s"
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
	same_io "$K" "$T/srv/$s"
	if [ -n "$faults" ]; then
		dump_tree "$K" "$R"/trees/kernel-client
		dump_tree "$T/srv/$s" "$R"/trees/our-server
	fi
	if [ -z "$faults" ]; then
		kc_force_close "$T" "$s"
	fi
	echo normal >/sys/block/rnbd0/rnbd/unmap_device
	vm_wait 10 test ! -e /dev/rnbd0
	kill "$SRV_PID"
	wait "$SRV_PID"
	# The guest's /tmp is memory, shared with the suites after this one.
	rm -rf "$T"
}

# kc_force_close T S: force_close in our rnbd-server tree ends the kernel client's use of the
# device: its IO fails (the server answers ENOTCONN, as the kernel's does), the tree entry
# goes, and the client's unmap afterwards goes through (its CLOSE answered 0).
kc_force_close() {
	local T=$1 s=$2 d
	echo "-- force_close in our rnbd-server tree, the kernel's client on it"
	d=$(ls "$T"/rnbd/ctl/devices)
	[ "$(cat "$T/rnbd/ctl/devices/$d/sessions/$s/access_mode")" = rw ]
	[ "$(cat "$T/rnbd/ctl/devices/$d/sessions/$s/mapping_path")" = disk ]
	echo 1 >"$T/rnbd/ctl/devices/$d/sessions/$s/force_close"
	test ! -e "$T/rnbd/ctl/devices/$d"
	if dd if="$T"/pat of=/dev/rnbd0 bs=4k count=1 oflag=direct status=none 2>"$T"/dd.err; then
		echo "the kernel client's write after force_close succeeded"
		return 1
	fi
	echo "kernel client after force_close: $(cat "$T"/dd.err)"
	grep "force_close: closed" "$T"/serverd.log
}

# start_our_server T INV: rtrs-serverd on port 1234 exporting T/exports, tree at T/srv; sets
# SRV_PID.
start_our_server() {
	rtrs-serverd -provider verbs -config /dev/null -listen "$RTRS_VM_ADDR1:1234" -always-invalidate="$2" \
		-dev-search-path "$1"/exports -mount "$1"/srv -rnbd-mount "$1"/rnbd -names-file "$1"/names.json >>"$1"/serverd.log 2>&1 &
	SRV_PID=$!
	DAEMON_LOGS="$1/serverd.log"
	vm_wait 30 mountpoint -q "$1"/srv || {
		cat "$1"/serverd.log
		return 1
	}
}

# kc_faults T S INV: faults under fio with the kernel client on our server, then our server
# killed and restarted.
kc_faults() {
	local T=$1 s=$2 inv=$3 K=/sys/class/rtrs-client/$2 pa pb
	pa=$(path_name "$K" 1) pb=$(path_name "$K" 2)
	echo "-- faults under fio: $pa disconnected in the kernel client's tree and reconnected there;"
	echo "   $pb disconnected in our server's tree (the kernel client reconnects it after its 30 s delay)"
	local r0
	r0=$(reconnects "$K")
	fio_background "kc-faults" /dev/rnbd0 20
	sleep 4
	echo 1 >"$K/paths/$pa/disconnect"
	vm_wait 10 state_is "$K/paths/$pa" disconnected
	echo 1 >"$K/paths/$pa/reconnect"
	vm_wait 30 state_is "$K/paths/$pa" connected
	echo 1 >"$T/srv/$s/paths/$pb/disconnect"
	vm_wait 10 state_is "$K/paths/$pb" disconnected
	wait "$FIO_PID"
	vm_wait 60 paths_connected "$K"
	echo "kernel client stats/reconnects: $(cat "$K"/paths/*/stats/reconnects | tr '\n' ' ')"
	[ "$(reconnects "$K")" -ge $((r0 + 2)) ]

	echo "-- our server killed (SIGKILL) and restarted: the kernel client reconnects and re-opens the device"
	head -c 8M /dev/urandom >"$T"/pat2
	dd if="$T"/pat2 of=/dev/rnbd0 bs=1M seek=100 oflag=direct status=none
	r0=$(reconnects "$K")
	kill -9 "$SRV_PID"
	wait "$SRV_PID" || true
	rtrs-serverd -cleanup -mount "$T"/srv -rnbd-mount "$T"/rnbd
	vm_wait 30 state_is "$K/paths/$pa" disconnected
	start_our_server "$T" "$inv"
	vm_wait 90 paths_connected "$K"
	# The device is opened again behind the reconnect: IO works once the server has it.
	vm_wait 30 dd if=/dev/rnbd0 of="$T"/back2 bs=1M skip=100 count=8 iflag=direct status=none
	cmp "$T"/pat2 "$T"/back2
	echo "kernel client stats/reconnects: $(cat "$K"/paths/*/stats/reconnects | tr '\n' ' ')"
	[ "$(reconnects "$K")" -ge $((r0 + 2)) ]
	fio_run "kc-after-restart" /dev/rnbd0 --rw=randrw --bs=4k --iodepth=32 --size=32m --verify=crc32c
}

# ---------------------------------------------------------------------------------------------
# Our client, kernel server

# our_client_kernel_server INV [faults]: rtrs-clientd against rnbd-server over rtrs-server
# loaded with always_invalidate=INV (a module parameter: read at load).
our_client_kernel_server() {
	local inv=$1 faults=${2:-} A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 T=/tmp/ks-$1 s=ks-$1 f
	echo "== rtrs-clientd -provider verbs → kernel rnbd-server, rtrs-server always_invalidate=$inv"
	vm_insmod "$RTRS_VM_WORK/kmod/rtrs-server.ko" always_invalidate="$inv"
	vm_insmod "$RTRS_VM_WORK/kmod/rnbd-server.ko"
	grep -q "$inv" /sys/module/rtrs_server/parameters/always_invalidate
	mkdir -p "$T"/cli "$T"/dev
	truncate -s 256M "$T"/disk
	local loop
	loop=$(losetup -f --show "$T"/disk)
	: >"$T"/clientd.conf
	# IO waits up to two minutes for a session that lost every path (the module reload).
	rtrs-clientd -provider verbs -config "$T"/clientd.conf -mount "$T"/cli -dev-mount "$T"/dev \
		-nbd-socket "$T"/nbd.sock -io-timeout 120s >"$T"/clientd.log 2>&1 &
	local cpid=$!
	DAEMON_LOGS="$T/clientd.log"
	vm_wait 30 mountpoint -q "$T"/dev || {
		cat "$T"/clientd.log
		return 1
	}
	echo "sessname=$s path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1" >"$T"/cli/ctl/open_session
	paths_connected "$T/cli/$s"
	echo "sessname=$s device_path=$loop access_mode=rw" >"$T"/dev/ctl/map_device
	# The device file is named by device_path without leading '/', each '/' shown as '!'.
	local name dev
	name=$(printf '%s' "${loop#/}" | tr / '!')
	dev="$T/dev/$s/$name"
	head -c 16M /dev/urandom >"$T"/pat
	dd if="$T"/pat of="$dev" bs=1M conv=fsync status=none
	dd if="$dev" of="$T"/back bs=1M count=16 status=none
	cmp "$T"/pat "$T"/back
	dd if="$loop" of="$T"/onloop bs=1M count=16 iflag=direct status=none
	cmp "$T"/pat "$T"/onloop
	fio_verify "ks-$inv-file" "$dev"
	# Through our NBD export (fio's libnbd engine).
	fio_verify "ks-$inv-nbd" "" --ioengine=nbd --uri="nbd+unix:///$s/$name?socket=$T/nbd.sock" --direct=0
	if [ -n "$faults" ]; then
		ks_faults "$T" "$s" "$inv" "$dev"
		policies "$T" "$loop"
	fi
	# The kernel's rtrs-server on rxe sometimes closes a path on its own ("REG MR failed: local
	# QP operation error", always_invalidate=Y); our client reconnects it after its delay. The
	# counts are compared once both sides hold both paths again.
	vm_wait 90 both_sides_connected "$T/cli/$s" "/sys/class/rtrs-server/$s"
	reset_rdma "$T/cli/$s"
	reset_rdma "/sys/class/rtrs-server/$s"
	dd if="$T"/pat of="$dev" bs=1M seek=32 conv=fsync status=none
	dd if="$dev" of="$T"/back bs=1M skip=32 count=16 status=none
	cmp "$T"/pat "$T"/back
	same_io "$T/cli/$s" "/sys/class/rtrs-server/$s"
	if [ -n "$faults" ]; then
		dump_tree "/sys/class/rtrs-server/$s" "$R"/trees/kernel-server
		dump_tree "$T/cli/$s" "$R"/trees/our-client
	fi
	if [ -z "$faults" ]; then
		ks_force_close "$T" "$s" "$loop" "$dev"
	fi
	echo "sessname=$s device_path=$loop" >"$T"/dev/ctl/unmap_device
	echo "$s" >"$T"/cli/ctl/close_session
	kill $cpid
	wait $cpid
	busybox rmmod rnbd_server rtrs_server
	losetup -d "$loop"
	rm -rf "$T"
}

# ks_force_close T S LOOP DEV: force_close in the kernel's rnbd-server tree ends our client's
# use of the device: its IO fails with EIO at once, the device shows closed-by-server and the
# log says why; the unmap afterwards goes through.
ks_force_close() {
	local T=$1 s=$2 loop=$3 dev=$4 K
	echo "-- force_close in the kernel's rnbd-server tree, our client on it"
	K=/sys/class/rnbd-server/ctl/devices/$(basename "$loop")/sessions/$s
	[ "$(cat "$K"/access_mode)" = rw ]
	[ "$(cat "$K"/mapping_path)" = "$loop" ]
	echo 1 >"$K"/force_close
	if timeout 30 dd if="$dev" of=/dev/null bs=64k count=1 iflag=direct status=none 2>"$T"/dd.err; then
		echo "our client's read after the kernel's force_close succeeded"
		return 1
	fi
	echo "our client after force_close: $(cat "$T"/dd.err)"
	grep -q "Input/output error" "$T"/dd.err
	grep "$s/$(printf '%s' "${loop#/}" | tr / '!') closed-by-server" "$T"/dev/ctl/devices
	grep "the server closed the device" "$T"/clientd.log
}

# ks_faults T S INV DEV: faults under fio with our client on the kernel's server.
ks_faults() {
	local T=$1 s=$2 inv=$3 dev=$4 C=$1/cli/$2 K=/sys/class/rtrs-server/$2 pa pb r0
	pa=$(path_name "$C" 1) pb=$(path_name "$C" 2)
	echo "-- faults under fio: $pb disconnected in our client's tree and reconnected there;"
	echo "   $pa disconnected in the kernel server's tree (our client reconnects it after its 30 s delay)"
	r0=$(reconnects "$C")
	fio_background "ks-faults" "$dev" 20
	sleep 4
	echo 1 >"$C/paths/$pb/disconnect"
	vm_wait 10 state_is "$C/paths/$pb" disconnected
	echo 1 >"$C/paths/$pb/reconnect"
	vm_wait 30 state_is "$C/paths/$pb" connected
	echo 1 >"$K/paths/$pa/disconnect"
	vm_wait 10 state_is "$C/paths/$pa" disconnected
	wait "$FIO_PID"
	vm_wait 60 paths_connected "$C"
	echo "our client stats/reconnects: $(cat "$C"/paths/*/stats/reconnects | tr '\n' ' ')"
	[ "$(reconnects "$C")" -ge $((r0 + 2)) ]

	echo "-- the kernel's rnbd-server and rtrs-server removed and loaded again under fio: IO waits, our client reconnects and re-opens the device"
	r0=$(reconnects "$C")
	fio_background "ks-reload" "$dev" 20
	sleep 4
	busybox rmmod rnbd_server rtrs_server
	vm_wait 10 state_is "$C/paths/$pa" disconnected
	vm_insmod "$RTRS_VM_WORK/kmod/rtrs-server.ko" always_invalidate="$inv"
	vm_insmod "$RTRS_VM_WORK/kmod/rnbd-server.ko"
	wait "$FIO_PID"
	vm_wait 60 paths_connected "$C"
	echo "our client stats/reconnects: $(cat "$C"/paths/*/stats/reconnects | tr '\n' ' ')"
	[ "$(reconnects "$C")" -ge $((r0 + 2)) ]
}

# policies T LOOP: each multipath policy under a random-read load, judged by how the reads split
# between two paths, from our stats/rdma, and mpath_policy reading back what was written. Both
# of the session's usual paths stay inside rxe0 (a packet to an address of the device's own
# netdev never leaves rxe: checked with ip -s link and tc -s, nothing moved on lo, va or vb), so
# nothing on the network can slow one of them. A session of its own (pol, LOOP mapped read-only)
# takes the first address to itself as its fast path and, as its slow path, the second address
# to POL_ADDR on a second rxe device on vb (rail_up): that path's packets cross the veth, where
# a netem qdisc on va and vb delays them by RAIL_DELAY_MS each way. 4 KiB random reads, four
# fio jobs at QD16 each through the device file, for 5 s:
# - round-robin on equal paths: each takes close to half; with the slow path slowed, still close
#   to half (turns do not look at the paths);
# - min-inflight on equal paths: with reads in flight on both, the second path takes at least
#   MI_EQ_MIN (a policy that always picked the first path would give it none);
# - min-inflight, slow path slowed: each read goes to the path with fewer in flight, and the
#   slow path's pile up: its share must be at most MI_SLOW_MAX and below half of round-robin's
#   share in the same conditions;
# - min-latency, slow path slowed: each read goes to the path with the shorter heartbeat round
#   trip (cur_latency, once the slow path's shows the delay): the fast path must take at least
#   ML_FAST_MIN.
POL_ADDR=10.99.1.3
RAIL_DELAY_MS=50
MI_EQ_MIN=0.15
MI_SLOW_MAX=0.25
ML_FAST_MIN=0.90
policies() {
	local T=$1 loop=$2 A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 C=$1/cli/pol fast slow rr_slow name
	echo "-- mpath_policy by behaviour: session pol, $A1→$A1 inside rxe0 and $A2→$POL_ADDR over the veth to rxe1"
	rail_up "$A2"
	echo "sessname=pol path=ip:$A1@ip:$A1 path=ip:$A2@ip:$POL_ADDR" >"$T"/cli/ctl/open_session
	fast="$C/paths/ip:$A1@ip:$A1" slow="$C/paths/ip:$A2@ip:$POL_ADDR"
	vm_wait 30 paths_connected "$C"
	rdma res show cm_id | grep -E "rxe1.*$POL_ADDR" >/dev/null || {
		rdma res show cm_id
		return 1
	}
	echo "sessname=pol device_path=$loop access_mode=ro" >"$T"/dev/ctl/map_device
	name=$(printf '%s' "${loop#/}" | tr / '!')
	local dev=(--filename="$T/dev/pol/$name" --numjobs=4)
	echo "reads per path: 4 KiB random reads, 4 jobs at QD16, for 5 s each, through the device file"
	policy_run "$C" round-robin "$fast" "$slow" "${dev[@]}"
	share_in "$POLICY_SHARE" 0.35 0.65
	policy_run "$C" min-inflight "$fast" "$slow" "${dev[@]}"
	share_in "$POLICY_SHARE" "$MI_EQ_MIN" 1
	echo "-- $(basename "$slow") slowed: netem delay ${RAIL_DELAY_MS} ms on va and vb"
	tc qdisc add dev va root netem delay "${RAIL_DELAY_MS}ms" limit 100000
	tc qdisc add dev vb root netem delay "${RAIL_DELAY_MS}ms" limit 100000
	local tx0
	tx0=$(cat /sys/class/net/va/statistics/tx_packets)
	policy_run "$C" round-robin "$fast" "$slow" "${dev[@]}"
	share_in "$POLICY_SHARE" 0.35 0.65
	rr_slow=$POLICY_SHARE
	# The slow path's traffic is what crossed the veth: at least a packet per read.
	echo "va sent $(($(cat /sys/class/net/va/statistics/tx_packets) - tx0)) packets for the slow path's $POLICY_SLOW reads"
	[ $(($(cat /sys/class/net/va/statistics/tx_packets) - tx0)) -ge "$POLICY_SLOW" ]
	policy_run "$C" min-inflight "$fast" "$slow" "${dev[@]}"
	share_in "$POLICY_SHARE" 0 "$MI_SLOW_MAX"
	share_in "$POLICY_SHARE" 0 "$(awk -v r="$rr_slow" 'BEGIN { print r / 2 }')"
	# The heartbeat (every 5 s) measures the slow path's round trip with the delay in it.
	vm_wait 30 latency_above "$slow" $((RAIL_DELAY_MS * 1000000))
	policy_run "$C" min-latency "$fast" "$slow" "${dev[@]}"
	share_in "$POLICY_SHARE" 0 "$(awk -v m="$ML_FAST_MIN" 'BEGIN { print 1 - m }')"
	tc -s qdisc show dev va
	tc -s qdisc show dev vb
	tc qdisc del dev va root
	tc qdisc del dev vb root
	echo "sessname=pol device_path=$loop" >"$T"/dev/ctl/unmap_device
	echo pol >"$T"/cli/ctl/close_session
	rail_down
}

# policy_run C POLICY FAST SLOW FIO-ARGS...: sets POLICY, checks mpath_policy reads it back, zeroes the
# paths' counters, runs the reads and prints the split; POLICY_SHARE is SLOW's share of them,
# POLICY_SLOW its count.
policy_run() {
	local C=$1 pol=$2 fast=$3 slow=$4 f want nf ns
	shift 4
	echo "$pol" >"$C"/mpath_policy
	case $pol in
	round-robin) want="round-robin (RR: 0)" ;;
	min-inflight) want="min-inflight (MI: 1)" ;;
	min-latency) want="min-latency (ML: 2)" ;;
	esac
	if [ "$(cat "$C"/mpath_policy)" != "$want" ]; then
		echo "mpath_policy reads back [$(cat "$C"/mpath_policy)] after $pol, want [$want]"
		return 1
	fi
	for f in "$C"/paths/*/stats/reset_all; do echo 1 >"$f"; done
	fio_run "policy-$pol" "" --rw=randread --bs=4k --iodepth=16 --size=32m --time_based \
		--runtime=5 "$@" >/dev/null
	nf=$(cut -d' ' -f1 "$fast"/stats/rdma) ns=$(cut -d' ' -f1 "$slow"/stats/rdma)
	POLICY_SLOW=$ns
	POLICY_SHARE=$(awk -v a="$nf" -v b="$ns" 'BEGIN { if (a + b > 0) printf "%.3f", b / (a + b); else print -1 }')
	echo "$pol: fast $nf reads (cur_latency $(cat "$fast"/cur_latency)), slow $ns reads (cur_latency $(cat "$slow"/cur_latency)): slow path's share $POLICY_SHARE"
}

# share_in SHARE LO HI: LO <= SHARE <= HI (and some reads counted at all).
share_in() {
	awk -v s="$1" -v lo="$2" -v hi="$3" 'BEGIN { exit !(s >= 0 && s >= lo && s <= hi) }' || {
		echo "slow path's share $1 not in [$2, $3]"
		return 1
	}
}

# latency_above PATHDIR NS: the path's cur_latency is above NS nanoseconds.
latency_above() { [ "$(cut -d' ' -f1 "$1"/cur_latency)" -gt "$2" ]; }

# rail_up PEER: POL_ADDR on vb with a second rxe device (rxe1) there, and PEER (an address on
# va) ⇄ POL_ADDR routed over the veth instead of through lo: rules ahead of the local table
# (which moves behind them) for packets between the two sent through va or vb, static neighbours, and
# both ends accepting a source address that is local. rxe sends a packet whose destination MAC
# is not its netdev's own through the IP stack, so that path's packets leave va (or vb) and
# arrive on the other.
rail_up() {
	local peer=$1 d
	vm_insmod "$RTRS_VM_WORK/kmod/sch_netem.ko"
	ip addr add "$POL_ADDR/32" dev vb
	rdma link add rxe1 type rxe netdev vb
	vm_wait 30 vm_port_active rxe1
	ip rule add pref 100 lookup local
	ip rule del pref 0
	ip route add "$POL_ADDR/32" dev va src "$peer" table 100
	ip route add "$peer/32" dev vb src "$POL_ADDR" table 101
	# Keyed on the outgoing device, which rxe's and rdma_cm's route lookups name (and rdma_cm's
	# check of an incoming request's device, which a rule on iif lo would miss); a packet
	# arriving on the veth is looked up without one and delivered locally.
	ip rule add pref 10 from "$peer" to "$POL_ADDR" oif va lookup 100
	ip rule add pref 11 from "$POL_ADDR" to "$peer" oif vb lookup 101
	ip neigh replace "$POL_ADDR" lladdr "$(cat /sys/class/net/vb/address)" dev va nud permanent
	ip neigh replace "$peer" lladdr "$(cat /sys/class/net/va/address)" dev vb nud permanent
	for d in all va vb; do
		sysctl -qw "net.ipv4.conf.$d.rp_filter=0" "net.ipv4.conf.$d.accept_local=1"
	done
	# In order, as a NIC delivers a flow. A veth queues each packet on the backlog of the CPU
	# that sent it, and 6.1's rxe sends a QP's packets from whichever CPU posted, so two posts
	# on two CPUs can arrive swapped. 6.1's rxe then leaves requests unanswered (the kernel's own
	# client to its own server over this veth hung the same way: docs/interop.md); receive
	# packet steering to one CPU keeps each veth's packets in one queue.
	rps_cpus 1
	RAIL_PEER=$peer
}

# rps_cpus MASK: receive packet steering of va and vb to the CPUs of MASK (0: off).
rps_cpus() {
	local q
	for q in /sys/class/net/va/queues/rx-*/rps_cpus /sys/class/net/vb/queues/rx-*/rps_cpus; do
		echo "$1" >"$q"
	done
}

# rail_down: rail_up undone.
rail_down() {
	rps_cpus 0
	ip rule del pref 10
	ip rule del pref 11
	ip rule add pref 0 lookup local
	ip rule del pref 100
	ip route flush table 100
	ip route flush table 101
	ip neigh del "$POL_ADDR" dev va
	ip neigh del "$RAIL_PEER" dev vb
	rdma link del rxe1
	ip addr del "$POL_ADDR/32" dev vb
}

# ---------------------------------------------------------------------------------------------
# Trees

# dump_tree DIR OUT: every file below DIR with its mode and what cat prints: OUT.raw with the
# values, OUT.fmt with path directories named P and digits as N (the shape, for comparison).
# sysfs's own entries (uevent, power/, subsystem, device) are left out.
dump_tree() {
	local d=$1 out=$2 f
	(cd "$d" && find . \( -name power -o -name subsystem -o -name device -o -name uevent \) -prune -o \
		-type f -print | sort) >"$out.files"
	: >"$out.raw"
	while read -r f; do
		local v
		# shellcheck disable=SC2002 # what cat prints is the point
		v=$(cat "$d/$f" 2>&1 | tr '\n' '|') || v="(cat fails)"
		printf '%s\t%s\t%s\n' "${f#./}" "$(stat -c %a "$d/$f")" "$v" >>"$out.raw"
	done <"$out.files"
	tree_shape "$out"
}

# tree_shape OUT: OUT.fmt from OUT.raw: path directories named P, digits in the content as N
# (the mode is compared as it is).
tree_shape() {
	awk -F'\t' -v OFS='\t' '{ sub(/paths\/[^\/]*/, "paths/P", $1); gsub(/[0-9]+/, "N", $3); print }' \
		"$1.raw" | sort -u >"$1.fmt"
}

# compare_trees: the kernel's client and server trees beside ours, file by file; every file of
# the kernel's must be in ours with the same mode and the same shape of content, except the
# differences known and written in docs/interop.md (KNOWN below).
compare_trees() {
	local t=$R/trees kind rc=0
	echo "== the kernel's trees beside ours"
	for kind in client server; do
		local k=$t/kernel-$kind o=$t/our-$kind
		cut -f1 "$k.fmt" | sort -u >"$k.names"
		cut -f1 "$o.fmt" | sort -u >"$o.names"
		echo "-- rtrs-$kind: $(wc -l <"$k.names") files in the kernel's session directory, $(wc -l <"$o.names") in ours"
		echo "only in ours: $(comm -13 "$k.names" "$o.names" | tr '\n' ' ')"
		local missing
		missing=$(comm -23 "$k.names" "$o.names" | tr '\n' ' ')
		if [ -n "$missing" ]; then
			echo "MISSING in ours: $missing"
			rc=1
		fi
		local n
		comm -12 "$k.names" "$o.names" >"$t/both-$kind"
		while read -r n; do
			local kl ol
			kl=$(awk -F'\t' -v n="$n" '$1 == n' "$k.fmt" | cut -f2-)
			ol=$(awk -F'\t' -v n="$n" '$1 == n' "$o.fmt" | cut -f2-)
			[ "$kl" = "$ol" ] && continue
			if known_difference "$kind" "$n"; then
				echo "known difference: $n: kernel [$kl] ours [$ol]"
			else
				echo "DIFFERS: $n: kernel [$kl] ours [$ol]"
				rc=1
			fi
		done <"$t/both-$kind"
	done
	return $rc
}

# known_difference KIND FILE: differences in shape that are ours on purpose or the kernel's
# own (docs/interop.md says why for each).
known_difference() {
	case "$1:$2" in
	*) return 1 ;;
	esac
}

# ---------------------------------------------------------------------------------------------
# Figures

# figures: fio 4 KiB QD32 and 1 MiB QD8 (reads and writes, 5 s each after 1 s of ramp) on one
# loop device over tmpfs, through kernel client → kernel server, kernel client → our server
# and our client → kernel server (our client through its NBD export with fio's libnbd engine).
figures() {
	local A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 T=/tmp/fig loop
	mkdir -p "$T"/cli "$T"/dev "$T"/srv
	truncate -s 512M "$T"/disk
	loop=$(losetup -f --show "$T"/disk)
	dd if=/dev/urandom of="$loop" bs=1M count=512 oflag=direct status=none
	echo "| path | 4 KiB randread QD32 (IOPS) | 4 KiB randwrite QD32 (IOPS) | 1 MiB read QD8 (MiB/s) | 1 MiB write QD8 (MiB/s) |"
	echo "|---|---|---|---|---|"
	# Kernel → kernel.
	vm_insmod "$RTRS_VM_WORK/kmod/rtrs-server.ko"
	vm_insmod "$RTRS_VM_WORK/kmod/rnbd-server.ko"
	echo "sessname=fig-kk path=ip:$A1 path=ip:$A2@ip:$A1 device_path=$loop" >/sys/class/rnbd-client/ctl/map_device
	vm_wait 10 test -b /dev/rnbd0
	fig_row "kernel client → kernel server" /dev/rnbd0
	echo normal >/sys/block/rnbd0/rnbd/unmap_device
	vm_wait 10 test ! -e /dev/rnbd0
	# Our client → kernel server.
	: >"$T"/clientd.conf
	rtrs-clientd -provider verbs -config "$T"/clientd.conf -mount "$T"/cli -dev-mount "$T"/dev \
		-nbd-socket "$T"/nbd.sock >"$T"/clientd.log 2>&1 &
	local cpid=$!
	vm_wait 30 mountpoint -q "$T"/dev
	echo "sessname=fig-ok path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1" >"$T"/cli/ctl/open_session
	echo "sessname=fig-ok device_path=$loop access_mode=rw" >"$T"/dev/ctl/map_device
	local name
	name=$(printf '%s' "${loop#/}" | tr / '!')
	fig_row "our client (NBD export, fio's nbd engine) → kernel server" "" --ioengine=nbd \
		--uri="nbd+unix:///fig-ok/$name?socket=$T/nbd.sock" --direct=0
	echo "sessname=fig-ok device_path=$loop" >"$T"/dev/ctl/unmap_device
	echo fig-ok >"$T"/cli/ctl/close_session
	kill $cpid
	wait $cpid
	busybox rmmod rnbd_server rtrs_server
	# Kernel → our server (the loop device exported from /dev).
	rtrs-serverd -provider verbs -config /dev/null -listen "$A1:1234" -dev-search-path /dev \
		-mount "$T"/srv -rnbd-mount "$T"/rnbd -names-file "$T"/names.json >"$T"/serverd.log 2>&1 &
	local spid=$!
	vm_wait 30 mountpoint -q "$T"/srv
	echo "sessname=fig-ko path=ip:$A1 path=ip:$A2@ip:$A1 device_path=${loop#/dev/}" >/sys/class/rnbd-client/ctl/map_device
	vm_wait 10 test -b /dev/rnbd0
	fig_row "kernel client → our server" /dev/rnbd0
	echo normal >/sys/block/rnbd0/rnbd/unmap_device
	vm_wait 10 test ! -e /dev/rnbd0
	kill $spid
	wait $spid
	losetup -d "$loop"
	rm -rf "$T"
}

# fig_row LABEL FILE [ARGS...]: one table row.
fig_row() {
	local label=$1 f=$2 rr rw sr sw
	shift 2
	local common=(--time_based --runtime=5 --ramp_time=1 --size=512m)
	fio_run fig-rr "$f" --rw=randread --bs=4k --iodepth=32 "${common[@]}" "$@" >/dev/null
	rr=$(grep '^3;' /tmp/fio-fig-rr.out | cut -d';' -f8)
	fio_run fig-rw "$f" --rw=randwrite --bs=4k --iodepth=32 "${common[@]}" "$@" >/dev/null
	rw=$(grep '^3;' /tmp/fio-fig-rw.out | cut -d';' -f49)
	fio_run fig-sr "$f" --rw=read --bs=1m --iodepth=8 "${common[@]}" "$@" >/dev/null
	sr=$(grep '^3;' /tmp/fio-fig-sr.out | cut -d';' -f7)
	fio_run fig-sw "$f" --rw=write --bs=1m --iodepth=8 "${common[@]}" "$@" >/dev/null
	sw=$(grep '^3;' /tmp/fio-fig-sw.out | cut -d';' -f48)
	awk -v l="$label" -v rr="$rr" -v rw="$rw" -v sr="$sr" -v sw="$sw" \
		'BEGIN { printf "| %s | %.0f | %.0f | %.1f | %.1f |\n", l, rr, rw, sr / 1024, sw / 1024 }'
}

# ---------------------------------------------------------------------------------------------
# Small helpers

# path_name DIR N: the Nth path directory's name under DIR/paths.
path_name() {
	local p=("$1"/paths/*)
	basename "${p[$2 - 1]}"
}

# state_is PATHDIR STATE
state_is() { [ "$(cat "$1"/state)" = "$2" ]; }

# paths_connected SESSDIR: every path of the session is connected.
paths_connected() {
	local f
	for f in "$1"/paths/*/state; do
		[ "$(cat "$f")" = connected ] || return 1
	done
}

# both_sides_connected CLIENT SERVER: the client's paths are all connected and the server
# lists the same paths.
both_sides_connected() {
	paths_connected "$1" && [ "$(ls "$1"/paths)" = "$(ls "$2"/paths)" ]
}

# reconnects SESSDIR: successful reconnects summed over the session's paths.
reconnects() { cat "$1"/paths/*/stats/reconnects | awk '{ n += $1 } END { print n + 0 }'; }

# reset_rdma SESSDIR: zero every path's stats/rdma (writing 1, as both kernels' trees take).
reset_rdma() {
	local f
	for f in "$1"/paths/*/stats/rdma; do echo 1 >"$f"; done
}

# same_io CLIENT SERVER: the client's and the server's stats/rdma count the same reads, read
# bytes, writes and written bytes per path.
same_io() {
	local p c s
	for p in "$1"/paths/*; do
		c=$(cut -d' ' -f1-4 "$p"/stats/rdma)
		s=$(cut -d' ' -f1-4 "$2/paths/$(basename "$p")"/stats/rdma)
		echo "$(basename "$p") stats/rdma: client $c, server $s"
		[ "$c" = "$s" ]
	done
}

# cmp_files A B N: the first N bytes of A against all of B (the guest has no /dev/fd for
# process substitution).
cmp_files() {
	head -c "$3" "$1" >"$2.want"
	cmp "$2.want" "$2"
}
