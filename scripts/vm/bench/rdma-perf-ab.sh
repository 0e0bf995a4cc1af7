# shellcheck shell=bash
# rdma-perf A/B: rdma-perf built from this tree (new) against rdma-perf built from another git
# revision (alt), with perftest beside them as the fixed reference, on the same rxe device
# ($RTRS_VM_DEV, $RTRS_VM_ADDR1 to itself) in one VM run:
#   new  rdma-perf -provider verbs from this tree, its server on port 18620 (raw TCP on 18621)
#   alt  rdma-perf built from FIG_ALT_REV (git archive of that revision), its server on port
#        18630; without FIG_ALT_REV the same binary as new (the noise floor); FIG_ALT_ENV adds
#        environment to alt's server and clients (NAME=value words, e.g. GOMAXPROCS=1)
#   pt   perftest (ib_send_lat, ib_write_bw), server and client started afresh per measurement
# Each build's client talks to its own build's server; both servers run from start to end. The
# measurements are verbs.sh's perf_compare's: 8-byte SEND latency with busy polling on both
# sides (rdma-perf -test send_lat -size 8 -mode poll -iters 2000, whose server then polls too;
# ib_send_lat -s 8 -n 2000), one-way (rdma-perf's round-trip p50 halved, perftest's t_typical),
# and RDMA_WRITE 1 MiB with 16 in flight (rdma-perf -test write_bw -size 1M -depth 16 -duration
# 3s; ib_write_bw -s 1048576 -t 16 -n 100) in MB/s of 10^6 bytes (perftest's MB/sec × 1.048576).
# FIG_ROUNDS rounds (5); in each, send_lat on new, alt and pt, then write_bw on the three (FIG_JOBS:
# "lat bw", the default, or one of them), the order reversed every other round. Per rdma-perf
# client run also: its calls into C per operation (c_calls_per_op, the verbs provider's count),
# its voluntary and involuntary context switches summed over its threads (GNU time's %w and %c:
# wait4's rusage of the whole process), and its server's over the same span (the deltas of
# /proc/PID/task/*/status, threads alive at the end). The change this was written for cuts the
# Go runtime's monitor-thread wake-ups in busy-polling loops, which show as voluntary switches.
# Tables (a row per round, '-' where a figure is missing; new/perftest, alt/perftest, new/alt per
# round) and medians over the complete rounds (all three figures of that test; the mean of the
# middle two for an even count; the ratio columns are medians of the per-round ratios):
# results/rdma-perf-ab.md (printed too); a line per measurement in results/rdma-perf-ab-raw.txt;
# the servers' logs in results/rdma-perf-ab-server-{new,alt}.log. Fewer than half the rounds
# complete, for either test, fails the suite; no speed is asserted.
#
# Run (root): FIG_ALT_REV=<rev> FIG_ROUNDS=5 RTRS_VM_RESULTS=DIR scripts/vmtest.sh -k 6.12 scripts/vm/bench/rdma-perf-ab.sh
# (e.g. FIG_ALT_REV=HEAD~1 for the last commit against the one before it, on a clean tree; the
# guest reads the inputs from a file host() writes, since vmtest.sh passes no other environment
# to the guest). FIG_JOBS=lat leaves write_bw out. FIG_SECS and FIG_ALT_FLAGS are not used
# here (the latency test is a count, the alt slot a build or an environment). Needs nothing
# beyond rxe, perftest and GNU time (SUITE_PACKAGES): any of 6.1, 6.12 and 7.2. Five rounds of
# both tests took 190 s in the guest on 6.12 (2026-11-27; about 4 minutes boot to power-off).

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev time"

# shellcheck source-path=SCRIPTDIR source=figlib.sh
. "$RTRS_VM_REPO/scripts/vm/bench/figlib.sh"

