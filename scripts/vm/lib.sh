# shellcheck shell=bash
# Helpers of the VM test bed, sourced by scripts/vmtest.sh on the host, by the guest runner
# (scripts/vm/guest.sh) and by every suite's shell (host and guest side alike). Functions named
# vm_* are the suites' API; see scripts/vm/README.md.

vm_log() { printf 'vmtest: %s\n' "$*" >&2; }
vm_die() { vm_log "error: $*"; exit 1; }

# Seconds since the epoch with microseconds, and a duration since such a stamp, for timings.
vm_now() { printf '%s' "${EPOCHREALTIME/,/.}"; }
vm_since() { awk -v a="$1" -v b="$(vm_now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------------------------------------
# Host side

# vm_check_layout DIR [GENERATED...]: every file that a script under DIR names relative to its
# own folder ("$(dirname "${BASH_SOURCE[0]}")/...") or to the work folder ("$W/...", guest.sh)
# exists in DIR, except the GENERATED ones (written later in the run). Lists each one missing.
vm_check_layout() {
	local dir=$1 f ref rel target bad=0
	shift
	while IFS= read -r f; do
		while IFS= read -r ref; do
			case $ref in
			'$W/'*) rel=${ref#'$W/'} target=$dir/$rel ;;
			*) rel=${ref#*)/} target=$(dirname "$f")/$rel ;;
			esac
			case " $* " in *" $rel "*) continue ;; esac
			if [ ! -e "$target" ]; then
				vm_log "missing: ${f#"$dir"/} uses $rel, not in the copy ($target)"
				bad=1
			fi
		done < <(grep -v '^[[:space:]]*#' "$f" |
			grep -oE '\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/[A-Za-z0-9_./-]+|\$W/[A-Za-z0-9_./-]+' | sort -u)
	done < <(find "$dir" -name '*.sh' -type f)
	return "$bad"
}

# apt-get update once per run (the package lists decide which kernel the VM boots).
vm_apt_update() {
	[ -n "${RTRS_VM_APT_UPDATED:-}" ] && return 0
	vm_log "apt-get update"
	# Waits for a held lock (apt-get itself waits for dpkg's only).
	"$(dirname "${BASH_SOURCE[0]}")/../apt-install.sh" --update
	export RTRS_VM_APT_UPDATED=1
}

# vm_apt_install PKG...: install the packages not installed yet, saying which.
vm_apt_install() {
	local p missing=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep 'install ok installed' >/dev/null ||
			missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	vm_log "installing: ${missing[*]}"
	vm_apt_update
	"$(dirname "${BASH_SOURCE[0]}")/../apt-install.sh" --no-update "${missing[@]}"
}

# vm_kapt CMD ARG...: run apt-get or apt-cache (CMD) with the chosen kernel's package lists:
# the machine's when RTRS_VM_APT is empty (-k 6.1), else the test bed's own under $RTRS_VM_APT
# (sources.list, lists/, cache/; the machine's apt sources are never changed). With
# RTRS_VM_APT_RELEASE, that release's versions are the candidates (backports are pinned low).
vm_kapt() {
	local cmd=$1
	shift
	if [ -z "${RTRS_VM_APT:-}" ]; then
		"$cmd" "$@"
		return
	fi
	"$cmd" -o Dir::Etc::SourceList="$RTRS_VM_APT/sources.list" \
		-o Dir::Etc::SourceParts=/nonexistent -o Dir::State::Lists="$RTRS_VM_APT/lists" \
		-o Dir::Cache="$RTRS_VM_APT/cache" -o APT::Sandbox::User=root \
		${RTRS_VM_APT_RELEASE:+-o APT::Default-Release="$RTRS_VM_APT_RELEASE"} "$@"
}

# vm_kapt_version PKG: the candidate version of PKG in the chosen kernel's package lists.
vm_kapt_version() {
	vm_kapt apt-cache show --no-all-versions "$1" | awk '/^Version:/ {print $2; exit}'
}

