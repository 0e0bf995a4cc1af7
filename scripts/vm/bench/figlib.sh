# shellcheck shell=bash
# What the figure suites (ublk-figures.sh, server-figures.sh) share: their inputs and builds on
# the host, and in the guest fio's rounds over the targets, the guest's CPU per job, the
# medians. A suite sources this file (from $RTRS_VM_REPO: the guest sees the host's root) and
# sets FIG_TARGETS (its targets in their first-round order) and, in the guest, FIG_DEV[TARGET]
# (the block device fio runs on) and FIG_LABEL[TARGET] (the name its tables give).
#
# Inputs (host environment; the guest reads them from a file fig_host writes, since vmtest.sh
# passes no other environment to the guest): FIG_SECS (seconds per job, 10), FIG_ROUNDS (5),
# FIG_JOBS (workloads, "rr rw sr sw"), and for the alt slot, a second daemon measured beside the
# first: FIG_ALT_REV (a git revision to build it from), FIG_ALT_ENV (NAME=value words),
# FIG_ALT_FLAGS (extra flags).

declare -A FIG_DEV=() FIG_LABEL=()

# FIG_AWK_MEDIAN: awk's median(s), for the tables' programs (prepended to them): the median of
# the numbers in the space-separated string s, the mean of the middle two for an even count,
# "" for none.
FIG_AWK_MEDIAN='
	function median(s,   a, n, i, j, x) {
		n = split(s, a, " ")
		if (n == 0) return ""
		for (i = 2; i <= n; i++) {
			x = a[i] + 0
			for (j = i - 1; j >= 1 && a[j] + 0 > x; j--) a[j + 1] = a[j]
			a[j + 1] = x
		}
		if (n % 2) return a[(n + 1) / 2] + 0
		return (a[n / 2] + a[n / 2 + 1]) / 2
	}'

# fig_host NAME CMD PLAIN_FLAGS: checks the inputs (before anything is built), writes them to
# $RTRS_VM_WORK/NAME.env for fig_guest_init, builds the kernel's RTRS/RNBD modules and ./cmd/CMD
# with verbs into $RTRS_VM_WORK/bin, and the alt slot's CMD into $RTRS_VM_WORK/alt (the same
# binary, or built from FIG_ALT_REV). PLAIN_FLAGS: the alt's flags when FIG_ALT_FLAGS is unset
# and neither FIG_ALT_REV nor FIG_ALT_ENV is given.
fig_host() {
	local name=$1 cmd=$2 plain=$3
	local secs=${FIG_SECS:-10} rounds=${FIG_ROUNDS:-5} jobs=${FIG_JOBS:-rr rw sr sw} j seen=" "
	local rev=${FIG_ALT_REV:-} env=${FIG_ALT_ENV:-} flags short=
	[[ $secs =~ ^[1-9][0-9]*$ ]] || vm_die "FIG_SECS=$secs: a whole number of seconds, at least 1"
	[[ $rounds =~ ^[1-9][0-9]*$ ]] || vm_die "FIG_ROUNDS=$rounds: a whole number, at least 1"
	for j in $jobs; do
		fig_workload "$j" >/dev/null || vm_die "FIG_JOBS: $j is none of rr rw sr sw"
		[[ $seen != *" $j "* ]] || vm_die "FIG_JOBS: $j twice"
		seen+="$j "
	done
	[ -n "${jobs// /}" ] || vm_die "FIG_JOBS: no workload"
	[[ $env =~ ^([A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.,:/=-]*( |$))*$ ]] ||
		vm_die "FIG_ALT_ENV=$env: NAME=value words (letters, digits and _.,:/=- in the values)"
	if [ -z "$rev$env" ]; then
		flags=${FIG_ALT_FLAGS-$plain}
	else
		flags=${FIG_ALT_FLAGS:-}
	fi
	[[ $flags =~ ^[A-Za-z0-9_.,:/=\ -]*$ ]] || vm_die "FIG_ALT_FLAGS=$flags: flags without quotes or shell characters"
	if [ -n "$rev" ]; then
		short=$(git -C "$RTRS_VM_REPO" rev-parse --verify --quiet --short "$rev^{commit}") ||
			vm_die "FIG_ALT_REV=$rev: no such revision in $RTRS_VM_REPO"
	fi
	local desc="${rev:+built from $rev ($short) }${env:+$env }$flags"
	desc=${desc% }
	{
		printf 'FIG_SECS=%s\nFIG_ROUNDS=%s\n' "$secs" "$rounds"
		printf 'FIG_JOBS=%q\nFIG_ALT_ENV=%q\nFIG_ALT_FLAGS=%q\n' "$jobs" "$env" "$flags"
		printf 'FIG_ALT_DESC=%q\n' "$desc"
	} >"$RTRS_VM_WORK/$name.env"
	vm_log "$name: $rounds rounds of $jobs on ${FIG_TARGETS[*]}, $secs s each; alt: ${desc:-the same binary and flags}"
	vm_build_kernel_rtrs
	fig_build "$cmd" "$rev"
}

