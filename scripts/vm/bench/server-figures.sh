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

# shellcheck source-path=SCRIPTDIR source=figlib.sh
. "$RTRS_VM_REPO/scripts/vm/bench/figlib.sh"

host() {
	fig_host server-figures rtrs-serverd ""
}

# The targets in their first-round order, and the port each one's server listens on.
FIG_TARGETS=(kk ko alt)
declare -A FIG_PORT=([kk]=1234 [ko]=1235 [alt]=1236)

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local R=$RTRS_VM_WORK/results T=/tmp/fig A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2
	local FIG_SECS FIG_ROUNDS FIG_JOBS FIG_ALT_ENV FIG_ALT_FLAGS FIG_ALT_DESC
	fig_guest_init server-figures
	mkdir -p "$T"/srv "$T"/rnbd "$T"/srv1 "$T"/rnbd1

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

	fig_rounds

	{
		fig_table "server figures: kernel $(uname -r), 2 vCPUs (qemu TCG), rxe, two paths, the kernel's rnbd-client" \
			"fio libaio direct=1 size=200m on /dev/rnbdX, $FIG_SECS s per job, medians of $FIG_ROUNDS rounds (the targets' order reversed every other round), each server on its own loop device over tmpfs. CPU: the whole guest's busy time (/proc/stat: all but idle and iowait, CLK_TCK $FIG_HZ; client and server alike) from fio's exec_prerun to its exec_postrun (the job's IO, not fio's start), per IO." \
			"IOPS_ours/kernel_(ko/kk):ko/kk IOPS_alt/ours_(alt/ko):alt/ko CPU/IO_ours/kernel_(ko/kk):ko/kk CPU/IO_alt/ours_(alt/ko):alt/ko"
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

declare -A FIG_PID=()


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
