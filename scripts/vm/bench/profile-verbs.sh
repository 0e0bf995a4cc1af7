# shellcheck shell=bash
# The guest side of the per-IO profile: scripts/profile-blk.sh run in the VM over verbs, fio (nbd
# engine) → rtrs-bench nbdclient → rtrs-bench blkserver → a tmpfs file, both processes on rxe0
# (10.99.0.1 to itself) with the verbs provider, 4 KiB randread and randwrite at QD1 and QD32.
# Per IO and per process: CPU, read and write syscalls, OS context switches, goroutine wake-ups
# (estimated) and calls into C (the verbs provider's count), in results/profile-verbs/profile.md; the CPU
# profiles stay beside it with the binary, for `go tool pprof -top` on the host. Reports;
# asserts nothing; kept out of CI's run.
#
# Run (root): PROFILE_SECS=10 RTRS_VM_RESULTS=DIR scripts/vmtest.sh -k 6.12 scripts/vm/bench/profile-verbs.sh
# (PROFILE_SECS, default 10, reaches the guest through a file host() writes.)

# shellcheck disable=SC2034 # read by vmtest.sh
SUITE_PACKAGES="libibverbs-dev librdmacm-dev fio"

host() {
	local secs=${PROFILE_SECS:-10}
	[[ $secs =~ ^[1-9][0-9]*$ ]] || vm_die "PROFILE_SECS=$secs: a whole number of seconds, at least 1"
	printf 'PROFILE_SECS=%s\n' "$secs" >"$RTRS_VM_WORK/profile-verbs.env"
	mkdir -p "$RTRS_VM_WORK/bin"
	(cd "$RTRS_VM_REPO" && go build -tags verbs -o "$RTRS_VM_WORK/bin/" ./cmd/rtrs-bench)
	cp "$RTRS_VM_REPO/scripts/profile-blk.sh" "$RTRS_VM_WORK/bin/"
}

guest() {
	local PROFILE_SECS
	# shellcheck source=/dev/null # written by host()
	. "$RTRS_VM_WORK/profile-verbs.env"
	# No perf: under TCG, perf enabling its events oopses the guest (profile-blk.sh).
	PROFILE_PERF=0 PROFILE_TOP=0 PROFILE_SECS=$PROFILE_SECS PROFILE_PROVIDER=verbs PROFILE_ADDR=$RTRS_VM_ADDR1 \
		PROFILE_BIN=$RTRS_VM_WORK/bin/rtrs-bench bash "$RTRS_VM_WORK/bin/profile-blk.sh" \
		"$RTRS_VM_WORK/results/profile-verbs"
}