# fig_build CMD [REV]: on the host, builds ./cmd/CMD (-tags verbs) from this tree into
# $RTRS_VM_WORK/bin and, from git revision REV (git archive of it), into $RTRS_VM_WORK/alt;
# without REV, alt gets a copy of the first.
fig_build() {
	local cmd=$1 rev=${2:-}
	mkdir -p "$RTRS_VM_WORK/bin" "$RTRS_VM_WORK/alt"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" "./cmd/$cmd")
	if [ -z "$rev" ]; then
		cp "$RTRS_VM_WORK/bin/$cmd" "$RTRS_VM_WORK/alt/"
		return
	fi
	local src=$RTRS_VM_WORK/alt-src
	mkdir -p "$src"
	git -C "$RTRS_VM_REPO" archive "$rev" | tar -x -C "$src" || vm_die "FIG_ALT_REV=$rev: git archive failed"
	(cd "$src" && go build -tags verbs -o "$RTRS_VM_WORK/alt/" "./cmd/$cmd")
	rm -rf "$src"
}

# fig_guest_init NAME: in the guest, reads the inputs fig_host wrote (FIG_SECS, FIG_ROUNDS,
# FIG_JOBS, FIG_ALT_ENV, FIG_ALT_FLAGS, FIG_ALT_DESC; the caller declares them local), sets
# FIG_WORKLOADS, FIG_HZ and FIG_RAW (results/NAME-raw.txt, begun with its header) and writes
# /tmp/fig-stat, fio's exec_prerun and exec_postrun: /proc/stat's first line into the file
# named (sh builtins only, so the postrun's own cost is a shell's start).
fig_guest_init() {
	# shellcheck source=/dev/null # written by fig_host
	. "$RTRS_VM_WORK/$1.env"
	# shellcheck disable=SC2206 # words checked by fig_host
	FIG_WORKLOADS=($FIG_JOBS)
	FIG_HZ=$(getconf CLK_TCK)
	mkdir -p "$RTRS_VM_WORK/results"
	FIG_RAW=$RTRS_VM_WORK/results/$1-raw.txt
	echo "# round target workload iops MBps cpu_us_per_io busy_jiffies ios runtime_ms (CLK_TCK $FIG_HZ, $FIG_SECS s per job)" >"$FIG_RAW"
	# shellcheck disable=SC2016 # expanded by the script
	printf '%s\n' '#!/bin/sh' 'read -r l </proc/stat && echo "$l" >"$1"' >/tmp/fig-stat
	chmod +x /tmp/fig-stat
}

# fig_rounds: FIG_ROUNDS rounds over FIG_TARGETS, their order reversed every other round.
fig_rounds() {
	local round order t t0
	t0=$(vm_now)
	for ((round = 1; round <= FIG_ROUNDS; round++)); do
		order=("${FIG_TARGETS[@]}")
		if ((round % 2 == 0)); then
			order=()
			for ((t = ${#FIG_TARGETS[@]} - 1; t >= 0; t--)); do order+=("${FIG_TARGETS[$t]}"); done
		fi
		echo "== round $round of $FIG_ROUNDS: ${order[*]}"
		fig_round "$round" "${order[@]}"
	done
	echo "== $FIG_ROUNDS rounds took $(vm_since "$t0") s"
}

# fig_rnbd_of SESSNAME DEVPATH: the kernel client's /dev/rnbdX mapping DEVPATH in SESSNAME.
fig_rnbd_of() {
	local d
	for d in /sys/block/rnbd*; do
		[ -f "$d"/rnbd/session ] || continue
		if [ "$(cat "$d"/rnbd/session)" = "$1" ] && [ "$(cat "$d"/rnbd/mapping_path)" = "$2" ]; then
			echo "/dev/${d##*/}"
			return 0
		fi
	done
	return 1
}

# fig_logs: the end of the daemons' logs (FIG_LOGS).
fig_logs() {
	local l
	for l in ${FIG_LOGS:-}; do
		echo "--- $l"
		tail -30 "$l"
	done
}

# fig_workload W: fio's arguments and the block size in KiB of workload W.
fig_workload() {
	case $1 in
	rr) echo "4 --rw=randread --bs=4k --iodepth=32" ;;
	rw) echo "4 --rw=randwrite --bs=4k --iodepth=32" ;;
	sr) echo "1024 --rw=read --bs=1m --iodepth=8" ;;
	sw) echo "1024 --rw=write --bs=1m --iodepth=8" ;;
	*) return 1 ;;
	esac
}

