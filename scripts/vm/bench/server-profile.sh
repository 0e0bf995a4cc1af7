# shellcheck shell=bash
# Server profile: a CPU profile of our RNBD server's data path (rtrs-bench blkserver, -provider
# verbs, -export-io direct) under the Linux kernel's own rnbd-client, over rxe on two paths, the
# server exporting one loop device over a 256M file in the guest's tmpfs (the first 200M random
# data), as scripts/vm/bench/server-figures.sh sets its ko target up. fio jobs, one at a time
# (libaio direct=1 size=200m time_based, PROF_SECS seconds each, on /dev/rnbdX), PROF_JOBS
# of: rr 4 KiB randread QD32, rw 4 KiB randwrite QD32, sr 1 MiB read QD8, sw 1 MiB write
# QD8 (default "rr rw"). fio's exec_prerun, right before the job's IO,
# snapshots the server's /proc/PID/stat and every thread's /proc/PID/task/*/status and the
# guest's /proc/stat and then sends SIGUSR1 (blkserver starts its CPU profile); its
# exec_postrun, right after the IO, snapshots the same again and then sends SIGUSR2 (the
# profile stops, blkserver.sched is written: goroutine wake-ups (estimated: 8 × the runtime's
# sampled scheduling latencies), GC cycles, calls into C). Per job in results/server-profile/:
# JOB.pprof and JOB.sched, JOB.fio (terse v3), JOB.{pre,post}.{srv,stat}; the table
# results/server-profile/summary.md (printed too): IOPS, the server's CPU (utime + stime) per
# IO, the whole guest's busy CPU (/proc/stat: all but idle and iowait) per IO, the server's
# context switches (voluntary and involuntary, summed over its threads) per IO, and wake-ups
# and calls into C per IO from .sched. The rtrs-bench binary is copied beside the profiles:
#   go tool pprof -top -nodecount=40 DIR/server-profile/rtrs-bench DIR/server-profile/rr.pprof
# Reports; asserts nothing (a failing step fails the suite, and leaves its mapping and loop
# device to the VM's end: run it alone); kept out of CI's run.
#
# Run (root): PROF_SECS=20 RTRS_VM_RESULTS=DIR scripts/vmtest.sh -k 6.12 scripts/vm/bench/server-profile.sh
# (PROF_SECS, default 20, and PROF_JOBS reach the guest through a file host() writes, since
# vmtest.sh passes no other environment to the guest.)

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev fio util-linux"

# shellcheck source-path=SCRIPTDIR source=figlib.sh
. "$RTRS_VM_REPO/scripts/vm/bench/figlib.sh"

host() {
	local secs=${PROF_SECS:-20}
	local pjobs=${PROF_JOBS:-rr rw} j
	[[ $secs =~ ^[1-9][0-9]*$ ]] || vm_die "PROF_SECS=$secs: a whole number of seconds, at least 1"
	for j in $pjobs; do
		[[ $j =~ ^(rr|rw|sr|sw)$ ]] || vm_die "PROF_JOBS=$pjobs: words of rr rw sr sw"
	done
	printf 'PROF_SECS=%s\nPROF_JOBS=%q\n' "$secs" "$pjobs" >"$RTRS_VM_WORK/server-profile.env"
	vm_build_kernel_rtrs
	mkdir -p "$RTRS_VM_WORK/bin"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-bench)
}

