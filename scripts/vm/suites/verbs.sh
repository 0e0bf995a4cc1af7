# shellcheck shell=bash
# The verbs provider on rxe: the provider conformance suite, the transport's engine tests over
# verbs, both daemons with -provider verbs over two rxe paths, and rdma-perf beside perftest on
# the same device (figures into results/verbs-perf.md; reported, not asserted; VERBS_PERF=0
# leaves that out: CI measures it on one kernel, 6.12).

# Building the verbs provider needs rdma-core's development files.
# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev"

# Host: test binaries and the commands, with the verbs provider (no race detector: the
# emulated CPU is slow enough; the race detector runs on the host over every package).
host() {
	local b=$RTRS_VM_WORK/bin
	case ${VERBS_PERF:-1} in
	0 | 1) ;;
	*) vm_die "VERBS_PERF: $VERBS_PERF is neither 0 nor 1" ;;
	esac
	echo "VERBS_PERF=${VERBS_PERF:-1}" >"$RTRS_VM_WORK/verbs.env"
	mkdir -p "$b"
	(
		cd "$RTRS_VM_REPO" || exit
		go test -c -tags verbs -o "$b/verbs.test" ./pkg/rdma/verbs
		go test -c -tags verbs -o "$b/transport.test" ./pkg/transport
		go test -c -tags verbs -o "$b/pick.test" ./pkg/rdma/pick
		go build -tags verbs -o "$b/" ./cmd/...
	)
}