# fig_busy FILE: the busy jiffies of all CPUs in FILE, a copy of /proc/stat's first line
# ("cpu user nice system idle iowait irq softirq steal guest guest_nice"; guest time is inside
# user and nice already): all but idle and iowait.
fig_busy() {
	local _cpu u n s _idle _iowait q sq st _rest
	[ -f "$1" ] || return 1
	read -r _cpu u n s _idle _iowait q sq st _rest <"$1" || return 1
	[ -n "$st" ] || return 1
	echo "$((u + n + s + q + sq + st))"
}

# fig_round ROUND TARGET...: one fio process running every workload on every TARGET in that
# order, a job at a time (stonewall; workload by workload, the targets in turn), so that fio's
# own start (seconds of CPU under TCG: its 60-odd libraries come over 9p) is paid once a round
# and falls outside every job's CPU window. Appends a raw line per job; fails if any job does.
fig_round() {
	local round=$1 t w dev args jobs=() n out=/tmp/fio-fig.out line t0 b0 b1 rc=0
	shift
	for w in "${FIG_WORKLOADS[@]}"; do
		# shellcheck disable=SC2207 # fio's arguments, no spaces inside
		args=($(fig_workload "$w"))
		for t in "$@"; do
			n=fig-$t-$w
			rm -f "/tmp/$n.stat0" "/tmp/$n.stat1"
			jobs+=(--name="$n" --stonewall --filename="${FIG_DEV[$t]}" "${args[@]:1}"
				--exec_prerun="/tmp/fig-stat /tmp/$n.stat0" --exec_postrun="/tmp/fig-stat /tmp/$n.stat1")
		done
	done
	t0=$(vm_now)
	fio --ioengine=libaio --direct=1 --size=200m --time_based --runtime="$FIG_SECS" \
		--output-format=terse --terse-version=3 "${jobs[@]}" >"$out" 2>&1 || rc=$?
	echo "round $round: fio ran $((${#FIG_WORKLOADS[@]} * $#)) jobs in $(vm_since "$t0") s (rc $rc)"
	for w in "${FIG_WORKLOADS[@]}"; do
		# shellcheck disable=SC2207
		args=($(fig_workload "$w"))
		for t in "$@"; do
			n=fig-$t-$w dev=${FIG_DEV[$t]}
			if ! b0=$(fig_busy "/tmp/$n.stat0") || ! b1=$(fig_busy "/tmp/$n.stat1"); then
				echo "fio $w on $t ($dev): no /proc/stat line from its exec_prerun or exec_postrun"
				rc=1
				continue
			fi
			# Reads: KiB $6, KiB/s $7, IOPS $8, runtime (ms) $9; writes: KiB $47, KiB/s $48,
			# IOPS $49, runtime $50 (terse v3); $3 the job's name, $5 its error.
			line=$(awk -F';' -v n="$n" -v r="$round" -v t="$t" -v w="$w" -v bs="${args[0]}" \
				-v busy="$((b1 - b0))" -v hz="$FIG_HZ" '
				$1 == "3" && $3 == n {
					if ($5 != 0) { printf "error %s\n", $5; exit }
					kib = $6 + $47; kibs = $7 + $48; iops = $8 + $49; ios = kib / bs
					if (ios <= 0) { print "error no-io"; exit }
					printf "%s %s %s %.0f %.2f %.2f %d %.0f %d\n", r, t, w, iops, kibs * 1024 / 1e6,
						busy * (1e6 / hz) / ios, busy, ios, ($9 > $50 ? $9 : $50)
					exit
				}' "$out")
			case $line in
			"" | error*)
				echo "fio $w on $t ($dev): ${line:-no terse v3 line}"
				rc=1
				;;
			*)
				echo "$line" >>"$FIG_RAW"
				echo "round $round $t $w: $line"
				;;
			esac
		done
	done
	if [ "$rc" != 0 ]; then
		echo "round $round: fio failed (rc $rc):"
		grep -v -e '^3;' -e ': Saving output of ' "$out" | tail -30 || true
		fig_logs
		return 1
	fi
}

