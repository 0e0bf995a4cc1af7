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
#          otherwise); FIG_ALT_FRONT=nbd attaches alt's mapping to /dev/nbdM instead (nbd=auto),
#          for an A/B of the NBD path: the table's alt ratios are then over nbd.
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

# shellcheck source-path=SCRIPTDIR source=figlib.sh
. "$RTRS_VM_REPO/scripts/vm/bench/figlib.sh"

host() {
	case ${FIG_ALT_FRONT:-ublk} in
	ublk | nbd) ;;
	*) vm_die "FIG_ALT_FRONT=$FIG_ALT_FRONT: ublk or nbd" ;;
	esac
	fig_host ublk-figures rtrs-clientd "-ublk-queues 1"
	printf 'FIG_ALT_FRONT=%s\n' "${FIG_ALT_FRONT:-ublk}" >>"$RTRS_VM_WORK/ublk-figures.env"
}

# The targets in their first-round order.
FIG_TARGETS=(kc ublk nbd alt)

guest() {
	export PATH=$RTRS_VM_WORK/bin:$PATH
	local R=$RTRS_VM_WORK/results T=/tmp/fig A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2
	local FIG_SECS FIG_ROUNDS FIG_JOBS FIG_ALT_ENV FIG_ALT_FLAGS FIG_ALT_DESC FIG_ALT_FRONT
	fig_guest_init ublk-figures
	if [ ! -e /dev/ublk-control ]; then
		echo "no ublk driver on $(uname -r) (/dev/ublk-control): these figures need 6.12 or later"
		return 1
	fi
	mkdir -p "$T"/cli "$T"/dev "$T"/cli1 "$T"/dev1

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
	echo "sessname=uq1 device_path=$lc path=ip:$A1@ip:$A1 path=ip:$A2@ip:$A1 $FIG_ALT_FRONT=auto" >"$T"/dev1/ctl/map_device
	FIG_DEV[ublk]=$(awk '$1 ~ /^uk\// { print $2 }' "$T"/dev/ctl/ublk_devices)
	FIG_DEV[nbd]=$(awk '$1 ~ /^uk\// { print $2 }' "$T"/dev/ctl/nbd_devices)
	FIG_DEV[alt]=$(awk '$1 ~ /^uq1\// { print $2 }' "$T"/dev1/ctl/"$FIG_ALT_FRONT"_devices)
	local t
	for t in "${FIG_TARGETS[@]}"; do
		if [ -z "${FIG_DEV[$t]}" ] || [ ! -b "${FIG_DEV[$t]}" ]; then
			echo "$t: no block device (${FIG_DEV[$t]:-none})"
			cat "$T"/dev/ctl/ublk_devices "$T"/dev/ctl/nbd_devices "$T"/dev1/ctl/"$FIG_ALT_FRONT"_devices
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
	local over=ublk
	if [ "$FIG_ALT_FRONT" = nbd ]; then
		over=nbd
		FIG_LABEL[alt]="alt: rtrs-clientd NBD, ${FIG_ALT_DESC:-as the first} (${FIG_DEV[alt]})"
	else
		FIG_LABEL[alt]="alt: rtrs-clientd ublk, ${FIG_QUEUES[alt]} queues, ${FIG_ALT_DESC:-as the first} (${FIG_DEV[alt]})"
	fi

	fig_rounds

	fig_table "ublk figures: kernel $(uname -r), 2 vCPUs (qemu TCG), rxe, two paths, the kernel's rnbd-server" \
		"fio libaio direct=1 size=200m, $FIG_SECS s per job, medians of $FIG_ROUNDS rounds (the targets' order reversed every other round), on loop devices over tmpfs. CPU: the whole guest's busy time (/proc/stat: all but idle and iowait, CLK_TCK $FIG_HZ) from fio's exec_prerun to its exec_postrun (the job's IO, not fio's start), per IO." \
		"IOPS_ublk/kernel_client:ublk/kc IOPS_ublk/NBD:ublk/nbd IOPS_alt/$over:alt/$over CPU/IO_ublk/kernel_client:ublk/kc CPU/IO_ublk/NBD:ublk/nbd CPU/IO_alt/$over:alt/$over" |
		tee "$R"/ublk-figures.md
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

declare -A FIG_QUEUES=()