host() {
	local rounds=${FIG_ROUNDS:-5} want=${FIG_JOBS:-lat bw} j seen=" "
	local rev=${FIG_ALT_REV:-} env=${FIG_ALT_ENV:-} short=
	[[ $rounds =~ ^[1-9][0-9]*$ ]] || vm_die "FIG_ROUNDS=$rounds: a whole number, at least 1"
	for j in $want; do
		case $j in
		lat | bw) ;;
		*) vm_die "FIG_JOBS: $j is neither lat nor bw" ;;
		esac
		[[ $seen != *" $j "* ]] || vm_die "FIG_JOBS: $j twice"
		seen+="$j "
	done
	[ -n "${want// /}" ] || vm_die "FIG_JOBS: no test"
	[[ $env =~ ^([A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.,:/=-]*( |$))*$ ]] ||
		vm_die "FIG_ALT_ENV=$env: NAME=value words (letters, digits and _.,:/=- in the values)"
	[ -z "${FIG_ALT_FLAGS:-}" ] || vm_die "FIG_ALT_FLAGS: not used here (alt is a build, FIG_ALT_REV, or an environment, FIG_ALT_ENV)"
	if [ -n "$rev" ]; then
		short=$(git -C "$RTRS_VM_REPO" rev-parse --verify --quiet --short "$rev^{commit}") ||
			vm_die "FIG_ALT_REV=$rev: no such revision in $RTRS_VM_REPO"
	fi
	local desc="${rev:+built from $rev ($short) }$env"
	desc=${desc% }
	{
		printf 'FIG_ROUNDS=%s\n' "$rounds"
		printf 'FIG_JOBS=%q\nFIG_ALT_ENV=%q\nFIG_ALT_DESC=%q\n' "${seen:1:${#seen}-2}" "$env" "$desc"
	} >"$RTRS_VM_WORK/rdma-perf-ab.env"
	vm_log "rdma-perf-ab: $rounds rounds of ${seen:1:${#seen}-2}; alt: ${desc:-the same binary}"
	fig_build rdma-perf "$rev"
}

# The servers' ports (RDMA on the port, rdma-perf's raw TCP on port+1), their timeout's pids
# and their own pids.
declare -A AB_PORT=([new]=18620 [alt]=18630) AB_TPID=() AB_SPID=()

guest() {
	local R=$RTRS_VM_WORK/results T=/tmp/ab A1=$RTRS_VM_ADDR1 D=$RTRS_VM_DEV
	local FIG_ROUNDS FIG_JOBS FIG_ALT_ENV FIG_ALT_DESC
	# shellcheck source=/dev/null # written by host()
	. "$RTRS_VM_WORK/rdma-perf-ab.env"
	mkdir -p "$R" "$T"
	AB_RAW=$R/rdma-perf-ab-raw.txt
	echo "# round test slot value c_calls_per_op client_voluntary client_involuntary server_voluntary server_involuntary rc client_json (value: lat one-way us, bw MB/s of 10^6 B; '-' missing; '# order ROUND A B C' the round's order)" >"$AB_RAW"
	if [ ! -x /usr/bin/time ]; then
		echo "no GNU time (/usr/bin/time): SUITE_PACKAGES installs the package time on the host"
		return 1
	fi
	vm_port_active "$D" || { echo "$D: port not ACTIVE"; return 1; }

	echo "== rdma-perf servers: new (this tree, port ${AB_PORT[new]}) and alt (port ${AB_PORT[alt]}: ${FIG_ALT_DESC:-the same binary})"
	local stop=$((FIG_ROUNDS * 1200 + 600)) s env=()
	read -r -a env <<<"$FIG_ALT_ENV"
	timeout -k 5 "$stop" env "$RTRS_VM_WORK"/bin/rdma-perf -provider verbs -listen "$A1:${AB_PORT[new]}" \
		>"$R"/rdma-perf-ab-server-new.log 2>&1 &
	AB_TPID[new]=$!
	timeout -k 5 "$stop" env ${env[@]+"${env[@]}"} "$RTRS_VM_WORK"/alt/rdma-perf -provider verbs \
		-listen "$A1:${AB_PORT[alt]}" >"$R"/rdma-perf-ab-server-alt.log 2>&1 &
	AB_TPID[alt]=$!
	for s in new alt; do
		if ! vm_wait 30 vm_tcp_listening $((AB_PORT[$s] + 1)) || ! AB_SPID[$s]=$(pgrep -P "${AB_TPID[$s]}"); then
			echo "$s: rdma-perf server not listening on $A1:${AB_PORT[$s]}:"
			tail -20 "$R/rdma-perf-ab-server-$s.log"
			return 1
		fi
		echo "$s: pid ${AB_SPID[$s]}: $(tr '\0' ' ' <"/proc/${AB_SPID[$s]}/cmdline")"
	done
	[ -z "$FIG_ALT_ENV" ] || echo "alt's extra environment (server and clients): $FIG_ALT_ENV"

	local round t0 order j slot
	# shellcheck disable=SC2206 # words checked by host()
	local jobs=($FIG_JOBS)
	t0=$(vm_now)
	for ((round = 1; round <= FIG_ROUNDS; round++)); do
		order=(new alt pt)
		((round % 2)) || order=(pt alt new)
		echo "== round $round of $FIG_ROUNDS: ${order[*]}"
		echo "# order $round ${order[*]}" >>"$AB_RAW"
		for j in "${jobs[@]}"; do
			for slot in "${order[@]}"; do
				if [ "$slot" = pt ]; then
					ab_perftest "$round" "$j" "$D" || true
				else
					ab_client "$round" "$j" "$slot" "$A1" || true
				fi
			done
		done
	done
	echo "== $FIG_ROUNDS rounds took $(vm_since "$t0") s"

	local rc=0
	{
		ab_tables "$FIG_ROUNDS" "$FIG_JOBS" "$D" || rc=$?
		ab_servers
	} >"$R"/rdma-perf-ab.md
	cat "$R"/rdma-perf-ab.md
	echo "(raw lines: results/rdma-perf-ab-raw.txt)"
	cat "$AB_RAW"

	kill "${AB_TPID[new]}" "${AB_TPID[alt]}" 2>/dev/null || true
	wait "${AB_TPID[new]}" "${AB_TPID[alt]}" || true
	return "$rc"
}

