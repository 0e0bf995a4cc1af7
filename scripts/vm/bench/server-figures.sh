# shellcheck shell=bash
# Server figures: fio through the kernel's rnbd-client against three servers, side by side in
# one run, over rxe (two paths), each server exporting its own loop device over a 256M file in
# the guest's tmpfs (the kernel's server gives rw to one session per device):
#   kk   the kernel's rnbd-server, port 1234 (the kernel's fixed default)          (loop A)
#   ko   rtrs-serverd from this tree, -provider verbs, port 1235, -dev-search-path /dev (loop B)
#   alt  a second rtrs-serverd, port 1236                                          (loop C): by
#        default the same binary and flags as ko (the noise floor); for an A/B of a change,
#        FIG_ALT_REV=<git revision> builds it from that revision instead, FIG_ALT_ENV adds
#        environment (NAME=value words, e.g. GOMAXPROCS=1) and FIG_ALT_FLAGS adds flags
#        (e.g. "-zero-copy-read-min off"; default none).
# The client side is the same kernel module for all three: what differs is the server. Both of
# our daemons run from start to end (own -mount, -rnbd-mount and -names-file each) rather than
# being restarted between rounds, so every round measures the three under the same conditions.
# Workloads (fio libaio direct=1 size=200m on /dev/rnbdX, FIG_SECS each): rr 4 KiB randread
# QD32, rw 4 KiB randwrite QD32, sr 1 MiB read QD8, sw 1 MiB write QD8 (FIG_JOBS, default all
# four); FIG_ROUNDS rounds, each workload run on every target in turn, the targets' order
# reversed every other round. Per job: IOPS and MB/s (fio's terse v3) and the guest's CPU per
# IO: busy jiffies of /proc/stat's first line (all but idle and iowait) read by fio's
# exec_prerun and exec_postrun, right before the job's IO and right after it, per IO done
# (client and server alike: the whole guest; fio's own start is left out). Medians over the
# rounds (the mean of the middle two for an even count), and ratios ko/kk and alt/ko:
# results/server-figures.md (printed too), ending with each of our daemons' RSS, peak RSS,
# threads and CPU time after the rounds (/proc/PID/status and stat; the kernel's server is no
# process: its modules' sizes instead); each job's line in results/server-figures-raw.txt, the
# daemons' logs in results/server-figures-serverd{,-alt}.log. A failing fio job fails the
# suite; no speed is asserted.
#
# Run (root): FIG_SECS=10 FIG_ROUNDS=5 scripts/vmtest.sh -k 6.12 scripts/vm/bench/server-figures.sh
# (the defaults; the guest reads them from a file host() writes, since vmtest.sh passes no other
# environment to the guest). An A/B of this tree against the last commit, 4 KiB only:
# FIG_ALT_REV=HEAD FIG_JOBS="rr rw" scripts/vmtest.sh -k 6.12 scripts/vm/bench/server-figures.sh
# Add RTRS_VM_RESULTS=DIR to keep results/ (the work folder is removed after a run that
# passed). Needs nothing beyond the kernel's RTRS/RNBD (built by the host part): runs on 6.1,
# 6.12 and 7.2 (validated on 6.12 only). A round takes about 3 × FIG_SECS per workload + 10–30 s
# in the guest here (one fio process a round; its start is slow under TCG), plus about a minute
# of setup: the defaults took 754 s in the guest, FIG_JOBS="rr rw" 446 s (2026-11-25), within
# RTRS_VM_TIMEOUT's default 2400 s. With the same build in both slots (FIG_ALT_REV=HEAD on a
# clean tree) ko and alt came within 2 % of each other at the defaults, IOPS and CPU alike (one
# run, 2026-11-25): a change must show more than that, or be measured again with the builds
# swapped.

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev fio util-linux"

host() {
	local secs=${FIG_SECS:-10} rounds=${FIG_ROUNDS:-5} jobs=${FIG_JOBS:-rr rw sr sw} j seen=" "
	local rev=${FIG_ALT_REV:-} env=${FIG_ALT_ENV:-} flags=${FIG_ALT_FLAGS:-} short=
	# Every input is checked before anything is built.
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
	} >"$RTRS_VM_WORK/server-figures.env"
	vm_log "server figures: $rounds rounds of $jobs on three servers, $secs s each; alt: ${desc:-the same binary and flags}"
	vm_build_kernel_rtrs
	mkdir -p "$RTRS_VM_WORK/bin" "$RTRS_VM_WORK/alt"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-serverd)
	if [ -z "$rev" ]; then
		cp "$RTRS_VM_WORK/bin/rtrs-serverd" "$RTRS_VM_WORK/alt/"
		return
	fi
	local src=$RTRS_VM_WORK/alt-src
	mkdir -p "$src"
	git -C "$RTRS_VM_REPO" archive "$rev" | tar -x -C "$src" || vm_die "FIG_ALT_REV=$rev: git archive failed"
	(cd "$src" && go build -tags verbs -o "$RTRS_VM_WORK/alt/" ./cmd/rtrs-serverd)
	rm -rf "$src"
}

