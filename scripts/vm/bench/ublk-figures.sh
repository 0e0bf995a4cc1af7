# shellcheck shell=bash
# ublk figures: fio through four front ends, side by side in one run, all against the kernel's
# rnbd-server over rxe (two paths), each on a loop device over a 256M file in the guest's tmpfs:
#   kc     the kernel's rnbd-client, /dev/rnbdX                              (loop A)
#   ublk   rtrs-clientd, /dev/ublkbN, -ublk-queues cpus (the default: 2 here) (loop B)
#   nbd    the same mapping of that rtrs-clientd, attached to /dev/nbdN too   (loop B)
#   alt    a second rtrs-clientd, /dev/ublkbM                                 (loop C): by
#          default started with -ublk-queues 1 (in this VM CPUs = paths = 2, so ublk against
#          alt is "a queue per CPU or per path" against one queue); for an A/B of a change,
#          FIG_ALT_REV=<git revision> builds it from that revision instead, FIG_ALT_ENV adds
#          environment (NAME=value words, e.g. GOMAXPROCS=1) and FIG_ALT_FLAGS replaces its
#          extra flags (default "-ublk-queues 1" when neither of the other two is set, none
#          otherwise).
# The kernel's server gives rw to one session per device, hence three loop devices; alt's
# daemon runs beside the first from start to end rather than being restarted between rounds,
# so every round measures all four under the same conditions.
# Workloads (fio libaio direct=1 size=200m, FIG_SECS each): rr 4 KiB randread QD32, rw 4 KiB
# randwrite QD32, sr 1 MiB read QD8, sw 1 MiB write QD8 (FIG_JOBS, default all four);
# FIG_ROUNDS rounds, each workload run on every target in turn, the targets' order reversed
# every other round. Per job: IOPS and MB/s (fio's terse v3)
# and the guest's CPU per IO: busy jiffies of /proc/stat's first line (all but idle and iowait)
# read by fio's exec_prerun and exec_postrun, right before the job's IO and right after it, per
# IO done (fio's own start, which under TCG over 9p costs seconds of CPU, is left out).
# Medians over the rounds (the mean of the middle two for an even count), and ratios ublk/kc,
# ublk/nbd, alt/ublk: results/ublk-figures.md (printed too); each job's line in
# results/ublk-figures-raw.txt. A failing fio job fails the suite; no speed is asserted.
#
# Run (root): FIG_SECS=10 FIG_ROUNDS=5 scripts/vmtest.sh -k 6.12 scripts/vm/bench/ublk-figures.sh
# (the defaults; the guest reads them from a file host() writes, since vmtest.sh passes no other
# environment to the guest). An A/B of this tree against the last commit, 4 KiB only:
# FIG_ALT_REV=HEAD FIG_JOBS="rr rw" scripts/vmtest.sh -k 6.12 scripts/vm/bench/ublk-figures.sh
# Needs ublk_drv: fails at once on 6.1. Add RTRS_VM_RESULTS=DIR to keep results/ (the work
# folder is removed after a run that passed). A round takes about 4 × FIG_SECS per workload +
# 45–60 s in the guest here (one fio process a round; its start is slow under TCG), so the
# defaults need about 20 minutes, within RTRS_VM_TIMEOUT's default 2400 s. With one binary in
# both slots the two ran up to 4 % apart (2026-11-25): a change must show more than that, or be
# measured again with the two builds swapped.

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev fio util-linux"