# ab_cs PID: "voluntary involuntary" context switches of PID's threads so far.
ab_cs() {
	[ -d "/proc/$1" ] || return 1
	cat /proc/"$1"/task/*/status 2>/dev/null |
		awk '$1 == "voluntary_ctxt_switches:" { v += $2 } $1 == "nonvoluntary_ctxt_switches:" { i += $2 }
			END { if (v == "") exit 1; print v + 0, i + 0 }'
}

# ab_client ROUND TEST SLOT A1: one rdma-perf client of build SLOT (new, alt) against that build's
# server, TEST lat (send_lat) or bw (write_bw), under GNU time; appends its raw line. Fails when
# it measured nothing.
ab_client() {
	local round=$1 test=$2 slot=$3 a1=$4 bin=$RTRS_VM_WORK/bin/rdma-perf env=() unit=MB/s args rc=0 v=- c=- cv=- ci=- sv=- si=- j s0 s1
	case $test in
	lat) args=(-test send_lat -size 8 -mode poll -iters 2000 -json) unit="us one-way" ;;
	bw) args=(-test write_bw -size 1M -depth 16 -duration 3s -json) ;;
	esac
	if [ "$slot" = alt ]; then
		bin=$RTRS_VM_WORK/alt/rdma-perf
		read -r -a env <<<"$FIG_ALT_ENV"
	fi
	rm -f /tmp/ab/time /tmp/ab/out /tmp/ab/err
	s0=$(ab_cs "${AB_SPID[$slot]}") || s0=
	# (Both slots through env, which execs rdma-perf: the same chain for each.)
	timeout -k 5 120 /usr/bin/time -o /tmp/ab/time -f '%w %c' env ${env[@]+"${env[@]}"} "$bin" -provider verbs \
		-connect "$a1:${AB_PORT[$slot]}" "${args[@]}" >/tmp/ab/out 2>/tmp/ab/err || rc=$?
	s1=$(ab_cs "${AB_SPID[$slot]}") || s1=
	j=$(grep -m1 '^{' /tmp/ab/out) || j=
	case $test in
	lat) v=$(sed -n 's/.*"p50_us": *\([0-9.]*\).*/\1/p' <<<"$j" | awk '$1 > 0 { printf "%.3f", $1 / 2 }') ;;
	bw) v=$(sed -n 's/.*"mb_per_s": *\([0-9.]*\).*/\1/p' <<<"$j" | awk '$1 > 0 { printf "%.2f", $1 }') ;;
	esac
	c=$(sed -n 's/.*"c_calls_per_op": *\([0-9.]*\).*/\1/p' <<<"$j")
	if [ "$rc" != 0 ] || [ -z "$v" ]; then
		echo "round $round $test $slot: rdma-perf failed (rc $rc; client stderr, stdout and GNU time's file, server log):"
		tail -n 5 /tmp/ab/err /tmp/ab/out /tmp/ab/time 2>&1 || true
		tail -n 5 "$RTRS_VM_WORK/results/rdma-perf-ab-server-$slot.log" || true
		echo "$round $test $slot - - - - - - $rc ${j:--}" >>"$AB_RAW"
		return 1
	fi
	# GNU time's last line (before it, "Command exited with non-zero status" or the like).
	if [[ $(tail -1 /tmp/ab/time 2>/dev/null) =~ ^([0-9]+)\ ([0-9]+)$ ]]; then
		cv=${BASH_REMATCH[1]} ci=${BASH_REMATCH[2]}
	fi
	if [ -n "$s0" ] && [ -n "$s1" ]; then
		read -r sv si <<<"$(awk -v a="$s0" -v b="$s1" 'BEGIN { split(a, x, " "); split(b, y, " "); print y[1] - x[1], y[2] - x[2] }')"
	fi
	echo "$round $test $slot $v ${c:--} $cv $ci $sv $si $rc $j" >>"$AB_RAW"
	echo "round $round $test $slot: $v $unit, calls into C ${c:--}/op, client switches $cv voluntary $ci involuntary, server's $sv / $si"
}

