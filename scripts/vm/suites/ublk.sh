# shellcheck shell=bash
# rtrs-clientd's ublk front end (map_device … ublk=), on kernels that have ublk_drv (6.12,
# 7.2); on 6.1, which has none, that ublk= is refused with a clear error and nothing left.
# - pkg/ublk's own tests against the driver (device IO and limits, recovery, errors, a control
#   command that times out, commands of two devices at once, a refused fetch), and
#   rtrs-clientd's attacher with an unmap begun in the middle of its attach (a test hook);
# - over rxe, rtrs-clientd → rtrs-serverd and rtrs-clientd → the kernel's rnbd-server:
#   ext4 over /dev/ublkbN, fsck clean, files read back;
# - blkdiscard and blkdiscard -z;
# - fio verify while a path is disconnected and reconnected mid-IO;
# - unmap_device while fio has the device open: EBUSY at once, fio unharmed;
# - unmap_device while map_device is attaching the device: no ublk device left behind;
# - a force unmap under fio with the server killed: done at once, fio fails, nothing left;
# - rtrs-clientd killed with SIGKILL under fio verify and started again: it takes its
#   /dev/ublkbN back (user recovery), the IO that waited resumes, fio finds no error;
# - SIGTERM with ext4 mounted on the device: what the file system held dirty is written back
#   first (a file copied in and never synced reads back after a restart; fsck clean), then
#   the daemon stops and deletes the device all the same;
# - the export grown on the server (our file, the kernel's loop device), then the device's
#   resize: on 7.2 /dev/ublkbN takes the new size (UPDATE_SIZE) and IO past the old end reads
#   back; on 6.12, whose driver cannot resize, it is EOPNOTSUPP and the size stays; an export
#   grown while the daemon was dead: the restarted daemon takes the device back and resizes
#   it (7.2) or keeps its size (6.12).

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev e2fsprogs fio util-linux curl"

