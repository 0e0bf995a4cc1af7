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
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
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

# vm_kernel_module PATH...: copy the VM kernel's module kernel/PATH.ko (e.g. fs/ext4/ext4) to
# $RTRS_VM_WORK/kmod/NAME.ko, decompressed (6.12's are .ko.xz; busybox insmod takes plain .ko).
vm_kernel_module() {
	local p f
	for p in "$@"; do
		f=$(ls "${RTRS_VM_KDIR:?}/lib/modules/${RTRS_VM_KVER:?}/kernel/$p".ko*) ||
			vm_die "no module $p in $RTRS_VM_KDIR"
		mkdir -p "$RTRS_VM_WORK/kmod"
		vm_mod_cat "$f" >"$RTRS_VM_WORK/kmod/${p##*/}.ko"
	done
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
# Other series: linux-source, linux-headers (with its -common and linux-kbuild) are downloaded
# with the test bed's own lists and unpacked into one root, $RTRS_VM_CACHE/ksrc/<kernel_version>,
# whose headers Makefile is pointed at the unpacked -common tree; nothing is installed.
vm_build_kernel_rtrs() {
	local kver=${RTRS_VM_KVER:?} series src hdr key out tmp r n m root hdir tarball v
	series=$(printf '%s' "$kver" | cut -d. -f1,2) # 6.1.0-56-amd64 -> 6.1
	src=linux-source-$series hdr=linux-headers-$kver
	if [ -z "${RTRS_VM_APT:-}" ]; then
		vm_apt_install "$src" "$hdr" make gcc xz-utils
		key=$kver-$(dpkg-query -W -f='${Version}' "$hdr")-$(dpkg-query -W -f='${Version}' "$src")
		hdir=/usr/src/$hdr tarball=/usr/src/$src.tar.xz
	else
		vm_apt_install make gcc xz-utils
		v=$(vm_kapt_version "$hdr")
		[ -n "$v" ] || vm_die "no $hdr in $RTRS_VM_APT's lists"
		key=$kver-$v-$(vm_kapt_version "$src")
		root=$RTRS_VM_CACHE/ksrc/$key
		hdir=$root/usr/src/$hdr tarball=$root/usr/src/$src.tar.xz
		mkdir -p "$RTRS_VM_CACHE/ksrc"
		(
			flock 8
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
		) 8>"$RTRS_VM_CACHE/ksrc/.lock"
	fi
	out=$RTRS_VM_CACHE/kmod/$key
	mkdir -p "$RTRS_VM_CACHE/kmod"
	(
		# One builder at a time; a second run waits and then finds the cache filled.
		flock 8
		[ -f "$out/.ok" ] && exit 0
		vm_log "building the kernel's RTRS/RNBD modules for $kver"
		local t0
		t0=$(vm_now)
		tmp=$(mktemp -d "$RTRS_VM_CACHE/kmod/build.XXXXXX")
		trap 'rm -rf "$tmp"' EXIT
		# Only the two driver folders: the whole tree takes minutes to unpack.
		tar -C "$tmp" -xJf "$tarball" --wildcards \
			"$src/drivers/infiniband/ulp/rtrs/*" "$src/drivers/block/rnbd/*"
		r=$tmp/$src/drivers/infiniband/ulp/rtrs n=$tmp/$src/drivers/block/rnbd
		# No BTF in the modules: 6.12's headers ship vmlinux, so kbuild would run pahole.
		make -s -C "$hdir" M="$r" CONFIG_DEBUG_INFO_BTF_MODULES= CONFIG_INFINIBAND_RTRS=m \
			CONFIG_INFINIBAND_RTRS_CLIENT=m CONFIG_INFINIBAND_RTRS_SERVER=m -j"$(nproc)" modules
		make -s -C "$hdir" M="$n" CONFIG_DEBUG_INFO_BTF_MODULES= CONFIG_BLK_DEV_RNBD_CLIENT=m \
			CONFIG_BLK_DEV_RNBD_SERVER=m KCFLAGS="-I$r" KBUILD_EXTRA_SYMBOLS="$r/Module.symvers" \
			-j"$(nproc)" modules
		rm -rf "$out.new" && mkdir -p "$out.new"
		for m in "$r"/rtrs-core.ko "$r"/rtrs-client.ko "$r"/rtrs-server.ko \
			"$n"/rnbd-client.ko "$n"/rnbd-server.ko; do
			cp "$m" "$out.new/"
		done
		touch "$out.new/.ok"
		rm -rf "$out" && mv "$out.new" "$out"
		vm_log "kernel RTRS/RNBD modules built in $(vm_since "$t0") s: $out"
	) 8>"$RTRS_VM_CACHE/kmod/.lock"
	mkdir -p "$RTRS_VM_WORK/kmod"
	cp "$out"/*.ko "$RTRS_VM_WORK/kmod/"
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

vm_port_active() { ibv_devinfo -d "$1" 2>/dev/null | grep -q PORT_ACTIVE; }

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
vm_tcp_listening() { ss -Hltn "sport = :$1" | grep -q .; }

# vm_insmod FILE [PARAM=VALUE...]: load a module unless a module of that name is loaded.
vm_insmod() {
	local name
	name=$(basename "$1")
	name=${name%%.ko*}
	[ -d "/sys/module/${name//-/_}" ] && return 0
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
