#!/usr/bin/env bash
# The project's VM test bed: real kernel verbs (Soft-RoCE, rxe), rdma_cm and the kernel's own
# RTRS/RNBD, in a qemu VM booting Debian's kernel with the host's root shared read-only over 9p.
# See scripts/vm/README.md for how a suite is written.
#
# Usage (root, Debian 12): scripts/vmtest.sh [-k SERIES[,SERIES...]] [SUITE...]   (no suite: every suite)
#   SUITE is a name from scripts/vm/suites/NAME.sh, or a path to a suite file.
#   -k SERIES  the kernel the VM boots: 6.1 (bookworm), 6.12 (bookworm-backports) or 7.2
#              (unstable); several, comma-separated: each with the same suites (the matrix),
#              in turn or RTRS_VM_JOBS at once, then a summary line per kernel and suite. Default: RTRS_VM_KERNELS,
#              else every series (6.1,6.12,7.2).
# Environment:
#   RTRS_VM_KERNELS        the series list when there is no -k (comma- or space-separated)
#   RTRS_VM_CACHE          cache of the kernel, initramfs, built modules (/var/cache/rtrs-vmtest)
#   RTRS_VM_JOBS           with several series: how many run at once (1 by default). Only where
#                          the machine has a core per emulated CPU of every VM: two VMs of two
#                          vCPUs on two cores ran each at under a quarter of its speed alone
#                          (their vCPU threads wait on each other): slower than in turn
#   RTRS_VM_SMP            the VM's CPUs (2; one made the nbd and smoke suites 1.6x slower)
#   RTRS_VM_TIMEOUT        seconds for the whole VM run, boot to power-off (2400: the longest
#                          run, 6.1's, took 1990 s before 2026-11-27's cuts)
#   RTRS_VM_SUITE_TIMEOUT  seconds for one suite's guest part (default: the whole run's)
#   RTRS_VM_KEEP=1         keep the work folder even when everything passed
#   RTRS_VM_RESULTS        copy the guest's results/ (logs, suites' files) and console log here
#                          (with several series: into a subfolder per series, e.g. DIR/7.2)
#   RTRS_VM_APPEND         extra kernel command line arguments
#   RTRS_VM_BOOT_TIMEOUT   seconds for a boot to reach the guest's runner before qemu is stopped
#                          and the VM booted once more (300)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=vm/lib.sh
. "$here/vm/lib.sh"

[ "$(id -u)" = 0 ] || vm_die "run as root (installs packages, boots qemu)"
export RTRS_VM_CACHE=${RTRS_VM_CACHE:-/var/cache/rtrs-vmtest}
export RTRS_VM_REPO=$repo
timeout_s=${RTRS_VM_TIMEOUT:-2400}
smp=${RTRS_VM_SMP:-2}
[[ $smp =~ ^[1-8]$ ]] || vm_die "RTRS_VM_SMP: $smp is not a count of CPUs from 1 to 8"
t_start=$(vm_now)

# ---- kernel series ------------------------------------------------------------------------------
# 6.1: the kernel linux-image-amd64 depends on in the machine's own apt lists (bookworm).
# Others: the test bed's own apt lists under $RTRS_VM_CACHE/apt/NAME (the machine's sources are
# never changed): NAME's sources.list, the release whose linux-image-amd64 is the series' kernel.
all_series=(6.1 6.12 7.2)
kernels=${RTRS_VM_KERNELS:-${all_series[*]}}
while getopts k: opt; do
	case $opt in
	k) kernels=$OPTARG ;;
	*) vm_die "usage: $0 [-k SERIES[,SERIES...]] [SUITE...] (series: ${all_series[*]})" ;;
	esac
done
shift $((OPTIND - 1))
read -ra klist <<<"${kernels//,/ }"
[ ${#klist[@]} -gt 0 ] || vm_die "no kernel series given"
for k in "${klist[@]}"; do
	case " ${all_series[*]} " in *" $k "*) ;; *) vm_die "-k $k: unknown kernel series (${all_series[*]})" ;; esac
done