host() {
	vm_build_kernel_rtrs
	vm_kernel_module fs/mbcache fs/jbd2/jbd2 lib/crc16 crypto/crc32c_generic fs/ext4/ext4
	mkdir -p "$RTRS_VM_WORK/bin"
	(
		cd "$RTRS_VM_REPO" || exit
		go test -c -o "$RTRS_VM_WORK/bin/ublk.test" ./pkg/ublk
		go test -c -o "$RTRS_VM_WORK/bin/clientd.test" ./cmd/rtrs-clientd
		go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-serverd ./cmd/rtrs-clientd
	)
}

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local failed=() m
	for m in mbcache jbd2 crc16 crc32c_generic ext4; do
		vm_insmod "$RTRS_VM_WORK/kmod/$m.ko"
	done
	if [ ! -e /dev/ublk-control ]; then
		vm_part "no ublk driver on $(uname -r): ublk= refused" no_driver
	else
		vm_part "pkg/ublk against ublk_drv" unit
		vm_part "rtrs-clientd ublk → rtrs-serverd" ours
		vm_part "rtrs-clientd ublk → the kernel's rnbd-server" kernel_server
	fi
	if [ ${#failed[@]} -gt 0 ]; then
		for m in "$RTRS_VM_WORK"/results/ublk-*.log; do
			[ -f "$m" ] || continue
			echo "--- $m"
			tail -40 "$m"
		done
		echo "failed: ${failed[*]}"
		return 1
	fi
}

unit() {
	local tests=(TestDeviceIO TestRecover TestCreateErrors TestCtrlCommandTimeout TestCtrlConcurrentCommands
		TestRefusedFetch TestIdleBuffersGiveBack TestStopOpenWithDelDevOnly
		TestStopIfUnused TestStopAfterQueueFailed TestRecoverAfterFailedSetup TestProvidedBuffers)
	ublk.test -test.v -test.count 1 -test.timeout 600s 2>&1 | tee /tmp/ublk-unit.out
	vm_require_tests /tmp/ublk-unit.out "${tests[@]}" || return
	# The attacher's unmap-during-attach window, held open by a test hook.
	clientd.test -test.v -test.count 1 -test.timeout 300s -test.run '^TestUblk' 2>&1 | tee /tmp/clientd-unit.out
	vm_require_tests /tmp/clientd-unit.out TestUblkUnmapDuringAttach
}

# Our server's port: the kernel's rtrs-server, loaded by other suites, holds 1234.
PORT=1235
# Our server's metrics: the RNBD requests by operation and flag that reached it.
METRICS_ADDR=127.0.0.1:9861
# Our client's: requests staged.
CLIENT_METRICS_ADDR=127.0.0.1:9862

# The daemons' logs go to the results (kept on the host): T's last part names them.
logs() { echo "$RTRS_VM_WORK/results/ublk-${1##*/}"; }

# start_server T: rtrs-serverd over verbs exporting T/exports.
start_server() {
	rtrs-serverd -provider verbs -config /dev/null -listen "$RTRS_VM_ADDR1:$PORT" \
		-dev-search-path "$1"/exports -mount "$1"/srv -rnbd-mount "$1"/rnbd -names-file "$1"/names.json \
		-metrics "$METRICS_ADDR" >>"$(logs "$1")-serverd.log" 2>&1 &
	SRV_PID=$!
	vm_wait 30 mountpoint -q "$1"/srv || {
		cat "$(logs "$1")-serverd.log"
		return 1
	}
}

# start_client T: rtrs-clientd over verbs with T/clientd.conf (written back); sets CLI_PID.
start_client() {
	DAEMON_LOGS="$(logs "$1")-clientd.log"
	rtrs-clientd -provider verbs -config "$1"/clientd.conf -mount "$1"/cli -dev-mount "$1"/dev \
		-nbd-socket "" -io-timeout 120s -reconnect-delay 2s -metrics "$CLIENT_METRICS_ADDR" >>"$DAEMON_LOGS" 2>&1 &
	CLI_PID=$!
	vm_wait 30 mountpoint -q "$1"/dev || {
		cat "$DAEMON_LOGS"
		return 1
	}
}

# gone PID: the process has exited.
gone() { ! kill -0 "$1" 2>/dev/null; }

# holds_open DEV: some process has DEV open.
holds_open() { [ -n "$(find /proc/[0-9]*/fd -lname "$1" 2>/dev/null)" ]; }

# ublk_of T: the /dev/ublkbN of the one mapping in T's device view.
ublk_of() { awk 'NR == 1 { print $2 }' "$1"/dev/ctl/ublk_devices; }

no_driver() {
	local T=/tmp/ub-none err
	case $(uname -r) in 6.1.*) ;; *)
		echo "$(uname -r) should have ublk_drv and has no /dev/ublk-control"
		return 1
		;;
	esac
	mkdir -p "$T"/exports "$T"/srv "$T"/rnbd "$T"/cli "$T"/dev
	truncate -s 64M "$T"/exports/disk
	: >"$T"/clientd.conf
	start_server "$T"
	start_client "$T"
	if err=$({ echo "sessname=u device_path=disk dest_port=$PORT path=ip:$RTRS_VM_ADDR1@ip:$RTRS_VM_ADDR1 ublk=auto" >"$T"/dev/ctl/map_device; } 2>&1); then
		echo "map_device ublk=auto succeeded without a ublk driver"
		return 1
	fi
	echo "map_device ublk=auto: $err"
	grep 'no ublk driver' "$DAEMON_LOGS"
	case $err in *"No such device"*) ;; *) return 1 ;; esac
	# Nothing left: no device, no session, nothing written back.
	[ -z "$(cat "$T"/dev/ctl/devices)" ] && [ -z "$(find "$T"/cli -mindepth 1 -maxdepth 1 ! -name ctl)" ] &&
		! grep map_device "$T"/clientd.conf
	kill "$CLI_PID" "$SRV_PID"
	wait "$CLI_PID" "$SRV_PID"
}

# server_errors: the RNBD requests our server has failed so far.
server_errors() {
	curl -sf --max-time 10 "http://$METRICS_ADDR/metrics" | awk '/^rtrs_rnbd_server_errors_total / { print $NF }'
}