# vm_kapt_unpack DIR PKG...: download PKG... (candidate versions) with vm_kapt and unpack them
# into DIR (dpkg-deb -x, never installed); the .debs are kept in DIR.debs/.
vm_kapt_unpack() {
	local dir=$1 p
	shift
	mkdir -p "$dir.debs" "$dir"
	for p in "$@"; do
		(cd "$dir.debs" && vm_kapt apt-get -q -o APT::Sandbox::User=root download \
			"$p=$(vm_kapt_version "$p")")
	done
	for p in "$dir.debs"/*.deb; do dpkg-deb -x "$p" "$dir"; done
}

# vm_kernel_moddir: the module folder of the VM's kernel in its unpacked image: lib/modules/KVER
# (6.1, 6.12) or usr/lib/modules/KVER (7.2's packages install under /usr only).
vm_kernel_moddir() {
	local d
	for d in "${RTRS_VM_KDIR:?}/lib/modules/${RTRS_VM_KVER:?}" "$RTRS_VM_KDIR/usr/lib/modules/$RTRS_VM_KVER"; do
		[ -d "$d/kernel" ] && { printf '%s\n' "$d"; return 0; }
	done
	vm_die "no lib/modules/$RTRS_VM_KVER/kernel in $RTRS_VM_KDIR"
}

# vm_kernel_module PATH...: copy the VM kernel's module kernel/PATH.ko (e.g. fs/ext4/ext4) to
# $RTRS_VM_WORK/kmod/NAME.ko, decompressed (6.12's and 7.2's are .ko.xz; busybox insmod takes
# plain .ko), with the modules it depends on (their depends= field), so that vm_insmod loads
# them first. Kernels move and rename modules: a PATH not there is looked up by its NAME
# anywhere under kernel/ (7.2's lib/crc16 is lib/crc/crc16); a NAME that is no module file of
# this kernel at all (built in, or gone: 7.2 has no crc32c_generic) gets NAME.none instead,
# and vm_insmod of NAME.ko then does nothing.
vm_kernel_module() {
	local p f n mdir
	mdir=$(vm_kernel_moddir)
	mkdir -p "${RTRS_VM_WORK:?}/kmod"
	for p in "$@"; do
		n=${p##*/}
		f=$(_vm_kmod_find "$mdir" "$p") || {
			vm_log "module $n: no module file in this kernel ($(vm_kmod_builtin "$mdir" "$n" &&
				echo built in || echo gone)); vm_insmod will skip it"
			echo "$p: not a module of $RTRS_VM_KVER" >"$RTRS_VM_WORK/kmod/$n.none"
			continue
		}
		_vm_kmod_copy "$mdir" "$f"
	done
}