host() {
	local secs=${FIG_SECS:-10} rounds=${FIG_ROUNDS:-5} jobs=${FIG_JOBS:-rr rw sr sw} j
	local rev=${FIG_ALT_REV:-} env=${FIG_ALT_ENV:-} flags
	[[ $secs =~ ^[1-9][0-9]*$ ]] || vm_die "FIG_SECS=$secs: a whole number of seconds, at least 1"
	[[ $rounds =~ ^[1-9][0-9]*$ ]] || vm_die "FIG_ROUNDS=$rounds: a whole number, at least 1"
	for j in $jobs; do
		fig_workload "$j" >/dev/null || vm_die "FIG_JOBS: $j is none of rr rw sr sw"
	done
	[ -n "${jobs// /}" ] || vm_die "FIG_JOBS: no workload"
	[[ $env =~ ^([A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.,:/=-]*( |$))*$ ]] ||
		vm_die "FIG_ALT_ENV=$env: NAME=value words (letters, digits and _.,:/=- in the values)"
	if [ -z "$rev$env" ]; then
		flags=${FIG_ALT_FLAGS--ublk-queues 1}
	else
		flags=${FIG_ALT_FLAGS:-}
	fi
	[[ $flags =~ ^[A-Za-z0-9_.,:/=\ -]*$ ]] || vm_die "FIG_ALT_FLAGS=$flags: flags without quotes or shell characters"
	local desc="${rev:+built from $rev }${env:+$env }$flags"
	desc=${desc% }
	{
		printf 'FIG_SECS=%s\nFIG_ROUNDS=%s\n' "$secs" "$rounds"
		printf 'FIG_JOBS=%q\nFIG_ALT_ENV=%q\nFIG_ALT_FLAGS=%q\n' "$jobs" "$env" "$flags"
		printf 'FIG_ALT_DESC=%q\n' "$desc"
	} >"$RTRS_VM_WORK/ublk-figures.env"
	vm_log "ublk figures: $rounds rounds of $jobs on four targets, $secs s each; alt: ${desc:-the same binary and flags}"
	vm_build_kernel_rtrs
	mkdir -p "$RTRS_VM_WORK/bin" "$RTRS_VM_WORK/alt"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-clientd)
	if [ -z "$rev" ]; then
		cp "$RTRS_VM_WORK/bin/rtrs-clientd" "$RTRS_VM_WORK/alt/"
		return
	fi
	local src=$RTRS_VM_WORK/alt-src
	mkdir -p "$src"
	git -C "$RTRS_VM_REPO" archive "$rev" | tar -x -C "$src" || vm_die "FIG_ALT_REV=$rev: no such revision"
	(cd "$src" && go build -tags verbs -o "$RTRS_VM_WORK/alt/" ./cmd/rtrs-clientd)
	rm -rf "$src"
}