# ops_arrived [ERRORS]: what the block layer sent through /dev/ublkbN reached our server as RNBD asks:
# flushes (ext4's journal, blkdiscard's end), FUA writes (O_DSYNC on a device with a volatile
# cache and FUA), discards and write-zeroes, and no request failed.
# ERRORS (default 0) is the server's error count before the checked IO began.
ops_arrived() {
	curl -sf --max-time 10 "http://$METRICS_ADDR/metrics" | awk -v base="${1:-0}" '
		/^rtrs_rnbd_server_requests_total\{/ { match($0, /op="[^"]*"/); n[substr($0, RSTART + 4, RLENGTH - 5)] = $NF }
		/^rtrs_rnbd_server_fua_writes_total / { n["fua_writes"] = $NF }
		/^rtrs_rnbd_server_errors_total / { n["errors"] = $NF }
		END {
			printf "our server'"'"'s RNBD requests:"
			for (k in n) printf " %s=%d", k, n[k]
			print ""
			exit !(n["flush"] > 0 && n["discard"] > 0 && n["write_zeroes"] > 0 && n["fua_writes"] > 0 && ("errors" in n) && n["errors"] == base)
		}'
}

# fio_job NAME DEV ARGS...: fio with crc32c verify, direct libaio; fails on any error.
fio_job() {
	local n=$1 f=$2
	shift 2
	if ! fio --name="$n" --filename="$f" --ioengine=libaio --direct=1 --verify=crc32c --verify_fatal=1 \
		--verify_state_save=0 --output-format=terse --terse-version=3 "$@" >/tmp/fio-"$n".out 2>&1; then
		echo "fio $n failed:"
		tail -20 /tmp/fio-"$n".out
		tail -30 "$DAEMON_LOGS"
		return 1
	fi
	awk -F';' -v n="$n" '/^3;/ { printf "fio %s: error %s, read %d KiB, write %d KiB\n", n, $5, $6, $47 }' /tmp/fio-"$n".out
}

# ext4_on DEV: a file system made, written, checked clean and read back.
ext4_on() {
	local B=$1 mnt=/tmp/mnt
	mkdir -p "$mnt"
	head -c 8M /dev/urandom >/tmp/pat
	mkfs.ext4 -q -F "$B"
	mount "$B" "$mnt"
	cp /tmp/pat "$mnt"/pat
	mkdir "$mnt"/d && for i in $(seq 1 50); do echo "$i" >"$mnt/d/$i"; done
	umount "$mnt"
	fsck.ext4 -fn "$B"
	mount "$B" "$mnt"
	cmp /tmp/pat "$mnt"/pat
	[ "$(cat "$mnt"/d/50)" = 50 ]
	umount "$mnt"
	echo "ext4 on $B: made, fsck clean, read back"
}

# resize_check T NAME B GROW: the export grown (GROW, a command) and NAME's resize written
# to 512 MiB. A driver with UPDATE_SIZE (6.14 and later) gives B the new size and IO past the
# old end (256 or 384 MiB) reads back; 6.12's refuses it (EOPNOTSUPP) and B keeps its size.
resize_check() {
	local T=$1 name=$2 B=$3 grow=$4 sb=/sys/block/${3#/dev/} err before
	before=$(cat "$sb"/size)
	eval "$grow"
	if ! updates_size; then
		if err=$({ echo $((512 << 11)) >"$T/dev/ctl/mapped/$name/resize"; } 2>&1); then
			echo "resize of $B succeeded on $(uname -r), whose ublk has no UPDATE_SIZE"
			return 1
		fi
		echo "resize of $B on $(uname -r): $err"
		case $err in *"Operation not supported"*) ;; *) return 1 ;; esac
		[ "$(cat "$sb"/size)" = "$before" ]
	else
		echo $((512 << 11)) >"$T/dev/ctl/mapped/$name/resize"
		[ "$(cat "$sb"/size)" = $((512 << 11)) ]
		[ "$(blockdev --getsize64 "$B")" = $((512 << 20)) ]
		head -c 1M /dev/urandom >/tmp/mb
		dd if=/tmp/mb of="$B" bs=1M seek=400 oflag=direct status=none
		dd if="$B" of=/tmp/mb.back bs=1M skip=400 count=1 iflag=direct status=none
		cmp /tmp/mb /tmp/mb.back
		echo "$B: $(blockdev --getsize64 "$B") bytes after resize, 1 MiB at 400 MiB read back"
	fi
}

# updates_size: this kernel's ublk driver has UPDATE_SIZE (6.14 and later).
updates_size() {
	case $(uname -r) in 6.1[0-3].* | 6.[0-9].*) return 1 ;; esac
}