guest() {
	local A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 D=$RTRS_VM_DEV B=$RTRS_VM_WORK/bin failed=()
	export PATH=$B:$PATH
	# The suite fails if any part did.
	vm_part "conformance over verbs ($D)" conformance "$A1" "$A2" "$D"
	vm_part "provider choice" pick.test -test.v -test.count 1
	vm_part "transport engine tests over verbs" transport_tests "$A1" "$A2"
	vm_part "daemons with -provider verbs" daemons "$A1" "$A2" "$D"
	local VERBS_PERF
	# shellcheck source=/dev/null # written by host
	. "$RTRS_VM_WORK/verbs.env"
	if [ "$VERBS_PERF" = 1 ]; then
		vm_part "rdma-perf beside perftest on $D" perf "$A1" "$D"
	else
		echo "== rdma-perf beside perftest not run here (VERBS_PERF=0)"
	fi
	if [ ${#failed[@]} -gt 0 ]; then
		echo "failed: ${failed[*]}"
		return 1
	fi
}

conformance() {
	RTRS_VERBS_ADDR1=$1 RTRS_VERBS_ADDR2=$2 RTRS_VERBS_DEV=$3 \
		verbs.test -test.v -test.timeout 900s -test.count 1 2>&1 | tee /tmp/verbs.out
	# Every test here has its device: a skip means a piece is missing.
	! grep -- '--- SKIP' /tmp/verbs.out
}

# transport_tests A1 A2: the transport's engine tests that need a real provider, selected by
# name; each must have run and passed (a renamed test would otherwise leave the selection empty
# and the part green).
transport_tests() {
	local tests=(TestOpenAndRandomIO TestFailoverMidIO TestStaleRkeyRefused TestIdleHeartbeatsKeepPath TestIOBuffers) sel
	sel=$(IFS='|' && printf '^(%s)$' "${tests[*]}")
	RTRS_TEST_PROVIDER=verbs RTRS_TEST_ADDR1=$1 RTRS_TEST_ADDR2=$2 transport.test -test.v \
		-test.timeout 600s -test.count 1 -test.run "$sel" 2>&1 | tee /tmp/transport.out
	vm_require_tests /tmp/transport.out "${tests[@]}"
}

perf() {
	perf_compare "$1" "$2" >"$RTRS_VM_WORK/results/verbs-perf.md"
	cat "$RTRS_VM_WORK/results/verbs-perf.md"
}

# daemons A1 A2 DEV: rtrs-serverd and rtrs-clientd over verbs; a session over two rxe paths
# through ctl/open_session, a device mapped, 16 MiB written and read back through its file.
daemons() {
	local A1=$1 A2=$2 D=$3 T=/tmp/daemons
	mkdir -p $T/exports $T/srv $T/cli $T/dev
	truncate -s 64M $T/exports/disk
	: >$T/clientd.conf
	# Not RNBD's port 1234: another suite may have loaded the kernel's rnbd-server, which
	# listens there.
	rtrs-serverd -provider verbs -config /dev/null -listen "$A1:11234" -dev-search-path $T/exports \
		-mount $T/srv -rnbd-mount $T/rnbd -names-file $T/names.json >$T/serverd.log 2>&1 &
	local spid=$!
	rtrs-clientd -provider verbs -config $T/clientd.conf -mount $T/cli -dev-mount $T/dev \
		-nbd-socket $T/nbd.sock >$T/clientd.log 2>&1 &
	local cpid=$!
	vm_wait 30 mountpoint -q $T/srv || { cat $T/serverd.log; return 1; }
	vm_wait 30 mountpoint -q $T/dev || { cat $T/clientd.log; return 1; }
	grep -q "provider verbs" $T/serverd.log
	grep -q "provider verbs" $T/clientd.log
	echo "sessname=s1 dest_port=11234 path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1" >$T/cli/ctl/open_session
	echo "sessname=s1 device_path=disk access_mode=rw" >$T/dev/ctl/map_device
	head -c 16M /dev/urandom >$T/pattern
	dd if=$T/pattern of=$T/dev/s1/disk bs=1M conv=fsync status=none
	# (No process substitution: the guest has no /dev/fd.)
	head -c 16M $T/exports/disk >$T/export.head
	cmp $T/pattern $T/export.head
	dd if=$T/dev/s1/disk of=$T/readback bs=1M count=16 status=none
	cmp $T/pattern $T/readback
	local n=0 f
	for f in "$T"/cli/s1/paths/*/hca_name "$T"/srv/s1/paths/*/hca_name; do
		echo "$f: $(cat "$f")"
		[ "$(cat "$f")" = "$D" ]
		n=$((n + 1))
	done
	[ "$n" = 4 ] # two paths on each side
	cat $T/cli/s1/paths/*/state
	cat $T/cli/s1/paths/*/stats/rdma
	echo "sessname=s1 device_path=disk" >$T/dev/ctl/unmap_device
	echo s1 >$T/cli/ctl/close_session
	# SIGTERM: each closes its sessions and unmounts, client first.
	kill $cpid
	wait $cpid
	kill $spid
	wait $spid
	if mountpoint -q $T/srv || mountpoint -q $T/cli || mountpoint -q $T/dev; then
		echo "a tree is still mounted after the daemons stopped"
		return 1
	fi
}

# perf_compare A1 DEV: markdown table of rdma-perf over verbs beside perftest, PERF_ROUNDS
# rounds on the same device (three: CI runs this on three kernels; scripts/vm/bench has the
# longer measurements), which of the two goes first alternating, and the medians over the rounds
# that measured all four figures (an even count of them: the mean of the two middle values).
# One unit for bandwidth: MB/s of 10^6 bytes, rdma-perf's; perftest's "BW average[MB/sec]" is
# 2^20 bytes per second (its MB format factor is 0x100000), so it is multiplied by 1.048576
# before it is shown or compared. Like with like:
# RDMA_WRITE 1 MiB with 16 in flight on both (ib_write_bw -t 16), and 8-byte SEND latency with
# busy polling on both sides (perftest's default; rdma-perf -mode poll, whose server then polls
# too), as one-way latency: perftest reports half the round trip (t_typical), so rdma-perf's
# round-trip p50 is halved; 2000 round trips on both (ib_send_lat -n 2000, rdma-perf -iters
# 2000), not a count against a duration. The last column is rdma-perf's client's calls into C
# (cgo) per round trip, which the verbs provider counts.
PERF_ROUNDS=3
perf_compare() {
	local A1=$1 D=$2 i ow pw ol pl oc j
	rdma-perf -provider verbs -listen "$A1:18600" >/tmp/rdma-perf-server.log 2>&1 &
	local rp=$!
	vm_wait 20 vm_tcp_listening 18601
	echo "| round | rdma-perf write_bw 1 MiB (MB/s, 10^6 B/s) | ib_write_bw 1 MiB (MB/s, 10^6 B/s: its MB/sec × 1.048576) | ratio | rdma-perf send_lat 8 B p50/2 (us) | ib_send_lat 8 B t_typical (us) | ratio | rdma-perf calls into C per round trip |"
	echo "|---|---|---|---|---|---|---|---|"
	for i in $(seq 1 "$PERF_ROUNDS"); do
		ours_bw() {
			ow=$(timeout -k 5 120 rdma-perf -provider verbs -connect "$A1:18600" -test write_bw -size 1M -depth 16 -duration 3s -json |
				sed -n 's/.*"mb_per_s": *\([0-9.]*\).*/\1/p')
		}
		theirs_bw() {
			# perftest's MB/sec is 2^20 B/s: in 10^6 B/s, like rdma-perf's.
			pw=$(vm_perftest_pair ib_write_bw -d "$D" -F -R -s 1048576 -t 16 -n 100 |
				awk '$1 == 1048576 { printf "%.2f", $4 * 1048576 / 1e6; exit }')
		}
		ours_lat() {
			j=$(timeout -k 5 120 rdma-perf -provider verbs -connect "$A1:18600" -test send_lat -size 8 -mode poll -iters 2000 -json)
			ol=$(sed -n 's/.*"p50_us": *\([0-9.]*\).*/\1/p' <<<"$j")
			oc=$(sed -n 's/.*"c_calls_per_op": *\([0-9.]*\).*/\1/p' <<<"$j")
		}
		theirs_lat() { pl=$(vm_perftest_pair ib_send_lat -d "$D" -F -R -s 8 -n 2000 | awk '$1 == 8 {print $5; exit}'); }
		if [ $((i % 2)) = 1 ]; then
			ours_bw && theirs_bw && ours_lat && theirs_lat || true
		else
			theirs_bw && ours_bw && theirs_lat && ours_lat || true
		fi
		# A round where one of the four did not measure is left out of the medians; so is one
		# where perftest printed "inf" for its latency (seen once), which awk takes as a number.
		awk -v i="$i" -v ow="$ow" -v pw="$pw" -v ol="$ol" -v pl="$pl" -v oc="$oc" 'function ok(v) { return v ~ /^[0-9]+(\.[0-9]*)?$/ && v > 0 } BEGIN {
			if (ok(ow) && ok(pw) && ok(ol) && ok(pl))
				printf "| %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f |\n", i, ow, pw, ow / pw, ol / 2, pl, ol / 2 / pl, oc
			else
				printf "| %d | %s | %s | - | %s | %s | - | %s |\n", i, ow, pw, ol, pl, oc }'
		ow='' pw='' ol='' pl='' oc=''
	done | tee /tmp/perf-rounds
	grep -v -- '| - |' /tmp/perf-rounds >/tmp/perf-complete || true
	local n
	n=$(wc -l </tmp/perf-complete)
	if [ "$n" -lt $((PERF_ROUNDS / 2 + 1)) ]; then
		echo "only $n of $PERF_ROUNDS rounds measured all four figures"
		kill $rp
		return 1
	fi
	# Medians of each column over the complete rounds: the middle value, or the mean of the two
	# middle ones for an even count (ratios to two places, the rest to one).
	local c line="| median |"
	for c in 3 4 5 6 7 8 9; do
		line="$line $(cut -d'|' -f$c /tmp/perf-complete | median "$([ "$c" = 5 ] || [ "$c" = 8 ] || [ "$c" = 9 ] && echo 2 || echo 1)") |"
	done
	echo "$line"
	echo
	echo "rdma-perf server CPU (user+sys ticks): $(awk '{print $14 + $15}' /proc/$rp/stat)"
	kill $rp
	wait $rp || true
}

# median PLACES: the median of the numbers on stdin (one a line), with PLACES decimals; the
# mean of the two middle values when the count is even.
median() {
	sort -g | awk -v p="$1" '{ v[NR] = $1 } END {
		if (NR == 0) exit 1
		m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
		printf "%.*f\n", p, m }'
}
