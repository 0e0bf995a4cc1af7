#!/bin/bash
# scripts/blk-ab.sh ROUNDS BIN...: an A/B (or A/B/C…) of rtrs-bench builds on the host's block
# chain: fio's nbd engine → BIN nbdclient (NBD server, RNBD client, RTRS over the soft provider)
# → BIN blkserver → a 256 MiB file on tmpfs, started afresh for each binary in each round, the
# binaries' order reversed every other round. The jobs are AB_JOBS, a space-separated list of
# RW:BS:QD (by default "randread:4k:1 randwrite:4k:1", queue depth 1, where wake-ups decide the
# figures; "write:1m:8" is blksuite's 1 MiB write row), AB_SECS seconds each (5 by default).
# Per binary and job one line: IOPS, p50 completion latency, CPU (user + system) of the two
# processes per IO, and their threads' context switches (voluntary and involuntary) per IO;
# fio's own CPU is left out. Build the binaries first, e.g.
#   go build -o /tmp/a/rtrs-bench ./cmd/rtrs-bench; git stash; go build -o /tmp/b/rtrs-bench ./cmd/rtrs-bench; git stash pop
#   scripts/blk-ab.sh 6 /tmp/a/rtrs-bench /tmp/b/rtrs-bench
# Needs fio with its nbd engine and python3. Reports; asserts nothing.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 ROUNDS BIN..." >&2; exit 2; }
rounds=$1
shift
bins=("$@")
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS: a whole number, at least 1" >&2; exit 2; }
for b in "${bins[@]}"; do [ -x "$b" ] || { echo "$b: not an executable" >&2; exit 2; }; done
secs=${AB_SECS:-5}
[[ $secs =~ ^[1-9][0-9]*$ ]] || { echo "AB_SECS: a whole number of seconds, at least 1" >&2; exit 2; }
# Split on any blank, newlines included; each job's block size at most 9999k or 99m (the
# device is 256 MiB).
read -r -d '' -a jobs < <(printf '%s\0' "${AB_JOBS:-randread:4k:1 randwrite:4k:1}") || true
[ ${#jobs[@]} -gt 0 ] || { echo "AB_JOBS: no job" >&2; exit 2; }
for j in "${jobs[@]}"; do
	[[ $j =~ ^(rand)?(read|write):([1-9][0-9]{0,3}[kK]|[1-9][0-9]?[mM]):[1-9][0-9]{0,2}$ ]] || { echo "AB_JOBS: $j is not RW:BS:QD (RW read, write, randread or randwrite; e.g. randread:4k:1, write:1m:8)" >&2; exit 2; }
done
dir=$(mktemp -d /dev/shm/rtrs-ab.XXXXXX)
pids=()
cleanup() {
	[ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
	wait 2>/dev/null || true
	rm -rf "$dir"
}
trap cleanup EXIT
tck=$(getconf CLK_TCK)
dd if=/dev/urandom of="$dir/disk" bs=1M count=256 status=none

# cpu PID: user + system clock ticks of the process so far; cs PID: its threads' context switches.
cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
cs() { cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ { s += $2 } END { print s }'; }

# run BIN: both processes of BIN, the jobs, a line each.
run() {
	local bin=$1 srv cli job rw bs qd c0 s0 c1 s1
	rm -f "$dir/nbd.sock"
	"$bin" blkserver -provider soft -listen 127.0.0.1:18650 -dir "$dir" 2>"$dir/srv.log" &
	srv=$!
	pids=("$srv")
	sleep 0.5
	"$bin" nbdclient -provider soft -path "ip:127.0.0.1@ip:127.0.0.1" -port 18650 -socket "$dir/nbd.sock" 2>"$dir/cli.log" &
	cli=$!
	pids+=("$cli")
	for _ in $(seq 100); do [ -S "$dir/nbd.sock" ] && break; sleep 0.1; done
	[ -S "$dir/nbd.sock" ] || { echo "$bin: no NBD socket; its logs:" >&2; cat "$dir/srv.log" "$dir/cli.log" >&2; exit 1; }
	for job in "${jobs[@]}"; do
		IFS=: read -r rw bs qd <<<"$job"
		c0=$(($(cpu "$srv") + $(cpu "$cli")))
		s0=$(($(cs "$srv") + $(cs "$cli")))
		fio --name=ab --ioengine=nbd --uri="nbd+unix:///?socket=$dir/nbd.sock" --rw=$rw --bs="$bs" --iodepth="$qd" \
			--time_based --runtime="$secs" --size=256M --output-format=json --output="$dir/fio.json" >/dev/null
		c1=$(($(cpu "$srv") + $(cpu "$cli")))
		s1=$(($(cs "$srv") + $(cs "$cli")))
		python3 - "$dir/fio.json" "$bin" "$job" $((c1 - c0)) $((s1 - s0)) "$tck" <<'PY'
import json, sys
path, binary, name, ticks, switches, tck = sys.argv[1:]
job = json.load(open(path))["jobs"][0]["read" if name.split(":")[0].endswith("read") else "write"]
ios = job["total_ios"]
print("%s %s iops %d p50_us %.1f cpu_us_per_io %.1f cs_per_io %.2f" % (
    binary, name, job["iops"], job["clat_ns"]["percentile"]["50.000000"] / 1000,
    int(ticks) * 1e6 / int(tck) / ios, int(switches) / ios))
PY
	done
	kill "$cli" "$srv"
	wait "$cli" "$srv" 2>/dev/null || true
	pids=()
}

for ((r = 1; r <= rounds; r++)); do
	order=("${bins[@]}")
	if ((r % 2 == 0)); then
		order=()
		for ((i = ${#bins[@]} - 1; i >= 0; i--)); do order+=("${bins[i]}"); done
	fi
	for b in "${order[@]}"; do run "$b"; done
done