# ublk_count: how many ublk devices the driver has.
ublk_count() { find /dev -maxdepth 1 -name 'ublkc*' | wc -l; }

# unmap_while_attaching T: unmap_device written as soon as a map_device … ublk=auto has
# listed its device, while its /dev/ublkbN starts (ADD_DEV, the queues, START_DEV and the
# partition scan). Either the unmap comes first and the attach stops its own device
# (map_device fails, ENODEV), or the attach finished and the unmap detaches it; in both no
# ublk device is left behind, none listed. The loop polls with shell builtins only (no fork),
# so as to land inside the attach; at least one of ten tries must, or the race went untested.
unmap_while_attaching() {
	local T=$1 n0 i hit=0 mpid x
	truncate -s 64M "$T"/exports/race
	n0=$(ublk_count)
	for i in $(seq 10); do
		{ echo "sessname=r device_path=race dest_port=$PORT path=ip:$RTRS_VM_ADDR1@ip:$RTRS_VM_ADDR1 ublk=auto" >"$T"/dev/ctl/map_device; } 2>/tmp/race-map.err &
		mpid=$!
		x=
		until [[ $x == *race* ]] || gone "$mpid"; do
			IFS= read -r -d '' x <"$T"/dev/ctl/devices || true
		done
		until echo "sessname=r device_path=race" 2>/tmp/race-unmap.err >"$T"/dev/ctl/unmap_device; do
			gone "$mpid" && break
		done
		if wait "$mpid"; then
			echo "try $i: the attach finished first"
		else
			echo "try $i: map_device failed: $(cat /tmp/race-map.err)"
			grep -q "No such device" /tmp/race-map.err
			hit=$((hit + 1))
		fi
		vm_wait 30 test "$(ublk_count)" -eq "$n0" || {
			echo "try $i: $(ublk_count) ublk devices, $n0 before: one left behind"
			ls -l /dev/ublk*
			return 1
		}
		[ -z "$(cat "$T"/dev/ctl/ublk_devices)" ] && ! grep -q race "$T"/dev/ctl/devices
		[ "$hit" -eq 0 ] || break
	done
	[ "$hit" -gt 0 ] || { echo "the unmap never came during the attach in 10 tries"; return 1; }
}

# force_unmap_dead_server T: a force unmap of a device under fio whose server was killed
# (its IO waiting for the session, up to the IO timeout of 120 s) goes through at once: the
# waiting IO fails (fio sees errors), the device goes, nothing is left. The server is started
# again after.
force_unmap_dead_server() {
	local T=$1 n0 B fpid t0 err
	n0=$(ublk_count)
	echo "sessname=r device_path=race dest_port=$PORT path=ip:$RTRS_VM_ADDR1@ip:$RTRS_VM_ADDR1 ublk=auto" >"$T"/dev/ctl/map_device
	B=$(ublk_of "$T")
	[ -b "$B" ]
	fio --name=ub-dead --filename="$B" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k --iodepth=16 \
		--size=32m --time_based --runtime=60 --output=/tmp/ub-dead.fio >/dev/null 2>&1 &
	fpid=$!
	vm_wait 20 holds_open "$B"
	sleep 1
	kill -9 "$SRV_PID"
	wait "$SRV_PID" 2>/dev/null || true
	umount "$T"/srv "$T"/rnbd 2>/dev/null || rtrs-serverd -cleanup -mount "$T"/srv -rnbd-mount "$T"/rnbd
	vm_wait 30 bash -c "! grep -qx connected $T/cli/r/paths/*/state"
	t0=$(vm_now)
	if ! err=$({ timeout 25 bash -c "echo 'sessname=r device_path=race force' >$T/dev/ctl/unmap_device"; } 2>&1); then
		echo "force unmap with the server gone: $err ($(vm_since "$t0") s)"
		return 1
	fi
	echo "force unmap of $B with its server gone and fio on it: done in $(vm_since "$t0") s"
	if wait "$fpid"; then
		echo "fio had no error on a device unmapped under it"
		return 1
	fi
	grep -m1 -o "err=[^:]*: [^,]*" /tmp/ub-dead.fio || true
	vm_wait 30 test "$(ublk_count)" -eq "$n0"
	[ -z "$(cat "$T"/dev/ctl/ublk_devices)" ] && ! grep -q race "$T"/dev/ctl/devices
	start_server "$T"
}