# ---- the matrix: several series, one run of this script each ------------------------------
# With RTRS_VM_JOBS above 1, up to that many run at once, in the order given (the longest
# first, 6.1's); each one's output goes to a file, shown whole as soon as that run ends (one
# at a time), and meanwhile its progress lines (vmtest's own, the guest runner's) prefixed with
# the series.
if [ ${#klist[@]} -gt 1 ]; then
	jobs=${RTRS_VM_JOBS:-1}
	[[ $jobs =~ ^[1-9]$ ]] || vm_die "RTRS_VM_JOBS: $jobs is not a count from 1 to 9"
	mdir=$(mktemp -d /tmp/rtrs-vmtest-matrix.XXXXXX)
	trap 'rm -rf "$mdir"' EXIT
	# series K: one run; its verdicts and time in $mdir/K.sum.
	series() {
		local k=$1 t0 rc=0
		shift
		t0=$(vm_now)
		RTRS_VM_SUMMARY=$mdir/$k.sum RTRS_VM_RESULTS=${RTRS_VM_RESULTS:+$RTRS_VM_RESULTS/$k} \
			"$here/vmtest.sh" -k "$k" "$@" || rc=$?
		if [ ! -s "$mdir/$k.sum" ]; then
			echo "vmtest: $k FAIL: the run ended (rc $rc) before its suites' verdicts" >"$mdir/$k.sum"
		fi
		echo "vmtest: $k rc $rc, $(vm_since "$t0") s in all" >>"$mdir/$k.sum"
		return "$rc"
	}
	mfail=0
	if [ "$jobs" = 1 ]; then
		for k in "${klist[@]}"; do
			echo "==== kernel $k: $0 -k $k $*"
			series "$k" "$@" || mfail=1
		done
	else
		for k in "${klist[@]}"; do
			while [ "$(jobs -pr | wc -l)" -ge "$jobs" ]; do wait -n || true; done
			echo "==== kernel $k: $0 -k $k $* (output below when it ends; progress: [$k])"
			{
				{ series "$k" "$@" 2>&1 | tee "$mdir/$k.out" |
					grep --line-buffered -E '^(vmtest: |\[vm\] rtrs-vmtest: )' | sed -u "s/^/[$k] /"; } || true
				(
					flock 9
					echo "==== kernel $k: $0 -k $k $* (its whole output)"
					cat "$mdir/$k.out"
				) 9>"$mdir/print.lock"
			} &
		done
		wait
		# What the background pipelines returned says nothing (grep's status, under pipefail):
		# the verdicts are read from the summaries.
		for k in "${klist[@]}"; do grep -q "^vmtest: $k rc 0," "$mdir/$k.sum" 2>/dev/null || mfail=1; done
	fi
	echo "==== matrix summary (${klist[*]}, $jobs at once)"
	for k in "${klist[@]}"; do cat "$mdir/$k.sum"; done | tee "$mdir/all"
	echo "vmtest: matrix $(grep -c '^vmtest: [^ ]* PASS' "$mdir/all") passed, $(grep -c '^vmtest: [^ ]* FAIL' "$mdir/all") failed, whole run $(vm_since "$t_start") s"
	exit "$mfail"
fi
kseries=${klist[0]}
export RTRS_VM_KSERIES=$kseries RTRS_VM_APT="" RTRS_VM_APT_RELEASE="" RTRS_VM_CHROOT="" \
	RTRS_VM_CHROOT_SUITE="" RTRS_VM_MIRROR=http://deb.debian.org/debian
apt_suites=()
case $kseries in
6.1) ;;
6.12)
	# Built in bookworm-backports with bookworm's toolchain: the host's gcc-12 builds modules.
	RTRS_VM_APT=$RTRS_VM_CACHE/apt/bookworm RTRS_VM_APT_RELEASE=bookworm-backports
	apt_suites=(bookworm bookworm-backports)
	;;
7.2)
	# Unstable's kernel (the series checked below): its headers name unstable's gcc and kbuild,
	# so its modules are built in a chroot of unstable kept in the cache.
	RTRS_VM_APT=$RTRS_VM_CACHE/apt/sid
	RTRS_VM_CHROOT=$RTRS_VM_CACHE/chroot/sid RTRS_VM_CHROOT_SUITE=sid
	apt_suites=(sid)
	;;