declare -A FIG_PORT=([prof]=1235)

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local PROF_SECS PROF_JOBS
	# shellcheck source=/dev/null # written by host()
	. "$RTRS_VM_WORK/server-profile.env"
	local O=$RTRS_VM_WORK/results/server-profile T=/tmp/prof A1=$RTRS_VM_ADDR1
	local hz lb pid dev t0
	hz=$(getconf CLK_TCK)
	mkdir -p "$O" "$T"
	cp "$RTRS_VM_WORK/bin/rtrs-bench" "$O/"

	echo "== a loop device over a 256M file in tmpfs, the first 200M random data (written with direct IO)"
	truncate -s 256M "$T"/disk
	lb=$(losetup -f --show "$T"/disk)
	dd if=/dev/urandom of="$lb" bs=1M count=200 oflag=direct status=none
	echo "loop: $lb"

	vm_load_kernel_rtrs rtrs-core rtrs-client rnbd-client

	echo "== rtrs-bench blkserver, verbs, $A1:${FIG_PORT[prof]}, -dir /dev"
	FIG_LOGS=$O/blkserver.log
	rtrs-bench blkserver -listen "$A1:${FIG_PORT[prof]}" -dir /dev -provider verbs -export-io direct \
		-profile-dir "$O" >"$O"/blkserver.log 2>&1 &
	pid=$!
	vm_wait 30 grep -q provider "$O"/blkserver.log || { fig_logs; return 1; }
	sleep 2
	echo "blkserver: pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline")"

	echo "== the kernel's rnbd-client maps $lb over both paths"
	fig_map prof "$lb" "${lb#/dev/}"
	dev=${FIG_DEV[prof]}
	echo "$dev: $(($(cat /sys/block/"${dev#/dev/}"/size) / 2048)) MiB, $(find /sys/block/"${dev#/dev/}"/mq -mindepth 1 -maxdepth 1 | wc -l) hardware queues"

	# exec_prerun / exec_postrun: SNAP FILE PREFIX (server stat and threads' status, /proc/stat).
	# shellcheck disable=SC2016 # expanded by the script
	printf '%s\n' '#!/bin/sh' \
		"cat /proc/$pid/stat /proc/$pid/task/*/status >\"\$1.srv\"" \
		'read -r l </proc/stat && echo "$l" >"$1.stat"' >"$T"/snap
	# shellcheck disable=SC2016
	printf '%s\n' '#!/bin/sh' "\"$T/snap\" \"\$1\"" "kill -USR1 $pid" >"$T"/pre
	# shellcheck disable=SC2016
	# (The snapshot first: writing the profile is not the job's CPU.)
	# shellcheck disable=SC2016
	printf '%s\n' '#!/bin/sh' "\"$T/snap\" \"\$1\"" "kill -USR2 $pid" >"$T"/post
	chmod +x "$T"/snap "$T"/pre "$T"/post

	local j rw bs qd rc=0
	for j in $PROF_JOBS; do
		case $j in
		rr) rw=randread bs=4k qd=32 ;;
		rw) rw=randwrite bs=4k qd=32 ;;
		sr) rw=read bs=1m qd=8 ;;
		sw) rw=write bs=1m qd=8 ;;
		esac
		rm -f "$O"/blkserver.pprof "$O"/blkserver.sched
		echo "== $j: fio $bs $rw QD$qd, $PROF_SECS s"
		t0=$(vm_now)
		fio --name="$j" --filename="$dev" --ioengine=libaio --direct=1 --size=200m --time_based \
			--runtime="$PROF_SECS" --rw="$rw" --bs="$bs" --iodepth="$qd" \
			--exec_prerun="$T/pre $O/$j.pre" --exec_postrun="$T/post $O/$j.post" \
			--output-format=terse --terse-version=3 >"$O/$j.fio" 2>&1 || rc=$?
		echo "fio rc $rc in $(vm_since "$t0") s"
		vm_wait 20 test -s "$O"/blkserver.sched || { fig_logs; rc=1; }
		mv "$O"/blkserver.pprof "$O/$j.pprof" || rc=1
		mv "$O"/blkserver.sched "$O/$j.sched" || rc=1
		[ "$rc" = 0 ] || { cat "$O/$j.fio"; fig_logs; break; }
	done

	if [ "$rc" = 0 ]; then
		prof_table "$O" "$hz" | tee "$O"/summary.md
	fi

	echo "== unmapping, stopping"
	echo normal >"/sys/block/${dev#/dev/}/rnbd/unmap_device"
	vm_wait 10 test ! -e "$dev"
	kill "$pid"
	vm_wait 20 sh -c "! kill -0 $pid 2>/dev/null" || kill -KILL "$pid"
	wait "$pid" || true
	losetup -d "$lb"
	rm -f "$T"/disk
	return "$rc"
}

# prof_srv FILE: "cpu_jiffies voluntary involuntary" from a snapshot of /proc/PID/stat and the
# threads' status files.
prof_srv() {
	awk 'NR == 1 { sub(/^.*\) /, ""); split($0, f, " "); cpu = f[12] + f[13] }
		$1 == "voluntary_ctxt_switches:" { v += $2 } $1 == "nonvoluntary_ctxt_switches:" { n += $2 }
		END { print cpu, v, n }' "$1"
}

# prof_table DIR HZ: the per-job table as markdown.
prof_table() {
	local O=$1 hz=$2 j s0 s1 b0 b1
	echo "## server profile: kernel $(uname -r), 2 vCPUs (qemu TCG), rxe, two paths, the kernel's rnbd-client → rtrs-bench blkserver (verbs, direct)"
	echo ""
	echo "fio libaio direct=1 size=200m, 4 KiB QD32 (rr, rw) or 1 MiB QD8 (sr, sw), $PROF_SECS s per job; windows from fio's exec_prerun to its exec_postrun. Server CPU: utime+stime (/proc/PID/stat); guest CPU: /proc/stat busy (all but idle and iowait), CLK_TCK $hz; switches: voluntary+involuntary summed over the server's threads; wake-ups (estimated) and calls into C from blkserver's .sched."
	echo ""
	echo "| job | IOPS | IOs | server CPU µs/IO | guest CPU µs/IO | server ctx sw/IO (vol+invol) | wake-ups/IO | C calls/IO | GCs |"
	echo "|---|---|---|---|---|---|---|---|---|"
	for j in $PROF_JOBS; do
		s0=$(prof_srv "$O/$j.pre.srv") s1=$(prof_srv "$O/$j.post.srv")
		b0=$(fig_busy "$O/$j.pre.stat") b1=$(fig_busy "$O/$j.post.stat")
		awk -F';' -v j="$j" -v s0="$s0" -v s1="$s1" -v busy="$((b1 - b0))" -v hz="$hz" -v sched="$O/$j.sched" '
			$1 == "3" {
				kib = $6 + $47; iops = $8 + $49; ios = kib / (j ~ /^s/ ? 1024 : 4)
				split(s0, a, " "); split(s1, b, " ")
				while ((getline l < sched) > 0) { split(l, kv, " "); S[kv[1]] = kv[2] }
				printf "| %s | %.0f | %.0f | %.1f | %.1f | %.2f (%.2f+%.2f) | %.2f | %.2f | %d |\n", j, iops, ios,
					(b[1] - a[1]) * 1e6 / hz / ios, busy * 1e6 / hz / ios,
					(b[2] - a[2] + b[3] - a[3]) / ios, (b[2] - a[2]) / ios, (b[3] - a[3]) / ios,
					S["wakeups"] / ios, S["ccalls"] / ios, S["gc"]
				exit
			}' "$O/$j.fio"
	done
}
