#!/usr/bin/env bash
# Regenerates the raw runs behind docs/benchmarks.md in bench/results/: the two-process rdma-perf
# suite and the in-process Go benchmarks, each beside its same-run TCP baseline, the RTRS suite and
# the block-service suite.
# Usage: scripts/bench.sh [reps] [duration]
set -euo pipefail
cd "$(dirname "$0")/.."
# Go as go.mod asks for it (fetched through the Go module proxy if the go found is older).
. scripts/go-toolchain.sh
rtrs_use_go
reps=${1:-5}
dur=${2:-2s}
go build -o bin/ ./cmd/...
mkdir -p bench/results
out=bench/results/soft-rdma.md
{
	echo "## soft-rdma: two processes (rdma-perf -suite $reps -duration $dur)"
	echo
	bin/rdma-perf -suite "$reps" -duration "$dur"
	echo
	echo "## soft-rdma: one process (go test -bench, -count $reps)"
	echo
	echo '```'
	go test -run '^$' -bench . -benchtime 1s -count "$reps" ./pkg/rdma/soft/ | grep -E '^(Benchmark|cpu:)'
	echo '```'
} >"$out"
echo "wrote $out"
bin/rtrs-bench suite -duration "$dur" >bench/results/rtrs.md
echo "wrote bench/results/rtrs.md"
bin/rtrs-bench blksuite -duration 4s -size 512M -reps 3 >bench/results/rnbd.md
echo "wrote bench/results/rnbd.md"