# ab_perftest ROUND TEST DEV: ib_send_lat (lat) or ib_write_bw (bw) on DEV, as verbs.sh's
# perf_compare runs them; appends its raw line. Fails when it measured nothing.
ab_perftest() {
	local round=$1 test=$2 d=$3 out rc=0 v unit=MB/s
	case $test in
	lat)
		unit="us one-way (t_typical)"
		out=$(vm_perftest_pair ib_send_lat -d "$d" -F -R -s 8 -n 2000) || rc=$?
		v=$(awk '$1 == 8 && $5 > 0 { print $5; exit }' <<<"$out")
		;;
	bw)
		# perftest's MB/sec is 2^20 B/s: in 10^6 B/s, like rdma-perf's.
		out=$(vm_perftest_pair ib_write_bw -d "$d" -F -R -s 1048576 -t 16 -n 100) || rc=$?
		v=$(awk '$1 == 1048576 && $4 > 0 { printf "%.2f", $4 * 1048576 / 1e6; exit }' <<<"$out")
		;;
	esac
	if [ "$rc" != 0 ] || [ -z "$v" ]; then
		echo "round $round $test pt: perftest failed (rc $rc):"
		printf '%s\n' "$out" | tail -5
		echo "$round $test pt - - - - - - $rc -" >>"$AB_RAW"
		return 1
	fi
	echo "$round $test pt $v - - - - - 0 -" >>"$AB_RAW"
	echo "round $round $test pt: $v $unit"
}