ours() {
	local T=/tmp/ub A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 B C pb err t0 id
	mkdir -p "$T"/exports "$T"/srv "$T"/rnbd "$T"/cli "$T"/dev
	truncate -s 256M "$T"/exports/disk
	: >"$T"/clientd.conf
	start_server "$T"
	start_client "$T"
	unmap_while_attaching "$T"
	force_unmap_dead_server "$T"
	# The race's partition scan may have read a device its unmap had just closed.
	local e0
	e0=$(server_errors)
	echo "sessname=u device_path=disk dest_port=$PORT path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1 ublk=auto" >"$T"/dev/ctl/map_device
	cat "$T"/dev/ctl/ublk_devices
	B=$(ublk_of "$T")
	[ -b "$B" ]
	id=${B#/dev/ublkb}
	# The write-back records the device's number, so a restart recovers that one.
	grep "map_device .* ublk=$id\$" "$T"/clientd.conf
	local sb=/sys/block/${B#/dev/}
	echo "$B: $(cat "$sb"/size) sectors, $(find "$sb"/mq -mindepth 1 -maxdepth 1 | wc -l) queues, write cache $(cat "$sb"/queue/write_cache)"
	ext4_on "$B"

	echo "-- blkdiscard and blkdiscard -z"
	head -c 1M /dev/urandom >/tmp/mb
	dd if=/tmp/mb of="$B" bs=1M oflag=direct status=none
	blkdiscard -o 0 -l 1M "$B"
	dd if=/tmp/mb of="$B" bs=1M seek=1 oflag=direct status=none
	blkdiscard -z -o 1M -l 1M "$B"
	cmp -n 2097152 "$B" /dev/zero
	echo "discarded and zeroed ranges read back as zeros"
	dd if=/tmp/mb of="$B" bs=4k count=16 oflag=direct,dsync status=none
	ops_arrived "$e0"

	echo "-- fio verify while a path is disconnected and reconnected"
	C=$T/cli/u
	pb=$(basename "$(find "$C"/paths -mindepth 1 -maxdepth 1 | sort | tail -1)")
	fio_job ub-faults "$B" --rw=randwrite --bs=4k --iodepth=32 --size=32m --time_based --runtime=15 --verify_backlog=128 &
	local fpid=$!
	sleep 4
	echo 1 >"$C/paths/$pb/disconnect"
	vm_wait 10 grep -qx disconnected "$C/paths/$pb/state"
	sleep 2
	echo 1 >"$C/paths/$pb/reconnect"
	vm_wait 30 grep -qx connected "$C/paths/$pb/state"
	wait "$fpid"
	vm_no_leaks "$DAEMON_LOGS"

	echo "-- unmap_device while fio has $B open"
	fio_job ub-open "$B" --rw=randread --bs=4k --iodepth=8 --size=32m --time_based --runtime=10 --verify=0 &
	fpid=$!
	vm_wait 20 holds_open "$B"
	t0=$(vm_now)
	if err=$({ timeout 20 bash -c "echo 'sessname=u device_path=disk' >$T/dev/ctl/unmap_device"; } 2>&1); then
		echo "unmap_device succeeded while fio had $B open"
		return 1
	fi
	echo "unmap_device: $err ($(vm_since "$t0") s)"
	case $err in *"Device or resource busy"*) ;; *) return 1 ;; esac
	grep -q "$B" "$T"/dev/ctl/ublk_devices
	wait "$fpid"

	echo "-- rtrs-clientd killed with SIGKILL under fio verify, started again"
	fio_job ub-restart "$B" --rw=randwrite --bs=4k --iodepth=32 --size=32m --time_based --runtime=20 --verify_backlog=128 &
	fpid=$!
	sleep 4
	kill -9 "$CLI_PID"
	wait "$CLI_PID" 2>/dev/null || true
	umount "$T"/cli "$T"/dev 2>/dev/null || rtrs-clientd -cleanup -mount "$T"/cli -dev-mount "$T"/dev
	# The export grows while no daemon serves the device: the restarted one takes it back all
	# the same, and resizes it where the driver can.
	truncate -s 384M "$T"/exports/disk
	t0=$(vm_now)
	start_client "$T"
	vm_wait 60 grep -q "$B" "$T"/dev/ctl/ublk_devices
	grep "recovered $B" "$DAEMON_LOGS"
	echo "$B recovered $(vm_since "$t0") s after the restart"
	if updates_size; then
		grep "${B#/dev/} resized from $((256 << 11)) to $((384 << 11)) sectors" "$DAEMON_LOGS"
		[ "$(cat "$sb"/size)" = $((384 << 11)) ]
	else
		grep "${B#/dev/} keeps $((256 << 11)) sectors" "$DAEMON_LOGS"
		[ "$(cat "$sb"/size)" = $((256 << 11)) ]
	fi
	wait "$fpid"
	fio_job ub-after "$B" --rw=randwrite --bs=64k --iodepth=8 --size=32m

	echo "-- resize after the export grew on our server"
	resize_check "$T" disk@u "$B" "truncate -s 512M $T/exports/disk"

	echo "-- SIGTERM with ext4 mounted on $B: what it held dirty is written back, then the device stops"
	mkfs.ext4 -q -F "$B"
	mkdir -p /tmp/mnt
	mount "$B" /tmp/mnt
	# Written, never synced: only the page cache holds it when the signal comes.
	head -c 4M /dev/urandom >/tmp/dirty
	cp /tmp/dirty /tmp/mnt/dirty
	t0=$(vm_now)
	kill "$CLI_PID"
	vm_wait 60 gone "$CLI_PID"
	wait "$CLI_PID"
	echo "rtrs-clientd exited $(vm_since "$t0") s after SIGTERM"
	grep "stopping: written back" "$DAEMON_LOGS"
	[ ! -e "$B" ] && [ ! -e "/dev/ublkc$id" ]
	umount /tmp/mnt 2>/dev/null || umount -l /tmp/mnt
	echo "$B and /dev/ublkc$id gone after SIGTERM, the mount left behind unmounted"
	# Started again from its written-back declarations: the volume's file system is clean
	# and holds the file.
	start_client "$T"
	vm_wait 60 grep -q "$B" "$T"/dev/ctl/ublk_devices
	# The mount replays the journal the stop left (it was never unmounted cleanly).
	mount "$B" /tmp/mnt
	cmp /tmp/dirty /tmp/mnt/dirty
	umount /tmp/mnt
	fsck.ext4 -f -n "$B"
	echo "after the restart: the file written before SIGTERM read back from $B, fsck clean"
	kill "$CLI_PID"
	wait "$CLI_PID"
	kill "$SRV_PID"
	wait "$SRV_PID"
}