# The targets in their first-round order.
FIG_TARGETS=(kc ublk nbd alt)

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local R=$RTRS_VM_WORK/results T=/tmp/fig A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2
	local FIG_SECS FIG_ROUNDS FIG_JOBS FIG_ALT_ENV FIG_ALT_FLAGS FIG_ALT_DESC
	# shellcheck source=/dev/null # written by host()
	. "$RTRS_VM_WORK/ublk-figures.env"
	# shellcheck disable=SC2206 # words checked by host()
	FIG_WORKLOADS=($FIG_JOBS)
	if [ ! -e /dev/ublk-control ]; then
		echo "no ublk driver on $(uname -r) (/dev/ublk-control): these figures need 6.12 or later"
		return 1
	fi
	FIG_HZ=$(getconf CLK_TCK)
	mkdir -p "$R" "$T"/cli "$T"/dev "$T"/cli1 "$T"/dev1
	FIG_RAW=$R/ublk-figures-raw.txt
	echo "# round target workload iops MBps cpu_us_per_io busy_jiffies ios runtime_ms (CLK_TCK $FIG_HZ, $FIG_SECS s per job)" >"$FIG_RAW"
	# fio's exec_prerun/exec_postrun: /proc/stat's first line into the file named (sh builtins
	# only, so the postrun's own cost is a shell's start).
	# shellcheck disable=SC2016 # expanded by the script
	printf '%s\n' '#!/bin/sh' 'read -r l </proc/stat && echo "$l" >"$1"' >/tmp/fig-stat
	chmod +x /tmp/fig-stat

	echo "== three loop devices over 256M files, the first 200M random data"
	dd if=/dev/urandom of="$T"/disk-a bs=1M count=200 status=none
	cp "$T"/disk-a "$T"/disk-b
	cp "$T"/disk-a "$T"/disk-c
	truncate -s 256M "$T"/disk-a "$T"/disk-b "$T"/disk-c
	local la lb lc
	la=$(losetup -f --show "$T"/disk-a)
	lb=$(losetup -f --show "$T"/disk-b)
	lc=$(losetup -f --show "$T"/disk-c)
	echo "kc on $la, ublk and nbd on $lb, alt on $lc"

	vm_load_kernel_rtrs rtrs-core rtrs-server rnbd-server rtrs-client rnbd-client

	echo "== kc: the kernel's rnbd-client"
	echo "sessname=kc device_path=$la path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1" >/sys/class/rnbd-client/ctl/map_device
	vm_wait 20 fig_rnbd_of kc "$la"
	FIG_DEV[kc]=$(fig_rnbd_of kc "$la")
	vm_wait 10 test -b "${FIG_DEV[kc]}"

	echo "== rtrs-clientd (-ublk-queues cpus) and a second one, alt: ${FIG_ALT_DESC:-as the first}"
	: >"$T"/clientd.conf
	: >"$T"/clientd1.conf
	FIG_LOGS="$R/ublk-figures-clientd.log $R/ublk-figures-clientd-alt.log"
	rtrs-clientd -provider verbs -config "$T"/clientd.conf -mount "$T"/cli -dev-mount "$T"/dev \
		-nbd-socket "" -io-timeout 120s -reconnect-delay 2s >"$R"/ublk-figures-clientd.log 2>&1 &
	local cpid=$!
	# shellcheck disable=SC2086 # words checked by host()
	env $FIG_ALT_ENV "$RTRS_VM_WORK"/alt/rtrs-clientd -provider verbs -config "$T"/clientd1.conf -mount "$T"/cli1 \
		-dev-mount "$T"/dev1 -nbd-socket "" -io-timeout 120s -reconnect-delay 2s $FIG_ALT_FLAGS \
		>"$R"/ublk-figures-clientd-alt.log 2>&1 &
	local cpid1=$!
	vm_wait 30 mountpoint -q "$T"/dev || { fig_logs; return 1; }
	vm_wait 30 mountpoint -q "$T"/dev1 || { fig_logs; return 1; }
	echo "sessname=uk device_path=$lb path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1 ublk=auto nbd=auto" >"$T"/dev/ctl/map_device
	echo "sessname=uq1 device_path=$lc path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1 ublk=auto" >"$T"/dev1/ctl/map_device
	FIG_DEV[ublk]=$(awk '$1 ~ /^uk\// { print $2 }' "$T"/dev/ctl/ublk_devices)
	FIG_DEV[nbd]=$(awk '$1 ~ /^uk\// { print $2 }' "$T"/dev/ctl/nbd_devices)
	FIG_DEV[alt]=$(awk '$1 ~ /^uq1\// { print $2 }' "$T"/dev1/ctl/ublk_devices)
	local t
	for t in "${FIG_TARGETS[@]}"; do
		if [ -z "${FIG_DEV[$t]}" ] || [ ! -b "${FIG_DEV[$t]}" ]; then
			echo "$t: no block device (${FIG_DEV[$t]:-none})"
			cat "$T"/dev/ctl/ublk_devices "$T"/dev/ctl/nbd_devices "$T"/dev1/ctl/ublk_devices
			fig_logs
			return 1
		fi
	done
	local sb
	for t in "${FIG_TARGETS[@]}"; do
		sb=/sys/block/${FIG_DEV[$t]#/dev/}
		FIG_QUEUES[$t]=$(find "$sb"/mq -mindepth 1 -maxdepth 1 | wc -l)
		echo "$t: ${FIG_DEV[$t]}, $(($(cat "$sb"/size) / 2048)) MiB, ${FIG_QUEUES[$t]} hardware queues"
	done
	FIG_LABEL[kc]="kernel rnbd-client (${FIG_DEV[kc]})"
	FIG_LABEL[ublk]="rtrs-clientd ublk, ${FIG_QUEUES[ublk]} queues (${FIG_DEV[ublk]})"
	FIG_LABEL[nbd]="rtrs-clientd NBD (${FIG_DEV[nbd]})"
	FIG_LABEL[alt]="alt: rtrs-clientd ublk, ${FIG_QUEUES[alt]} queues, ${FIG_ALT_DESC:-as the first} (${FIG_DEV[alt]})"

	local round order t0
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

	fig_table | tee "$R"/ublk-figures.md
	echo "(raw lines: results/ublk-figures-raw.txt)"
	cat "$FIG_RAW"

	echo "== unmapping"
	echo "sessname=uk device_path=$lb" >"$T"/dev/ctl/unmap_device
	echo "sessname=uq1 device_path=$lc" >"$T"/dev1/ctl/unmap_device
	kill "$cpid" "$cpid1"
	wait "$cpid" "$cpid1"
	echo normal >"/sys/block/${FIG_DEV[kc]#/dev/}/rnbd/unmap_device"
	vm_wait 10 test ! -e "${FIG_DEV[kc]}"
	losetup -d "$la" "$lb" "$lc"
	rm -f "$T"/disk-a "$T"/disk-b "$T"/disk-c
}