# The targets in their first-round order, and the port each one's server listens on.
FIG_TARGETS=(kk ko alt)
declare -A FIG_PORT=([kk]=1234 [ko]=1235 [alt]=1236)

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local R=$RTRS_VM_WORK/results T=/tmp/fig A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2
	local FIG_SECS FIG_ROUNDS FIG_JOBS FIG_ALT_ENV FIG_ALT_FLAGS FIG_ALT_DESC
	# shellcheck source=/dev/null # written by host()
	. "$RTRS_VM_WORK/server-figures.env"
	# shellcheck disable=SC2206 # words checked by host()
	FIG_WORKLOADS=($FIG_JOBS)
	FIG_HZ=$(getconf CLK_TCK)
	mkdir -p "$R" "$T"/srv "$T"/rnbd "$T"/srv1 "$T"/rnbd1
	FIG_RAW=$R/server-figures-raw.txt
	echo "# round target workload iops MBps cpu_us_per_io busy_jiffies ios runtime_ms (CLK_TCK $FIG_HZ, $FIG_SECS s per job)" >"$FIG_RAW"
	# fio's exec_prerun/exec_postrun: /proc/stat's first line into the file named (sh builtins
	# only, so the postrun's own cost is a shell's start).
	# shellcheck disable=SC2016 # expanded by the script
	printf '%s\n' '#!/bin/sh' 'read -r l </proc/stat && echo "$l" >"$1"' >/tmp/fig-stat
	chmod +x /tmp/fig-stat

	echo "== three loop devices over 256M files in tmpfs, the first 200M random data (written with direct IO)"
	truncate -s 256M "$T"/disk-a "$T"/disk-b "$T"/disk-c
	local la lb lc t0 t
	la=$(losetup -f --show "$T"/disk-a)
	lb=$(losetup -f --show "$T"/disk-b)
	lc=$(losetup -f --show "$T"/disk-c)
	t0=$(vm_now)
	dd if=/dev/urandom of="$la" bs=1M count=200 oflag=direct status=none
	dd if="$la" of="$lb" bs=1M count=200 iflag=direct oflag=direct status=none
	dd if="$la" of="$lc" bs=1M count=200 iflag=direct oflag=direct status=none
	echo "kk on $la, ko on $lb, alt on $lc (filled in $(vm_since "$t0") s)"

	vm_load_kernel_rtrs rtrs-core rtrs-server rnbd-server rtrs-client rnbd-client

	echo "== our servers: ko (rtrs-serverd, port ${FIG_PORT[ko]}) and alt (port ${FIG_PORT[alt]}: ${FIG_ALT_DESC:-as ko})"
	FIG_LOGS="$R/server-figures-serverd.log $R/server-figures-serverd-alt.log"
	rtrs-serverd -provider verbs -config /dev/null -listen "$A1:${FIG_PORT[ko]}" -dev-search-path /dev \
		-mount "$T"/srv -rnbd-mount "$T"/rnbd -names-file "$T"/names.json \
		>"$R"/server-figures-serverd.log 2>&1 &
	FIG_PID[ko]=$!
	# (env execs the daemon: $! is its pid.)
	# shellcheck disable=SC2086 # words checked by host()
	env $FIG_ALT_ENV "$RTRS_VM_WORK"/alt/rtrs-serverd -provider verbs -config /dev/null \
		-listen "$A1:${FIG_PORT[alt]}" -dev-search-path /dev -mount "$T"/srv1 -rnbd-mount "$T"/rnbd1 \
		-names-file "$T"/names1.json $FIG_ALT_FLAGS >"$R"/server-figures-serverd-alt.log 2>&1 &
	FIG_PID[alt]=$!
	vm_wait 30 mountpoint -q "$T"/srv || { fig_logs; return 1; }
	vm_wait 30 mountpoint -q "$T"/srv1 || { fig_logs; return 1; }
	local cmd
	for t in ko alt; do
		cmd=$(tr '\0' ' ' <"/proc/${FIG_PID[$t]}/cmdline")
		echo "$t: pid ${FIG_PID[$t]}: ${cmd% }"
	done
	[ -z "$FIG_ALT_ENV" ] || echo "alt's extra environment: $FIG_ALT_ENV"

	echo "== the kernel's rnbd-client maps one device from each server"
	fig_map kk "$la" "$la"
	fig_map ko "$lb" "${lb#/dev/}"
	fig_map alt "$lc" "${lc#/dev/}"
	local sb
	for t in "${FIG_TARGETS[@]}"; do
		sb=/sys/block/${FIG_DEV[$t]#/dev/}
		echo "$t: ${FIG_DEV[$t]}, $(($(cat "$sb"/size) / 2048)) MiB, $(find "$sb"/mq -mindepth 1 -maxdepth 1 | wc -l) hardware queues"
	done
	FIG_LABEL[kk]="kernel rnbd-server :${FIG_PORT[kk]} (${FIG_DEV[kk]}, $la)"
	FIG_LABEL[ko]="rtrs-serverd :${FIG_PORT[ko]} (${FIG_DEV[ko]}, $lb)"
	FIG_LABEL[alt]="alt: rtrs-serverd :${FIG_PORT[alt]}, ${FIG_ALT_DESC:-as ko} (${FIG_DEV[alt]}, $lc)"

	local round order
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

	{
		fig_table
		fig_daemons
	} | tee "$R"/server-figures.md
	echo "(raw lines: results/server-figures-raw.txt)"
	cat "$FIG_RAW"

	echo "== unmapping"
	for t in "${FIG_TARGETS[@]}"; do
		echo normal >"/sys/block/${FIG_DEV[$t]#/dev/}/rnbd/unmap_device"
		vm_wait 10 test ! -e "${FIG_DEV[$t]}"
	done
	kill "${FIG_PID[ko]}" "${FIG_PID[alt]}"
	wait "${FIG_PID[ko]}" "${FIG_PID[alt]}"
	losetup -d "$la" "$lb" "$lc"
	rm -f "$T"/disk-a "$T"/disk-b "$T"/disk-c
}