# _vm_kmod_find MDIR PATH: the file of module PATH (kernel/PATH.ko*, else NAME.ko* anywhere
# under kernel/, "-" and "_" alike).
_vm_kmod_find() {
	local mdir=$1 p=$2 n f
	for f in "$mdir/kernel/$p".ko*; do
		[ -f "$f" ] && { printf '%s\n' "$f"; return 0; }
	done
	n=${p##*/}
	f=$(find "$mdir/kernel" \( -name "$n.ko*" -o -name "${n//-/_}.ko*" -o -name "${n//_/-}.ko*" \) \
		-type f -print -quit)
	[ -n "$f" ] && printf '%s\n' "$f"
}

# vm_kmod_builtin MDIR NAME: NAME is built into the kernel (modules.builtin). grep reads to the
# end, never -q: under pipefail, -q's early exit can kill tr with SIGPIPE and turn a match into
# a failure (7.2's virtio_pci, 3.9 KB into the file, failed a CI run that way).
vm_kmod_builtin() {
	tr '-' '_' <"$1/modules.builtin" 2>/dev/null | grep "/${2//-/_}\.ko\$" >/dev/null
}

# _vm_kmod_copy MDIR FILE: FILE decompressed into $RTRS_VM_WORK/kmod, then its dependencies.
_vm_kmod_copy() {
	local mdir=$1 f=$2 n d df
	n=${f##*/}
	n=${n%%.ko*}
	[ -f "$RTRS_VM_WORK/kmod/$n.ko" ] && return 0
	vm_mod_cat "$f" >"$RTRS_VM_WORK/kmod/$n.ko"
	for d in $(vm_mod_deps "$RTRS_VM_WORK/kmod/$n.ko"); do
		if df=$(_vm_kmod_find "$mdir" "$d"); then
			_vm_kmod_copy "$mdir" "$df"
		fi # else built in (or loaded by the initramfs from its own copy)
	done
}

# vm_mod_deps FILE: the names of the modules an uncompressed .ko depends on, one per line.
vm_mod_deps() {
	tr '\0' '\n' <"$1" | sed -n 's/^depends=//p' | tr ',' '\n' | sed '/^$/d'
}

# vm_mod_cat FILE: a module's bytes, decompressed (busybox insmod takes plain .ko only).
vm_mod_cat() {
	case $1 in
	*.ko.xz) xz -dc "$1" ;;
	*.ko.zst) zstd -qdc "$1" ;;
	*.ko.gz) gzip -dc "$1" ;;
	*) cat "$1" ;;
	esac
}