declare -A FIG_DEV=() FIG_QUEUES=() FIG_LABEL=()

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

# fig_logs: the end of both daemons' logs.
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
	local _cpu u n s i w q sq st _rest
	[ -f "$1" ] || return 1
	read -r _cpu u n s i w q sq st _rest <"$1" || return 1
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

# fig_table: the medians of the raw lines per target and workload, and the ratios, as markdown.
fig_table() {
	local kernel
	kernel=$(uname -r)
	awk -v kernel="$kernel" -v secs="$FIG_SECS" -v rounds="$FIG_ROUNDS" -v hz="$FIG_HZ" \
		-v lkc="${FIG_LABEL[kc]}" -v lublk="${FIG_LABEL[ublk]}" -v lnbd="${FIG_LABEL[nbd]}" \
		-v lalt="${FIG_LABEL[alt]}" '
		function median(s,   a, n, i, j, x) {
			n = split(s, a, " ")
			for (i = 2; i <= n; i++) {
				x = a[i] + 0
				for (j = i - 1; j >= 1 && a[j] + 0 > x; j--) a[j + 1] = a[j]
				a[j + 1] = x
			}
			if (n % 2) return a[(n + 1) / 2] + 0
			return (a[n / 2] + a[n / 2 + 1]) / 2
		}
		function ratio(a, b) { return b > 0 ? sprintf("%.2f", a / b) : "n/a" }
		/^#/ { next }
		{ k = $2 SUBSEP $3; iops[k] = iops[k] " " $4; mbs[k] = mbs[k] " " $5; cpu[k] = cpu[k] " " $6; n[k]++ }
		END {
			nt = split("kc ublk nbd alt", T, " ")
			nw = split("rr rw sr sw", W, " ")
			L["kc"] = lkc; L["ublk"] = lublk; L["nbd"] = lnbd; L["alt"] = lalt
			WL["rr"] = "4 KiB randread QD32"; WL["rw"] = "4 KiB randwrite QD32"
			WL["sr"] = "1 MiB read QD8"; WL["sw"] = "1 MiB write QD8"
			printf "## ublk figures: kernel %s, 2 vCPUs (qemu TCG), rxe, two paths, the kernel'"'"'s rnbd-server\n\n", kernel
			printf "fio libaio direct=1 size=200m, %s s per job, medians of %s rounds (the targets'"'"' order reversed every other round), on loop devices over tmpfs. CPU: the whole guest'"'"'s busy time (/proc/stat: all but idle and iowait, CLK_TCK %s) from fio'"'"'s exec_prerun to its exec_postrun (the job'"'"'s IO, not fio'"'"'s start), per IO.\n\n", secs, rounds, hz
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
			print "| workload | IOPS ublk/kernel client | IOPS ublk/NBD | IOPS alt/ublk | CPU/IO ublk/kernel client | CPU/IO ublk/NBD | CPU/IO alt/ublk |"
			print "|---|---|---|---|---|---|---|"
			for (i = 1; i <= nw; i++) {
				u = "ublk" SUBSEP W[i]; kc = "kc" SUBSEP W[i]; nb = "nbd" SUBSEP W[i]; u1 = "alt" SUBSEP W[i]
				if (!n[u]) continue
				printf "| %s | %s | %s | %s | %s | %s | %s |\n", WL[W[i]], ratio(MI[u], MI[kc]), ratio(MI[u], MI[nb]),
					ratio(MI[u1], MI[u]), ratio(MC[u], MC[kc]), ratio(MC[u], MC[nb]), ratio(MC[u1], MC[u])
			}
		}' "$FIG_RAW"
}
