#!/usr/bin/env bash
# Regenerates the measured part of docs/benchmarks.md: the two-process rdma-perf suite and the
# in-process Go benchmarks, each beside its same-run TCP baseline.
# Usage: scripts/bench.sh [reps] [duration]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/go/bin/go ] && export PATH="/usr/local/go/bin:$PATH"
reps=${1:-5}
dur=${2:-2s}
go build -o bin/ ./cmd/...
out=docs/benchmarks-soft-rdma.generated.md
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
bin/rtrs-bench suite -duration "$dur" >docs/benchmarks-rtrs.generated.md
echo "wrote docs/benchmarks-rtrs.generated.md"
bin/rtrs-bench blksuite -duration 4s -size 512M -reps 3 >docs/benchmarks-rnbd.generated.md
echo "wrote docs/benchmarks-rnbd.generated.md"