# vm_build_kernel_rtrs: build the kernel's own RTRS (rtrs-core/client/server) and RNBD
# (rnbd-client/server) as external modules for the VM's kernel, from Debian's linux-source
# against the matching linux-headers, cached in $RTRS_VM_CACHE/kmod/<kernel+package versions>,
# and copy the .ko files to $RTRS_VM_WORK/kmod where the guest's vm_load_kernel_rtrs finds
# them (the cache itself may not be visible in the guest). Debian does not enable RTRS/RNBD.
# -k 6.1: linux-source and linux-headers are installed on the machine (its own apt lists).
# -k 6.12: linux-source, linux-headers (with its -common and linux-kbuild) are downloaded
# with the test bed's own lists and unpacked into one root, $RTRS_VM_CACHE/ksrc/<kernel_version>,
# whose headers Makefile is pointed at the unpacked -common tree; nothing is installed; the
# host's gcc builds (backports are built with bookworm's).
# -k 7.2 (RTRS_VM_CHROOT set): the headers name a compiler and a kbuild that only the kernel's
# own release has, so headers and source are installed in a debootstrapped chroot of that
# release (vm_chroot_ensure) and the build runs in it.
vm_build_kernel_rtrs() {
	local kver=${RTRS_VM_KVER:?} series src hdr key out root hdir tarball v sv
	series=$(printf '%s' "$kver" | cut -d. -f1,2) # 6.1.0-56-amd64 -> 6.1
	src=linux-source-$series hdr=linux-headers-$kver
	if [ -z "${RTRS_VM_APT:-}" ]; then
		vm_apt_install "$src" "$hdr" make gcc xz-utils
		key=$kver-$(dpkg-query -W -f='${Version}' "$hdr")-$(dpkg-query -W -f='${Version}' "$src")
		hdir=/usr/src/$hdr tarball=/usr/src/$src.tar.xz
	else
		vm_apt_install xz-utils
		[ -n "${RTRS_VM_CHROOT:-}" ] || vm_apt_install make gcc
		v=$(vm_kapt_version "$hdr") sv=$(vm_kapt_version "$src")
		[ -n "$v" ] || vm_die "no $hdr in $RTRS_VM_APT's lists"
		[ -n "$sv" ] || vm_die "no $src in $RTRS_VM_APT's lists"
		key=$kver-$v-$sv
	fi
	out=$RTRS_VM_CACHE/kmod/$key
	mkdir -p "$RTRS_VM_CACHE/kmod"
	(
		# One builder at a time; a second run waits and then finds the cache filled.
		flock 8
		[ -f "$out/.ok" ] && exit 0
		if [ -n "${RTRS_VM_CHROOT:-}" ]; then
			root=$RTRS_VM_CHROOT
			_vm_chroot_kernel_pkgs "$root" "$hdr=$v" "$src=$sv" ||
				{
					vm_log "$root: installing the kernel's packages failed; building the chroot anew"
					rm -f "$root/.ok"
					_vm_chroot_kernel_pkgs "$root" "$hdr=$v" "$src=$sv"
				} || vm_die "cannot install $hdr=$v and $src=$sv in $root"
			_vm_rtrs_make "$root" "/usr/src/$hdr" "/usr/src/$src.tar.xz" "$src" "$out"
		elif [ -n "${RTRS_VM_APT:-}" ]; then
			_vm_ksrc_unpack "$key" "$hdr" "$v" "$src" "$series"
			root=$RTRS_VM_CACHE/ksrc/$key
			_vm_rtrs_make "" "$root/usr/src/$hdr" "$root/usr/src/$src.tar.xz" "$src" "$out"
		else
			_vm_rtrs_make "" "$hdir" "$tarball" "$src" "$out"
		fi
	) 8>"$RTRS_VM_CACHE/kmod/.lock" || exit
	mkdir -p "$RTRS_VM_WORK/kmod"
	cp "$out"/*.ko "$RTRS_VM_WORK/kmod/"
}

# _vm_rtrs_make ROOT HDIR TARBALL SRC OUT: extract the RTRS and RNBD folders of TARBALL
# (top folder SRC), build them against the headers in HDIR and put the five .ko into OUT.
# ROOT empty: on the host, HDIR and TARBALL host paths; else they are paths inside the chroot
# ROOT and make runs there (vm_chroot).
_vm_rtrs_make() {
	local root=$1 hdir=$2 tarball=$3 src=$4 out=$5 tmp in r n m t0 run=()
	vm_log "building the kernel's RTRS/RNBD modules for $RTRS_VM_KVER${root:+ in $root}"
	t0=$(vm_now)
	[ -z "$root" ] || run=(vm_chroot "$root")
	mkdir -p "${root:-$RTRS_VM_CACHE/kmod}/tmp"
	tmp=$(mktemp -d "${root:-$RTRS_VM_CACHE/kmod}/tmp/kbuild.XXXXXX")
	in=${tmp#"$root"} # the same folder as make sees it
	# Only the two driver folders: the whole tree takes minutes to unpack.
	tar -C "$tmp" -xJf "$root$tarball" --wildcards \
		"$src/drivers/infiniband/ulp/rtrs/*" "$src/drivers/block/rnbd/*" || { rm -rf "$tmp"; return 1; }
	r=$in/$src/drivers/infiniband/ulp/rtrs n=$in/$src/drivers/block/rnbd
	# No BTF in the modules: 6.12's and 7.2's headers ship vmlinux, so kbuild would run pahole.
	if ! "${run[@]}" make -s -C "$hdir" M="$r" CONFIG_DEBUG_INFO_BTF_MODULES= \
		CONFIG_INFINIBAND_RTRS=m CONFIG_INFINIBAND_RTRS_CLIENT=m CONFIG_INFINIBAND_RTRS_SERVER=m \
		-j"$(nproc)" modules ||
		! "${run[@]}" make -s -C "$hdir" M="$n" CONFIG_DEBUG_INFO_BTF_MODULES= \
			CONFIG_BLK_DEV_RNBD_CLIENT=m CONFIG_BLK_DEV_RNBD_SERVER=m KCFLAGS="-I$r" \
			KBUILD_EXTRA_SYMBOLS="$r/Module.symvers" -j"$(nproc)" modules; then
		rm -rf "$tmp"
		vm_die "building the kernel's RTRS/RNBD modules for $RTRS_VM_KVER failed"
	fi
	rm -rf "$out.new" && mkdir -p "$out.new"
	for m in "$r"/rtrs-core.ko "$r"/rtrs-client.ko "$r"/rtrs-server.ko \
		"$n"/rnbd-client.ko "$n"/rnbd-server.ko; do
		cp "$root$m" "$out.new/"
	done
	rm -rf "$tmp"
	touch "$out.new/.ok"
	rm -rf "$out" && mv "$out.new" "$out"
	vm_log "kernel RTRS/RNBD modules built in $(vm_since "$t0") s: $out"
}

# _vm_ksrc_unpack KEY HDR VERSION SRC SERIES: HDR=VERSION, its -common and linux-kbuild, and
# SRC downloaded with the test bed's lists and unpacked into $RTRS_VM_CACHE/ksrc/KEY (once).
_vm_ksrc_unpack() {
	local key=$1 hdr=$2 v=$3 src=$4 series=$5 root hdir
	root=$RTRS_VM_CACHE/ksrc/$key hdir=$RTRS_VM_CACHE/ksrc/$key/usr/src/$hdr
	mkdir -p "$RTRS_VM_CACHE/ksrc"
	(
		flock 7
		[ -f "$root/.ok" ] && exit 0
		local common kbuild t0
		t0=$(vm_now)
		vm_log "downloading and unpacking $hdr, its -common, linux-kbuild and $src ($key)"
		# The headers' Depends name the -common and linux-kbuild packages of this build.
		# shellcheck disable=SC2207 # package names
		common=($(vm_kapt apt-cache depends "$hdr=$v" |
			awk '/Depends: linux-(headers|kbuild)-/ {print $2}' | sort -u))
		[ ${#common[@]} -ge 2 ] || vm_die "$hdr=$v: cannot tell its -common and kbuild packages"
		# One tree per series: an older build's (about 1 GB) is never used again.
		rm -rf "$root" "$root.debs" "$RTRS_VM_CACHE/ksrc/$series".[0-9]*
		vm_kapt_unpack "$root" "$hdr" "${common[@]}" "$src"
		# The headers' Makefile includes /usr/src/linux-headers-*-common/Makefile (absolute);
		# its scripts and tools links are relative and stay inside the root.
		sed -i "s|^include /usr/src/|include $root/usr/src/|" "$hdir/Makefile"
		grep -q "^include $root/" "$hdir/Makefile" || vm_die "unexpected $hdir/Makefile"
		for kbuild in "$hdir/scripts" "$hdir/tools"; do
			[ -e "$kbuild" ] || vm_die "$kbuild: dangling ($(readlink "$kbuild"))"
		done
		rm -rf "$root.debs"
		touch "$root/.ok"
		vm_log "$hdr and $src unpacked in $(vm_since "$t0") s: $root"
	) 7>"$RTRS_VM_CACHE/ksrc/.lock"
}

# vm_chroot ROOT CMD...: run CMD as root in the chroot ROOT with /proc and /dev mounted, in a
# mount namespace of its own (the mounts vanish with it, whatever happens), a clean
# environment and the apt front end non-interactive.
vm_chroot() {
	local root=$1
	shift
	# shellcheck disable=SC2016 # expanded by the child shell
	unshare --mount --propagation private bash -c '
		r=$1
		shift
		mount -t proc proc "$r/proc" && mount --rbind /dev "$r/dev" || exit 1
		exec chroot "$r" /usr/bin/env -i HOME=/root LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
			PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"' vm_chroot "$root" "$@"
}

# vm_chroot_ensure ROOT SUITE: ROOT is a working chroot of Debian's SUITE (e.g. sid), made with
# debootstrap (--variant=minbase) when it is missing or broken (no .ok, or apt-get does not
# run in it). Kept in the cache and reused; its apt lists are refreshed by whoever installs.
# The machine's apt settings on checking a Release file's dates are carried over (a mirror
# whose Release files are past their Valid-Until is read by the machine's apt, and must be by
# the chroot's).
vm_chroot_ensure() {
	local root=$1 suite=$2 t0
	[ -f "$root/.ok" ] && vm_chroot "$root" apt-get --version >/dev/null 2>&1 && return 0
	vm_apt_install debootstrap
	t0=$(vm_now)
	vm_log "debootstrap --variant=minbase $suite into $root"
	rm -rf "$root" "$root.new"
	mkdir -p "$(dirname "$root")"
	debootstrap --variant=minbase --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
		"$suite" "$root.new" "${RTRS_VM_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1 || {
		tail -20 "$root.log" >&2
		vm_die "debootstrap $suite failed (log: $root.log)"
	}
	apt-config dump | grep -E '^Acquire::Check-(Valid-Until|Date) ' \
		>"$root.new/etc/apt/apt.conf.d/99rtrs-vmtest-host" || true
	vm_chroot "$root.new" apt-get clean
	touch "$root.new/.ok"
	mv "$root.new" "$root"
	vm_log "chroot $suite made in $(vm_since "$t0") s: $root ($(du -sh "$root" | cut -f1))"
}

# _vm_chroot_kernel_pkgs ROOT PKG=VERSION...: the chroot ROOT (of RTRS_VM_CHROOT_SUITE) holds
# these packages (installed with their dependencies, which name the compiler the headers were
# built with), and no other linux-headers; its compiler is the one the headers' config names.
_vm_chroot_kernel_pkgs() {
	local root=$1 t0 p old hdr want have
	shift
	mkdir -p "$(dirname "$root")"
	(
		flock 6
		vm_chroot_ensure "$root" "${RTRS_VM_CHROOT_SUITE:?}"
		t0=$(vm_now)
		vm_log "$root: installing $*"
		vm_chroot "$root" apt-get -q update >/dev/null || exit 1
		vm_chroot "$root" apt-get -q install -y --no-install-recommends make "$@" || exit 1
		# Headers of an older build (about 90 MB each) are never used again.
		for p in "$@"; do
			case $p in linux-headers-*) hdr=${p%%=*} ;; esac
		done
		# shellcheck disable=SC2016 # dpkg-query's format
		old=$(vm_chroot "$root" dpkg-query -W -f='${Package} ${Status}\n' 'linux-headers-*' |
			awk -v h="$hdr" '$NF == "installed" && $1 != h && $1 !~ /-common$/ {print $1}')
		# shellcheck disable=SC2086 # package names
		[ -z "$old" ] || vm_chroot "$root" apt-get -q purge -y --autoremove $old
		vm_chroot "$root" apt-get clean
		# The compiler the headers' config names ("x86_64-linux-gnu-gcc-16 (Debian 16.2.0-4) 16.2.0")
		# is there and is that version.
		want=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\(.*\)"$/\1/p' "$root/usr/src/$hdr/.config")
		[ -n "$want" ] || vm_die "$root/usr/src/$hdr/.config: no CONFIG_CC_VERSION_TEXT"
		have=$(vm_chroot "$root" "${want%% *}" --version | sed -n 1p) ||
			vm_die "$root: no ${want%% *}, which $hdr was built with"
		if [ "$have" = "$want" ]; then
			vm_log "compiler: $have, as $hdr names"
		else
			vm_log "warning: compiler $have; $hdr was built with $want"
		fi
		vm_log "$root: packages installed in $(vm_since "$t0") s ($(du -sh "$root" | cut -f1))"
	) 6>"$root.lock"
}

# ---------------------------------------------------------------------------------------------
# Guest side

# The guest's network and Soft-RoCE device; run once by the guest runner before the suites.
vm_guest_setup() {
	mountpoint -q /sys/kernel/config || mount -t configfs configfs /sys/kernel/config
	ip link set lo up
	ip link add va type veth peer name vb
	ip link set va up
	ip link set vb up
	# Two addresses on one interface give two RDMA paths through one rxe device.
	ip addr add "$RTRS_VM_ADDR1/24" dev va
	ip addr add "$RTRS_VM_ADDR2/24" dev va
	rdma link add "$RTRS_VM_DEV" type rxe netdev va
	vm_wait 30 vm_port_active "$RTRS_VM_DEV"
	rdma link show
	ip -brief addr show
}

vm_port_active() { ibv_devinfo -d "$1" 2>/dev/null | grep PORT_ACTIVE >/dev/null; }

# vm_wait SECONDS CMD...: retry CMD every 0.2 s until it succeeds; fail after SECONDS.
vm_wait() {
	local end=$((SECONDS + $1))
	shift
	until "$@"; do
		[ "$SECONDS" -lt "$end" ] || {
			vm_log "timed out waiting for: $*"
			return 1
		}
		sleep 0.2
	done
}

# vm_tcp_listening PORT: something listens on TCP PORT (for servers started in background).
vm_tcp_listening() { ss -Hltn "sport = :$1" | grep . >/dev/null; }

# vm_perftest_pair TOOL ARGS...: a perftest server and client (TOOL ARGS, the client also given
# the first address); the client's output. Both sides are bounded in time, and a pair that fails
# is tried again (up to three times): a perftest client that finds no listener yet is rejected
# and may crash, and its server then waits for a client forever.
vm_perftest_pair() {
	local try s out
	for try in 1 2 3; do
		out=
		timeout -k 5 120 "$@" >/tmp/perftest-server.log 2>&1 &
		s=$!
		if vm_wait 60 vm_perftest_listening && out=$(timeout -k 5 120 "$@" "$RTRS_VM_ADDR1" 2>&1) && wait $s; then
			printf '%s\n' "$out"
			return 0
		fi
		echo "perftest $1 failed (try $try):" >&2
		printf '%s\n' "$out" | tail -5 >&2
		tail -5 /tmp/perftest-server.log >&2
		kill "$s" 2>/dev/null || true
		wait "$s" || true
		vm_wait 30 vm_perftest_gone || true
	done
	return 1
}
# perftest with -R listens through rdma_cm on its port 18515.
vm_perftest_listening() { rdma res show cm_id | grep LISTEN | grep 18515 >/dev/null; }
vm_perftest_gone() { ! rdma res show cm_id | grep 18515 >/dev/null; }

# vm_staged ADDR SESSION: the requests of SESSION whose data rtrs-clientd (-metrics ADDR)
# copied through a path's stage (rtrs_client_staged_requests_total), as a whole number (the
# exposition writes a million as 1e+06).
vm_staged() {
	curl -sf --max-time 10 "http://$1/metrics" |
		awk -v s="session=\"$2\"" '/^rtrs_client_staged_requests_total\{/ && index($0, s) { printf "%d\n", $NF; found = 1 } END { exit !found }'
}

# vm_not_staged NAME ADDR SESSION BEFORE: no request of SESSION was staged since BEFORE (a
# vm_staged reading): NAME's IO went out from, and landed in, registered memory.
vm_not_staged() {
	local now
	now=$(vm_staged "$2" "$3")
	if [ "$now" != "$4" ]; then
		echo "FAIL: $1: $((now - $4)) requests copied through the stage, want none"
		return 1
	fi
	echo "$1: no request copied through the stage (rtrs_client_staged_requests_total stays $now)"
}

# vm_no_leaks LOG: the daemon that writes LOG let go of every region and protection domain of
# the paths it closed (a region left registered holds its domain, and pins its memory: a
# reconnect loop would grow without bound). Fails, with the lines.
vm_no_leaks() {
	if grep -E 'not deregistered|protection domain not freed|IO buffers still registered' "$1"; then
		echo "FAIL: $(basename "$1"): RDMA resources of closed paths not freed (above)"
		return 1
	fi
	echo "$(basename "$1"): every closed path's regions and protection domain freed"
}

# vm_insmod FILE [PARAM=VALUE...]: load a module unless a module of that name is loaded; the
# modules it depends on that lie beside it (vm_kernel_module copies them) are loaded first. A
# FILE missing with NAME.none beside it (vm_kernel_module: no such module in this kernel) is
# skipped.
vm_insmod() {
	local name dir d
	name=$(basename "$1")
	name=${name%%.ko*}
	dir=$(dirname "$1")
	[ -d "/sys/module/${name//-/_}" ] && return 0
	if [ ! -e "$1" ] && [ -f "$dir/$name.none" ]; then
		vm_log "$name: $(cat "$dir/$name.none"), not loaded"
		return 0
	fi
	for d in $(vm_mod_deps "$1"); do
		[ ! -f "$dir/$d.ko" ] || vm_insmod "$dir/$d.ko"
	done
	busybox insmod "$@"
}

# vm_load_kernel_rtrs [NAME...]: load the kernel's RTRS/RNBD modules that the host part built
# with vm_build_kernel_rtrs, in dependency order (default: all five). For module parameters
# call vm_insmod "$RTRS_VM_WORK/kmod/NAME.ko" PARAM=VALUE first.
vm_load_kernel_rtrs() {
	local m mods=("$@")
	[ ${#mods[@]} -gt 0 ] || mods=(rtrs-core rtrs-server rtrs-client rnbd-server rnbd-client)
	for m in "${mods[@]}"; do
		vm_insmod "$RTRS_VM_WORK/kmod/$m.ko"
	done
}

# vm_part NAME CMD...: one part of a suite. Says "== NAME" and runs CMD in the background,
# so that errexit holds inside it (it would not in a condition) while its failure does not end
# the suite; on failure says "== NAME: FAILED" and adds NAME to the caller's array `failed`.
# Each part runs even when one before it failed: one VM run shows everything.
vm_part() {
	local name=$1
	shift
	echo "== $name"
	"$@" &
	if ! wait $!; then
		echo "== $name: FAILED"
		failed+=("$name")
	fi
}

# vm_require_tests LOG NAME...: LOG (a Go test binary's -test.v output) shows every NAME as
# "--- PASS: NAME", no test skipped and no "no tests to run": a -test.run selection whose name
# no longer matches (a renamed or removed test), or a test that skips, fails the caller
# instead of passing with nothing run. Says what is missing.
vm_require_tests() {
	local log=$1 n bad=0
	shift
	[ $# -gt 0 ] || vm_die "vm_require_tests: no test names"
	if [ ! -s "$log" ]; then
		vm_log "$log: empty or missing"
		return 1
	fi
	if grep -q 'no tests to run' "$log"; then
		vm_log "$log: no tests to run (a selection that matches nothing)"
		bad=1
	fi
	if grep -q -- '--- SKIP' "$log"; then
		vm_log "$log: skipped: $(grep -- '--- SKIP' "$log" | tr -s ' \n' ' ')"
		bad=1
	fi
	for n in "$@"; do
		if ! awk -v n="$n" '$1 == "---" && $2 == "PASS:" && $3 == n { found = 1 } END { exit !found }' "$log"; then
			vm_log "$log: no \"--- PASS: $n\""
			bad=1
		fi
	done
	return "$bad"
}

# Run on exit of every suite shell: stop what the suite left running in the background.
vm_cleanup() {
	local pids
	pids=$(jobs -pr)
	[ -z "$pids" ] && return 0
	# shellcheck disable=SC2086 # a list of pids
	kill $pids 2>/dev/null || true
	sleep 0.2
	# shellcheck disable=SC2086
	kill -9 $pids 2>/dev/null || true
}