# ab_tables ROUNDS JOBS DEV: from AB_RAW, a markdown table per test in JOBS, a row per round and
# the medians over the complete rounds; fails when fewer than half the rounds of a test are
# complete (saying so under its table).
ab_tables() {
	awk -v rounds="$1" -v jobs="$2" -v dev="$3" -v kernel="$(uname -r)" -v desc="${FIG_ALT_DESC:-the same binary as new}" "$FIG_AWK_MEDIAN"'
		function pos(x) { return x != "-" && x != "" && x + 0 > 0 }
		function cnt(x) { return x ~ /^[0-9]+$/ }
		function f(x, fmt) { return x == "" || x == "-" ? "-" : sprintf(fmt, x) }
		function n1(x) { return x == "" ? "-" : (x == int(x) ? sprintf("%d", x) : sprintf("%.1f", x)) }
		function cs(v, i) { return cnt(v) && cnt(i) ? v " / " i : "-" }
		/^# order / { ord[$3] = $4 ", " $5 ", " $6; next }
		/^#/ { next }
		{ k = $1 SUBSEP $2 SUBSEP $3; V[k] = $4; C[k] = $5; CV[k] = $6; CI[k] = $7; SV[k] = $8; SI[k] = $9 }
		END {
			printf "## rdma-perf A/B: kernel %s, 2 vCPUs (qemu TCG), %s\n\n", kernel, dev
			printf "new: rdma-perf from this tree; alt: %s; pt: perftest. Both builds -provider verbs, each client against its own build'"'"'s server (one per build, running throughout); %d rounds, the order reversed every other round. Client switches: GNU time'"'"'s %%w voluntary / %%c involuntary over the client'"'"'s whole life (all threads); server switches: the deltas of its threads'"'"' /proc status over that span. Medians over the complete rounds (the mean of the middle two for an even count; ratios: medians of the per-round ratios).\n", desc, rounds
			nt = split(jobs, J, " ")
			bad = 0
			for (t = 1; t <= nt; t++) {
				w = J[t]
				if (w == "lat") {
					printf "\n### send_lat 8 B, busy polling on both sides, one-way µs (rdma-perf: round-trip p50 / 2 of 2000; ib_send_lat -n 2000: t_typical)\n\n"
					vf = "%.2f"; nm = "send_lat"
				} else {
					printf "\n### write_bw 1 MiB, 16 in flight, MB/s of 10^6 B (rdma-perf: 3 s; ib_write_bw -n 100: its MB/sec × 1.048576)\n\n"
					vf = "%.1f"; nm = "write_bw"
				}
				print "| round | order | new | alt | perftest | new/perftest | alt/perftest | new/alt | new C calls/op | alt C calls/op | new client switches vol / invol | alt client switches vol / invol | new server switches vol / invol | alt server switches vol / invol |"
				print "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
				n = 0
				for (c = 1; c <= 16; c++) L[c] = ""
				for (r = 1; r <= rounds; r++) {
					kn = r SUBSEP w SUBSEP "new"; ka = r SUBSEP w SUBSEP "alt"; kp = r SUBSEP w SUBSEP "pt"
					ok = pos(V[kn]) && pos(V[ka]) && pos(V[kp])
					row = sprintf("| %d | %s | %s | %s | %s |", r, ord[r] == "" ? "-" : ord[r], f(V[kn], vf), f(V[ka], vf), f(V[kp], vf))
					if (ok) {
						rn = V[kn] / V[kp]; ra = V[ka] / V[kp]; rr = V[kn] / V[ka]
						row = row sprintf(" %.3f | %.3f | %.3f |", rn, ra, rr)
					} else
						row = row " - | - | - |"
					row = row sprintf(" %s | %s | %s | %s | %s | %s |", f(C[kn], "%.2f"), f(C[ka], "%.2f"),
						cs(CV[kn], CI[kn]), cs(CV[ka], CI[ka]), cs(SV[kn], SI[kn]), cs(SV[ka], SI[ka]))
					print row
					if (!ok) continue
					n++
					L[1] = L[1] " " V[kn]; L[2] = L[2] " " V[ka]; L[3] = L[3] " " V[kp]
					L[4] = L[4] " " rn; L[5] = L[5] " " ra; L[6] = L[6] " " rr
					if (pos(C[kn])) L[7] = L[7] " " C[kn]
					if (pos(C[ka])) L[8] = L[8] " " C[ka]
					if (cnt(CV[kn]) && cnt(CI[kn])) { L[9] = L[9] " " CV[kn]; L[10] = L[10] " " CI[kn] }
					if (cnt(CV[ka]) && cnt(CI[ka])) { L[11] = L[11] " " CV[ka]; L[12] = L[12] " " CI[ka] }
					if (cnt(SV[kn]) && cnt(SI[kn])) { L[13] = L[13] " " SV[kn]; L[14] = L[14] " " SI[kn] }
					if (cnt(SV[ka]) && cnt(SI[ka])) { L[15] = L[15] " " SV[ka]; L[16] = L[16] " " SI[ka] }
				}
				if (n > 0) {
					row = sprintf("| median (%d of %d) | | %s | %s | %s | %s | %s | %s | %s | %s |", n, rounds,
						f(median(L[1]), vf), f(median(L[2]), vf), f(median(L[3]), vf),
						f(median(L[4]), "%.3f"), f(median(L[5]), "%.3f"), f(median(L[6]), "%.3f"),
						f(median(L[7]), "%.2f"), f(median(L[8]), "%.2f"))
					for (c = 9; c <= 15; c += 2)
						row = row " " (L[c] == "" ? "-" : n1(median(L[c])) " / " n1(median(L[c + 1]))) " |"
					print row
				}
				if (2 * n < rounds) {
					printf "\nonly %d of %d rounds measured all three %s figures\n", n, rounds, nm
					bad = 1
				}
			}
			exit bad
		}' "$AB_RAW"
}

# ab_servers: the two rdma-perf servers' CPU time and threads after the rounds, as markdown.
ab_servers() {
	local s pid st f hz
	hz=$(getconf CLK_TCK)
	echo ""
	echo "rdma-perf servers after the rounds (CPU: utime + stime from /proc/PID/stat, since the server started):"
	echo ""
	for s in new alt; do
		pid=${AB_SPID[$s]}
		if ! st=$(cat "/proc/$pid/stat" 2>/dev/null); then
			echo "- $s: pid $pid exited (its log: results/rdma-perf-ab-server-$s.log)"
			continue
		fi
		st=${st##*) } # past "pid (comm) ": state is field 0, utime 11, stime 12, num_threads 17
		read -r -a f <<<"$st"
		awk -v s="$s" -v pid="$pid" -v cpu="$((f[11] + f[12]))" -v thr="${f[17]}" -v hz="$hz" \
			'BEGIN { printf "- %s: pid %s, CPU %.1f s, %d threads\n", s, pid, cpu / hz, thr }'
	done
}