declare -A FIG_DEV=() FIG_LABEL=() FIG_PID=()

# fig_map TARGET LOOP DEVICE_PATH: the kernel's rnbd-client maps DEVICE_PATH (LOOP as the
# target's server names it) from the target's server over both paths, session fig-TARGET;
# sets FIG_DEV[TARGET] to its /dev/rnbdX.
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
		-v lkk="${FIG_LABEL[kk]}" -v lko="${FIG_LABEL[ko]}" -v lalt="${FIG_LABEL[alt]}" '
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
			nt = split("kk ko alt", T, " ")
			nw = split("rr rw sr sw", W, " ")
			L["kk"] = lkk; L["ko"] = lko; L["alt"] = lalt
			WL["rr"] = "4 KiB randread QD32"; WL["rw"] = "4 KiB randwrite QD32"
			WL["sr"] = "1 MiB read QD8"; WL["sw"] = "1 MiB write QD8"
			printf "## server figures: kernel %s, 2 vCPUs (qemu TCG), rxe, two paths, the kernel'"'"'s rnbd-client\n\n", kernel
			printf "fio libaio direct=1 size=200m on /dev/rnbdX, %s s per job, medians of %s rounds (the targets'"'"' order reversed every other round), each server on its own loop device over tmpfs. CPU: the whole guest'"'"'s busy time (/proc/stat: all but idle and iowait, CLK_TCK %s; client and server alike) from fio'"'"'s exec_prerun to its exec_postrun (the job'"'"'s IO, not fio'"'"'s start), per IO.\n\n", secs, rounds, hz
			print "| workload | server | IOPS | MB/s | CPU µs/IO | rounds |"
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
			print "| workload | IOPS ours/kernel (ko/kk) | IOPS alt/ours (alt/ko) | CPU/IO ours/kernel (ko/kk) | CPU/IO alt/ours (alt/ko) |"
			print "|---|---|---|---|---|"
			for (i = 1; i <= nw; i++) {
				kk = "kk" SUBSEP W[i]; ko = "ko" SUBSEP W[i]; alt = "alt" SUBSEP W[i]
				if (!n[ko]) continue
				printf "| %s | %s | %s | %s | %s |\n", WL[W[i]], ratio(MI[ko], MI[kk]), ratio(MI[alt], MI[ko]),
					ratio(MC[ko], MC[kk]), ratio(MC[alt], MC[ko])
			}
		}' "$FIG_RAW"
}

# fig_daemons: our two server daemons' memory, threads and CPU time after the rounds, and the
# kernel server's module sizes, as markdown.
fig_daemons() {
	local t pid st f
	echo ""
	echo "Server daemons after the rounds (/proc/PID/status: VmRSS, VmHWM its peak, Threads; CPU: utime + stime from /proc/PID/stat, since the daemon started):"
	echo ""
	echo "| server | pid | RSS MiB | peak RSS MiB | threads | CPU s |"
	echo "|---|---|---|---|---|---|"
	for t in ko alt; do
		pid=${FIG_PID[$t]}
		if ! st=$(cat "/proc/$pid/stat" 2>/dev/null); then
			echo "| ${FIG_LABEL[$t]} | $pid | exited | | | |"
			continue
		fi
		st=${st##*) } # past "pid (comm) ": state is field 0, utime 11, stime 12
		read -r -a f <<<"$st"
		awk -v l="${FIG_LABEL[$t]}" -v pid="$pid" -v cpu="$((f[11] + f[12]))" -v hz="$FIG_HZ" '
			$1 == "VmRSS:" { rss = $2 } $1 == "VmHWM:" { hwm = $2 } $1 == "Threads:" { thr = $2 }
			END { printf "| %s | %s | %.1f | %.1f | %d | %.1f |\n", l, pid, rss / 1024, hwm / 1024, thr, cpu / hz }' \
			"/proc/$pid/status"
	done
	echo ""
	awk '$1 == "rtrs_server" || $1 == "rnbd_server" { s = s sprintf("%s%s %.0f KiB", s == "" ? "" : ", ", $1, $2 / 1024) }
		END { printf "The kernel'"'"'s server (kk) is no process: its modules %s (/proc/modules); its work runs in kernel threads and softirqs.\n", s }' \
		/proc/modules
}