kernel_server() {
	local T=/tmp/ubk A1=$RTRS_VM_ADDR1 B loop
	vm_load_kernel_rtrs rtrs-core rtrs-server rnbd-server
	mkdir -p "$T"/cli "$T"/dev
	truncate -s 256M "$T"/disk
	loop=$(losetup -f --show "$T"/disk)
	: >"$T"/clientd.conf
	start_client "$T"
	echo "sessname=k device_path=$loop path=ip:$A1@ip:$A1 path=ip:$RTRS_VM_ADDR2@ip:$A1 ublk=auto" >"$T"/dev/ctl/map_device
	B=$(ublk_of "$T")
	[ -b "$B" ]
	ext4_on "$B"
	local st0
	st0=$(vm_staged "$CLIENT_METRICS_ADDR" k)
	fio_job ubk-verify "$B" --rw=randwrite --bs=4k --iodepth=32 --size=32m
	fio_job ubk-seq "$B" --rw=write --bs=1m --iodepth=8 --size=32m
	# The queues' buffers are registered: nothing is copied through the stage.
	vm_not_staged "fio on $B" "$CLIENT_METRICS_ADDR" k "$st0"
	echo "-- resize after the kernel's server's loop device grew"
	resize_check "$T" "${loop//\//!}@k" "$B" "truncate -s 512M $T/disk && losetup -c $loop"
	echo "sessname=k device_path=$loop" >"$T"/dev/ctl/unmap_device
	[ ! -e "$B" ]
	vm_no_leaks "$DAEMON_LOGS"
	kill "$CLI_PID"
	wait "$CLI_PID"
	losetup -d "$loop"
}