esac
# Go for the suites' host parts, as go.mod asks for it (scripts/go-toolchain.sh).
# shellcheck source-path=SCRIPTDIR source=go-toolchain.sh
. "$here/go-toolchain.sh"
rtrs_use_go

# ---- suites: names and files -----------------------------------------------------------------
declare -a names=() files=()
add_suite() {
	local f=$1 n
	n=$(basename "$f" .sh)
	[[ $n =~ ^[A-Za-z0-9_-]+$ ]] || vm_die "bad suite name: $n"
	[ -f "$f" ] || vm_die "no suite file $f"
	names+=("$n")
	files+=("$(readlink -f "$f")")
}
if [ $# -eq 0 ]; then
	for f in "$here"/vm/suites/*.sh; do add_suite "$f"; done
else
	for a in "$@"; do
		if [[ $a == */* ]]; then add_suite "$a"; else add_suite "$here/vm/suites/$a.sh"; fi
	done
fi
[ ${#names[@]} -gt 0 ] || vm_die "no suites"

# ---- the run's work folder --------------------------------------------------------------------
# Under /tmp so that the guest mounts it at the same path (its /tmp is a tmpfs): paths built on
# the host (binaries, files) mean the same thing on both sides. It holds the scripts in the
# layout they have under scripts/ (vm/ and what vm/lib.sh calls beside it), and everything from
# here on, host parts included, runs from that copy: a file the copy lacks fails every run at
# once, not only the run on a machine that takes the path needing it.
work=$(mktemp -d /tmp/rtrs-vmtest.XXXXXX)
export RTRS_VM_WORK=$work
mkdir -p "$work/bin" "$work/results" "$work/vm/suites"
cp "$here/vm/lib.sh" "$here/vm/guest.sh" "$work/vm/"
cp "$here/apt-install.sh" "$work/"
for i in "${!names[@]}"; do cp "${files[$i]}" "$work/vm/suites/${names[$i]}.sh"; done
# shellcheck source=vm/lib.sh
. "$work/vm/lib.sh"
# env.sh is written just before the boot.
vm_check_layout "$work" env.sh || vm_die "the work folder lacks files its scripts use (above)"

# ---- packages ---------------------------------------------------------------------------------
# A suite may name extra Debian packages in SUITE_PACKAGES (read without running its hooks).
pkgs=(qemu-system-x86 busybox-static cpio gzip coreutils util-linux iproute2 rdma-core
	ibverbs-providers ibverbs-utils rdmacm-utils perftest)
for f in "${files[@]}"; do
	# shellcheck disable=SC2016,SC2207 # expanded by the child shell; a word list
	pkgs+=($(bash -c '. "$1"; echo "${SUITE_PACKAGES:-}"' suite "$f"))
done
vm_apt_update # always: the package lists decide which kernel the VM boots
vm_apt_install "${pkgs[@]}"
if [ -n "$RTRS_VM_APT" ]; then
	# The test bed's own lists, refreshed every run like the machine's.
	mkdir -p "$RTRS_VM_APT/lists/partial" "$RTRS_VM_APT/cache/archives/partial"
	for s in "${apt_suites[@]}"; do
		echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $RTRS_VM_MIRROR $s main"
	done >"$RTRS_VM_APT/sources.list.new"
	mv "$RTRS_VM_APT/sources.list.new" "$RTRS_VM_APT/sources.list"
	vm_log "apt-get update ($RTRS_VM_APT: ${apt_suites[*]})"
	(
		flock 9
		vm_kapt apt-get -q -o Acquire::Languages=none update
	) 9>"$RTRS_VM_APT/.lock"
fi

# ---- kernel: the image linux-image-amd64 depends on, unpacked (never installed) -------------
mkdir -p "$RTRS_VM_CACHE/kernel" "$RTRS_VM_CACHE/initrd"
exec 9>"$RTRS_VM_CACHE/.lock"
flock 9 # concurrent runs share the cache: one fills it, the others wait
kpkg=$(vm_kapt apt-cache depends linux-image-amd64 |
	awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$kpkg" ] || vm_die "cannot tell which kernel linux-image-amd64 depends on"
[[ $kpkg == linux-image-$kseries.* ]] || vm_die "-k $kseries: linux-image-amd64 depends on $kpkg"
kpver=$(vm_kapt_version "$kpkg")
export RTRS_VM_KVER=${kpkg#linux-image-}
export RTRS_VM_KDIR=$RTRS_VM_CACHE/kernel/${kpkg}_$kpver
# 7.2's linux-image-KVER holds no files: it depends on linux-binary-KVER (the kernel, as
# usr/lib/modules/KVER/vmlinuz), linux-modules-KVER and linux-base-KVER (config,
# modules.builtin). Every dependency named for this kernel is unpacked with it.
# shellcheck disable=SC2207 # package names
kpkgs=("$kpkg=$kpver" $(vm_kapt apt-cache depends "$kpkg=$kpver" | awk -v k="-$RTRS_VM_KVER" \
	'$1 ~ /Depends:$/ && substr($2, 1, 6) == "linux-" && substr($2, length($2) - length(k) + 1) == k {
		print $2 "=" v }' v="$kpver" | sort -u))
# .ok names the packages unpacked into the tree: a tree unpacked from another set (an older
# layout of this script, an interrupted run) is unpacked again, never booted half-filled.
if [ "$(cat "$RTRS_VM_KDIR/.ok" 2>/dev/null)" != "${kpkgs[*]}" ]; then
	[ ! -e "$RTRS_VM_KDIR" ] || vm_log "kernel tree $RTRS_VM_KDIR was not unpacked from ${kpkgs[*]}: unpacking again"
	t0=$(vm_now)
	tmp=$(mktemp -d "$RTRS_VM_CACHE/kernel/dl.XXXXXX")
	vm_log "downloading ${kpkgs[*]}"
	# APT::Sandbox::User=root: the _apt user may not write into the cache folder.
	(cd "$tmp" && vm_kapt apt-get -q -o APT::Sandbox::User=root download "${kpkgs[@]}")
	vm_log "downloaded $(du -ch "$tmp"/*.deb | tail -1 | cut -f1) in $(vm_since "$t0") s"
	for f in "$tmp"/*.deb; do dpkg-deb -x "$f" "$tmp/x"; done
	# Older kernels' trees of this series are 400 MB each and never booted again; one tree
	# per series stays (6.1.0-56 replaces 6.1.0-55, not 6.12.*).
	rm -rf "$RTRS_VM_CACHE/kernel/linux-image-$kseries".[0-9]*
	mv "$tmp/x" "$RTRS_VM_KDIR"
	rm -rf "$tmp"
	echo "${kpkgs[*]}" >"$RTRS_VM_KDIR/.ok"
	vm_log "kernel $RTRS_VM_KVER unpacked in $(vm_since "$t0") s"
fi
# 6.1, 6.12: boot/vmlinuz-KVER; 7.2: usr/lib/modules/KVER/vmlinuz.
vmlinuz=
for f in "$RTRS_VM_KDIR/boot/vmlinuz-$RTRS_VM_KVER" "$RTRS_VM_KDIR/usr/lib/modules/$RTRS_VM_KVER/vmlinuz"; do
	[ -f "$f" ] && vmlinuz=$f && break
done
[ -n "$vmlinuz" ] || vm_die "no vmlinuz of $RTRS_VM_KVER in $RTRS_VM_KDIR"

# ---- initramfs: busybox, /init and the modules, in dependency order -------------------------
# What the guest needs; each module's dependencies (its depends= field) are added before it.
# A name ending in "?" is left out where the kernel has no such module (7.2: rxe computes its
# CRC with the kernel's built-in crc32 library, and crc32_generic is gone; 6.1 has no ublk_drv).
want=(virtio_pci 9pnet_virtio 9p crc32_generic? ib_core ib_uverbs udp_tunnel ip6_udp_tunnel ublk_drv?
	rdma_rxe ib_cm iw_cm configfs rdma_cm rdma_ucm veth nbd fuse loop)
mdir=$(vm_kernel_moddir)
declare -A modfile=() seen=()
while IFS= read -r f; do
	n=${f##*/} # no subshell per file: there are about 4000
	n=${n%%.ko*}
	modfile[${n//-/_}]=$f
done < <(find "$mdir/kernel" -name '*.ko*')
order=()
add_mod() {
	local n=${1//-/_} f d
	[ -z "${seen[$n]:-}" ] || return 0
	seen[$n]=1
	f=${modfile[$n]:-}
	if [ -z "$f" ]; then
		# Built into the kernel: nothing to load.
		vm_kmod_builtin "$mdir" "$n" && return 0
		[ -z "${2:-}" ] || { vm_log "no module $n in $RTRS_VM_KVER: left out"; return 0; }
		vm_die "module $n is in neither $mdir/kernel nor modules.builtin"
	fi
	for d in $(vm_mod_cat "$f" | tr '\0' '\n' | sed -n 's/^depends=//p' | tr ',' ' '); do
		add_mod "$d"
	done
	order+=("$n")
}
for m in "${want[@]}"; do
	if [[ $m == *'?' ]]; then add_mod "${m%'?'}" optional; else add_mod "$m"; fi
done
case " ${modfile[*]} " in *.ko.xz\ *) vm_apt_install xz-utils ;; esac
case " ${modfile[*]} " in *.ko.zst\ *) vm_apt_install zstd ;; esac

# Rebuilt when the kernel, the module list, /init or busybox change.
key=$({
	echo "$RTRS_VM_KDIR ${order[*]}"
	cat "$here/vm/init.sh" /bin/busybox
} | sha256sum | cut -c1-16)
initrd=$RTRS_VM_CACHE/initrd/$RTRS_VM_KVER-$key.gz
if [ ! -f "$initrd" ]; then
	t0=$(vm_now)
	tmp=$(mktemp -d "$RTRS_VM_CACHE/initrd/build.XXXXXX")
	mkdir -p "$tmp/root/bin" "$tmp/root/modules" "$tmp/root/proc" "$tmp/root/sys" \
		"$tmp/root/dev" "$tmp/root/newroot"
	cp /bin/busybox "$tmp/root/bin/busybox"
	install -m 755 "$here/vm/init.sh" "$tmp/root/init"
	for n in "${order[@]}"; do
		vm_mod_cat "${modfile[$n]}" >"$tmp/root/modules/$n.ko"
		echo "$n.ko" >>"$tmp/root/modules/list"
	done
	(cd "$tmp/root" && find . | cpio -o -H newc --quiet | gzip -1) >"$tmp/initrd.gz"
	rm -f "$RTRS_VM_CACHE/initrd/$RTRS_VM_KVER"-*.gz
	mv "$tmp/initrd.gz" "$initrd"
	rm -rf "$tmp"
	vm_log "initramfs built in $(vm_since "$t0") s: $initrd (modules: ${order[*]})"
fi
exec 9>&- # unlock

# ---- host parts ---------------------------------------------------------------------------------
declare -A host_rc=() host_time=()
guest_suites=()
for n in "${names[@]}"; do
	t0=$(vm_now)
	# -e in a fresh shell (it would be off in a function called from a condition).
	set +e
	# shellcheck disable=SC2016 # expanded by the child shell
	RTRS_VM_SUITE=$n bash -c '
		set -euo pipefail
		. "$1"
		. "$2"
		cd "$RTRS_VM_REPO"
		if declare -F host >/dev/null; then host; fi' host "$work/vm/lib.sh" \
		"$work/vm/suites/$n.sh" 2>&1 | tee "$work/results/$n.host.log" | sed "s/^/[host $n] /"
	host_rc[$n]=${PIPESTATUS[0]}
	set -e
	[ "${host_rc[$n]}" != 0 ] || guest_suites+=("$n")
	host_time[$n]=$(vm_since "$t0")
	vm_log "suite $n: host part rc=${host_rc[$n]} in ${host_time[$n]} s"
done

# ---- boot ---------------------------------------------------------------------------------------
# The guest's own deadline (seconds of its uptime) comes a little before the host's.
margin=$((timeout_s / 4 < 20 ? timeout_s / 4 : 20))
guest_timeout=$((timeout_s - margin))
{
	printf 'export %s=%q\n' \
		RTRS_VM_ADDR1 10.99.0.1 RTRS_VM_ADDR2 10.99.0.3 RTRS_VM_DEV rxe0 \
		RTRS_VM_WORK "$work" RTRS_VM_REPO "$repo" RTRS_VM_KVER "$RTRS_VM_KVER" \
		RTRS_VM_SUITES "${guest_suites[*]}" RTRS_VM_GUEST_TIMEOUT "$guest_timeout" \
		RTRS_VM_SUITE_TIMEOUT "${RTRS_VM_SUITE_TIMEOUT:-$guest_timeout}"
} >"$work/env.sh"

boot_s=- vm_s=-
if [ ${#guest_suites[@]} -gt 0 ]; then
	vm_log "booting $RTRS_VM_KVER (timeout ${timeout_s}s), suites: ${guest_suites[*]}, work $work"
	t_boot=$(vm_now)
	# TCG's TSC comes from one host clock, so it is synchronised across vCPUs even though the
	# kernel's check says otherwise; as clocksource it makes gettimeofday a vDSO read instead of
	# an emulated HPET access, and perftest's clock calibration (r^2 >= 0.9) reliable.
	tsc="clocksource=tsc tsc=reliable"
	append="console=ttyS0 quiet panic=-1 $tsc rtrs_work=$work"
	# The guest's /tmp and /run are its own tmpfs: a repository checked out there is shared on
	# its own and mounted at the same path.
	share_repo=()
	case $repo/ in /tmp/* | /run/*)
		share_repo=(-virtfs "local,path=$repo,mount_tag=repo,security_model=none,readonly=on")
		append+=" rtrs_repo=$repo"
		;;
	esac
	append+=" ${RTRS_VM_APPEND:-}"
	# No network device at all (-nic none): no guest packet may leave the VM.
	# shellcheck disable=SC2054 # commas inside qemu's options, not between array elements
	qemu=(qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m 2048 -smp "$smp"
		-nographic -no-reboot -nic none
		-kernel "$vmlinuz" -initrd "$initrd"
		-append "$append"
		-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap
		-virtfs "local,path=$work,mount_tag=work,security_model=none" "${share_repo[@]}")
	# A boot that never reaches the guest's runner is retried once: under TCG on a loaded host a
	# VM once stayed silent after the firmware for 19 minutes, where the same kernel and
	# initramfs had booted in 25 s just before; and a 7.2 guest once oopsed 1.5 s into its boot
	# (int3 in sched_clock_cpu: the kernel patching its own text while the other emulated CPU
	# ran it), before any of our code ran.
	boot_timeout=${RTRS_VM_BOOT_TIMEOUT:-300}
	for attempt in 1 2; do
		t_boot=$(vm_now) boot_s=-
		rm -f "$work/booted" "$work/boot-timeout" "$work/qemu.rc" "$work/qemu.pid"
		(
			for ((i = 0; i < boot_timeout; i++)); do
				[ -f "$work/booted" ] || [ -f "$work/qemu.rc" ] && exit 0
				sleep 1
			done
			touch "$work/boot-timeout"
			kill "$(cat "$work/qemu.pid")" 2>/dev/null || true
		) &
		watchdog=$!
		while IFS= read -r line || [ -n "$line" ]; do
			line=${line%$'\r'}
			printf '%s\n' "$line" >>"$work/console.log"
			printf '[vm] %s\n' "$line"
			if [ "$boot_s" = - ] && [[ $line == *"rtrs-vmtest: guest up"* ]]; then
				boot_s=$(vm_since "$t_boot")
				touch "$work/booted"
			fi
		done < <(
			{
				rc=0
				timeout -k 10 "$timeout_s" "${qemu[@]}" </dev/null 2>&1 &
				echo $! >"$work/qemu.pid"
				wait $! || rc=$?
				echo "$rc" >"$work/qemu.rc"
			} | sed -u 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g' # the firmware's screen escapes
		)
		wait "$watchdog" || true
		if [ "$attempt" = 1 ] && [ ! -f "$work/booted" ]; then
			if [ -f "$work/boot-timeout" ]; then
				vm_log "the guest did not reach its runner in ${boot_timeout} s (RTRS_VM_BOOT_TIMEOUT): qemu stopped, booting again"
			else
				vm_log "the guest stopped before it reached its runner (qemu's exit status $(cat "$work/qemu.rc" 2>/dev/null || echo missing), its console above): booting again"
			fi
			continue
		fi
		break
	done
	vm_s=$(vm_since "$t_boot")
fi

# ---- report -------------------------------------------------------------------------------------
R=$work/results
fail=0
if [ ${#guest_suites[@]} -gt 0 ]; then
	qrc=$(cat "$work/qemu.rc" 2>/dev/null || echo missing)
	if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
		vm_log "FAIL: the VM run passed RTRS_VM_TIMEOUT=${timeout_s}s and was killed"
		fail=1
	elif [ "$qrc" != 0 ]; then
		vm_log "FAIL: qemu exited with status $qrc"
		fail=1
	fi
	if [ -f "$work/boot-timeout" ]; then
		vm_log "FAIL: twice the guest did not reach its runner in ${boot_timeout} s"
		fail=1
	elif [ ! -f "$R/boot-uptime" ]; then
		vm_log "FAIL: the guest never reached its runner (see the console output above)"
		fail=1
	fi
	if [ -f "$R/setup.log" ]; then
		echo "==== guest setup (rc $(cat "$R/setup.rc" 2>/dev/null || echo missing))"
		cat "$R/setup.log"
	fi
	[ -f "$R/done" ] || { vm_log "FAIL: the guest runner did not finish"; fail=1; }
fi
summary=()
for n in "${names[@]}"; do
	if [ "${host_rc[$n]}" != 0 ]; then
		summary+=("FAIL $n (host part rc ${host_rc[$n]}, ${host_time[$n]} s)")
		fail=1
		continue
	fi
	rc=$(cat "$R/$n.rc" 2>/dev/null || echo missing)
	t=$(cat "$R/$n.time" 2>/dev/null || echo -)
	echo "==== suite $n: guest output (rc $rc, $t s)"
	cat "$R/$n.log" 2>/dev/null || echo "(no log)"
	if [ "$rc" = 0 ]; then
		summary+=("PASS $n (host ${host_time[$n]} s, guest $t s)")
	else
		[ "$rc" = missing ] && rc="no result file"
		[ "$rc" = 124 ] && rc="timed out after RTRS_VM_SUITE_TIMEOUT"
		summary+=("FAIL $n (guest: $rc)")
		fail=1
	fi
done
echo "==== summary (kernel $kseries: $RTRS_VM_KVER)"
for l in "${summary[@]}"; do echo "vmtest: $kseries $l"; done | tee -a "${RTRS_VM_SUMMARY:-/dev/null}"
echo "vmtest: $kseries boot to guest runner ${boot_s} s, VM run ${vm_s} s, whole run $(vm_since "$t_start") s" |
	tee -a "${RTRS_VM_SUMMARY:-/dev/null}"
if [ -n "${RTRS_VM_RESULTS:-}" ]; then
	# For CI artefacts: the logs and whatever the suites wrote into results/.
	mkdir -p "$RTRS_VM_RESULTS"
	cp -r "$R"/. "$RTRS_VM_RESULTS"/
	[ ! -f "$work/console.log" ] || cp "$work/console.log" "$RTRS_VM_RESULTS"/
	echo "vmtest: results copied to $RTRS_VM_RESULTS"
fi
if [ "$fail" = 0 ] && [ -z "${RTRS_VM_KEEP:-}" ]; then
	rm -rf "$work"
else
	echo "vmtest: work folder kept: $work"
fi
exit "$fail"