# fig_table TITLE INTRO RATIOS: the medians of FIG_RAW per target and workload (targets in
# FIG_TARGETS' order, named by FIG_LABEL), as markdown under the heading TITLE and the paragraph
# INTRO, then a table of ratios of the medians: RATIOS is "HEADER:A/B ..." words, one column
# each (IOPS when HEADER begins with IOPS, CPU per IO otherwise), ":" and "/" taken literally
# and "_" for a space in HEADER.
fig_table() {
	local t labels=
	for t in "${FIG_TARGETS[@]}"; do labels+="${FIG_LABEL[$t]}"$'\t'; done
	awk -v title="$1" -v intro="$2" -v ratios="$3" -v targets="${FIG_TARGETS[*]}" -v labels="$labels" "$FIG_AWK_MEDIAN"'
		function ratio(a, b) { return b > 0 ? sprintf("%.2f", a / b) : "n/a" }
		/^#/ { next }
		{ k = $2 SUBSEP $3; iops[k] = iops[k] " " $4; mbs[k] = mbs[k] " " $5; cpu[k] = cpu[k] " " $6; n[k]++ }
		END {
			nt = split(targets, T, " ")
			split(labels, LL, "\t")
			for (j = 1; j <= nt; j++) L[T[j]] = LL[j]
			nw = split("rr rw sr sw", W, " ")
			WL["rr"] = "4 KiB randread QD32"; WL["rw"] = "4 KiB randwrite QD32"
			WL["sr"] = "1 MiB read QD8"; WL["sw"] = "1 MiB write QD8"
			printf "## %s\n\n%s\n\n", title, intro
			print "| workload | target | IOPS | MB/s | CPU µs/IO | rounds |"
			print "|---|---|---|---|---|---|"
			for (i = 1; i <= nw; i++) for (j = 1; j <= nt; j++) {
				k = T[j] SUBSEP W[i]
				if (!n[k]) continue
				MI[k] = median(iops[k]); MB[k] = median(mbs[k]); MC[k] = median(cpu[k])
				printf "| %s | %s | %.0f | %.1f | %.1f | %d |\n", WL[W[i]], L[T[j]], MI[k], MB[k], MC[k], n[k]
			}
			print ""
			print "Ratios of the medians (MB/s goes as IOPS: the same block size):"
			print ""
			nr = split(ratios, R, " ")
			head = "| workload |"; rule = "|---|"
			for (c = 1; c <= nr; c++) {
				split(R[c], hp, ":"); split(hp[2], ab, "/")
				h = hp[1]; gsub("_", " ", h)
				head = head " " h " |"; rule = rule "---|"
				RA[c] = ab[1]; RB[c] = ab[2]; RI[c] = (hp[1] ~ /^IOPS/)
			}
			print head; print rule
			for (i = 1; i <= nw; i++) {
				if (!n[RA[1] SUBSEP W[i]]) continue
				row = "| " WL[W[i]] " |"
				for (c = 1; c <= nr; c++) {
					a = RA[c] SUBSEP W[i]; b = RB[c] SUBSEP W[i]
					row = row " " (RI[c] ? ratio(MI[a], MI[b]) : ratio(MC[a], MC[b])) " |"
				}
				print row
			}
		}' "$FIG_RAW"
}

# fig_map TARGET LOOP DEVICE_PATH: the kernel's rnbd-client maps DEVICE_PATH (LOOP as the
# target's server names it) from the target's server over both paths, session fig-TARGET;
# sets FIG_DEV[TARGET] to its /dev/rnbdX. The caller's FIG_PORT[TARGET] is the server's port.
fig_map() {
	local t=$1 loop=$2 dp=$3 s=fig-$1
	local line="sessname=$s dest_port=${FIG_PORT[$t]} path=ip:$RTRS_VM_ADDR1@ip:$RTRS_VM_ADDR1 path=ip:$RTRS_VM_ADDR2@ip:$RTRS_VM_ADDR1 device_path=$dp"
	echo "$t: $line"
	if ! echo "$line" >/sys/class/rnbd-client/ctl/map_device; then
		echo "$t: map_device failed ($loop)"
		dmesg | tail -20
		fig_logs
		return 1
	fi
	vm_wait 20 fig_rnbd_of "$s" "$dp" >/dev/null || { fig_logs; return 1; }
	FIG_DEV[$t]=$(fig_rnbd_of "$s" "$dp")
	vm_wait 10 test -b "${FIG_DEV[$t]}"
}
