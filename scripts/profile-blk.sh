#!/bin/bash
# scripts/profile-blk.sh [OUT]: where an IO's CPU goes on the host's block chain, fio (nbd
# engine) → rtrs-bench nbdclient (NBD server, RNBD client, RTRS over the soft provider) →
# rtrs-bench blkserver (RTRS, RNBD server) → a tmpfs file, at 4 KiB randread and randwrite,
# QD1 and QD32. For each job and each of the two processes, over the fio run only: a CPU
# profile (pprof, its top functions in OUT/NAME.top), and per IO the CPU time, the syscalls
# (perf's raw_syscalls:sys_enter tracepoint), the OS context switches, the goroutine
# wake-ups (the Go runtime's estimate) and, over verbs, the calls into C. A table goes to
# OUT/profile.md. Needs fio with its nbd engine, perf, and Go (without Go, PROFILE_BIN names
# a built rtrs-bench and the .top files are left to be made where Go is). Reports; asserts
# nothing. The host's default is the soft provider over loopback; the VM's verbs run
# (scripts/vm/bench/profile-verbs.sh) sets PROFILE_PROVIDER=verbs and PROFILE_ADDR to rxe's,
# and PROFILE_PERF=0: perf enabling its events patches kernel text, which under the VM's
# emulated CPU oopses (int3 in __schedule, seen on 6.12). Without perf the counts come from
# /proc: the read and write syscalls (/proc/PID/io's syscr + syscw, not epoll or futex) and
# the context switches of every thread. PROFILE_TOP=0 leaves the pprof tops to be made later
# (the VM's, where go tool pprof under TCG takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/rtrs-profile}
secs=${PROFILE_SECS:-10}
prov=${PROFILE_PROVIDER:-soft}
addr=${PROFILE_ADDR:-127.0.0.1}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -n "${PROFILE_BIN:-}" ]; then
	cp "$PROFILE_BIN" "$out/rtrs-bench"
else
	go build -o "$out/rtrs-bench" ./cmd/rtrs-bench
fi
dir=$(mktemp -d /dev/shm/rtrs-prof.XXXXXX)
pids=()
cleanup() {
	[ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
	wait 2>/dev/null || true
	rm -rf "$dir"
}
trap cleanup EXIT
dd if=/dev/urandom of="$dir/disk" bs=1M count=256 status=none
sock=$dir/nbd.sock # in memory: a unix socket cannot live on 9p (the VM's work folder)
rm -f "$sock"
"$out/rtrs-bench" blkserver -provider "$prov" -listen "$addr:18640" -dir "$dir" -profile-dir "$out" 2>"$out/blkserver.log" &
srv=$!
pids+=("$srv")
sleep 0.5
"$out/rtrs-bench" nbdclient -provider "$prov" -path "ip:$addr@ip:$addr" -port 18640 -socket "$sock" \
	-profile-dir "$out" 2>"$out/nbdclient.log" &
cli=$!
pids+=("$cli")
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ]

# cpu_ticks PID: user + system clock ticks of the process so far.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
tck=$(getconf CLK_TCK)
perf=${PROFILE_PERF:-1}
sysc="syscalls/IO"
[ "$perf" = 1 ] || sysc="read and write syscalls/IO"

# proc_counts PID: its read and write syscalls, and its threads' context switches, so far.
proc_counts() {
	local io cs
	io=$(awk '$1 == "syscr:" || $1 == "syscw:" { n += $2 } END { print n }' "/proc/$1/io")
	cs=$(cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ { n += $2 } END { print n }')
	echo "$io $cs"
}

{
	echo "| job | process | CPU µs/IO | $sysc | context switches/IO | goroutine wake-ups/IO (est.) | calls into C/IO | IOPS |"
	echo "|---|---|---|---|---|---|---|---|"
} >"$out/profile.md"
for job in "randread 1" "randwrite 1" "randread 32" "randwrite 32"; do
	read -r rw qd <<<"$job"
	tag=$rw-qd$qd
	c0s=$(cpu_ticks "$srv") c0c=$(cpu_ticks "$cli")
	kill -USR1 "$srv" "$cli"
	declare -A pc0
	for p in "$srv" "$cli"; do
		if [ "$perf" = 1 ]; then
			perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "$p" -- sleep "$secs" \
				2>"$out/$tag-$p.perf" &
		else
			pc0[$p]=$(proc_counts "$p")
		fi
	done
	fio --name="$tag" --ioengine=nbd --uri="nbd+unix:///bench/disk?socket=$sock" --rw="$rw" --bs=4k \
		--iodepth="$qd" --size=256m --time_based --runtime="$secs" --output-format=terse --terse-version=3 \
		>"$out/$tag.fio"
	if [ "$perf" = 1 ]; then
		wait %perf 2>/dev/null || true
	else
		# The same lines as perf stat -x, writes.
		for p in "$srv" "$cli"; do
			read -r s0 x0 <<<"${pc0[$p]}"
			read -r s1 x1 <<<"$(proc_counts "$p")"
			printf '%d,,raw_syscalls:sys_enter\n%d,,context-switches\n' $((s1 - s0)) $((x1 - x0)) >"$out/$tag-$p.perf"
		done
	fi
	sleep 0.5
	kill -USR2 "$srv" "$cli"
	sleep 0.5
	c1s=$(cpu_ticks "$srv") c1c=$(cpu_ticks "$cli")
	# IOs: IOPS × runtime (ms) of the side that moved.
	ios=$(awk -F';' '/^3;/ { print int($8 * $9 / 1000 + $49 * $50 / 1000) }' "$out/$tag.fio")
	iops=$(awk -F';' '/^3;/ { print int($8 + $49) }' "$out/$tag.fio")
	for side in blkserver:"$srv":"$c0s":"$c1s" nbdclient:"$cli":"$c0c":"$c1c"; do
		IFS=: read -r name p t0 t1 <<<"$side"
		mv "$out/$name.pprof" "$out/$tag-$name.pprof"
		mv "$out/$name.sched" "$out/$tag-$name.sched"
		if [ "${PROFILE_TOP:-1}" = 1 ] && command -v go >/dev/null; then
			go tool pprof -top -nodecount=30 "$out/rtrs-bench" "$out/$tag-$name.pprof" >"$out/$tag-$name.top" 2>/dev/null
		fi
		awk -F, -v ios="$ios" -v tck="$tck" -v t0="$t0" -v t1="$t1" -v job="$tag" -v name="$name" -v iops="$iops" \
			-v wake="$(awk '$1 == "wakeups" { print $2 }' "$out/$tag-$name.sched")" \
			-v calls="$(awk '$1 == "ccalls" { print $2 }' "$out/$tag-$name.sched")" '
			$3 == "raw_syscalls:sys_enter" { sc = $1 } $3 == "context-switches" { cs = $1 }
			END {
				c = calls == "" ? "-" : sprintf("%.2f", calls / ios)
				printf "| %s | %s | %.1f | %.2f | %.2f | %.2f | %s | %d |\n", job, name, (t1 - t0) * 1e6 / tck / ios, sc / ios, cs / ios, wake / ios, c, iops }' \
			"$out/$tag-$p.perf" >>"$out/profile.md"
	done
done
cat "$out/profile.md"
