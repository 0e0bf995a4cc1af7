# shellcheck shell=bash
# Smoke test of the VM bed itself: rxe's verbs features, perftest over plain verbs and over
# rdma_cm on both paths, rping, and the kernel's own RTRS/RNBD modules loading.

# Host: the kernel's RTRS/RNBD modules (cached; copied into $RTRS_VM_WORK/kmod).
host() {
	vm_build_kernel_rtrs
}

# perf SERVER-ARGS... -- CLIENT-ARGS...: one perftest (or rping) pair on rxe0; the server runs
# in the background, the client against it; both must succeed. Prints both outputs and the time.
perf() {
	local srv=() t0 rc=0 src=0
	while [ "$1" != -- ]; do
		srv+=("$1")
		shift
	done
	shift
	echo "== server: ${srv[*]}"
	echo "== client: $*"
	t0=$(vm_now)
	"${srv[@]}" >/tmp/server.log 2>&1 &
	# The server is ready once it listens, over TCP (perftest without -R) or rdma_cm (-R, rping).
	vm_wait 20 vm_listening || {
		cat /tmp/server.log
		return 1
	}
	timeout 120 "$@" || rc=$?
	wait $! || src=$?
	echo "-- server output:"
	cat /tmp/server.log
	echo "== client rc=$rc, server rc=$src, $(vm_since "$t0") s"
	[ "$rc" = 0 ] && [ "$src" = 0 ]
}
vm_listening() { vm_tcp_listening 18515 || rdma res show cm_id | grep LISTEN >/dev/null; }

guest() {
	local A1=$RTRS_VM_ADDR1 A2=$RTRS_VM_ADDR2 D=$RTRS_VM_DEV
	ibv_devinfo -v -d "$D" >/tmp/devinfo
	grep -E 'MEM_WINDOW|max_mw:|max_qp_rd_atom:' /tmp/devinfo
	grep -q MEM_WINDOW_TYPE_2B /tmp/devinfo

	# Plain verbs, out-of-band exchange over TCP.
	# (1000 iterations each: perftest's default of 5000 took 10 to 12 s here, for a check.)
	perf ib_write_bw -d "$D" -F -n 1000 -- ib_write_bw -d "$D" -F -n 1000 "$A1"
	# rdma_cm (what RTRS uses), then from the second address: the second path.
	perf ib_write_bw -d "$D" -F -R -n 1000 -- ib_write_bw -d "$D" -F -R -n 1000 "$A1"
	perf ib_write_bw -d "$D" -F -R -n 1000 -- \
		ib_write_bw -d "$D" -F -R -n 1000 --source_ip "$A2" "$A1"
	# The forms later compared with the project's rdma-perf (1 MiB: 100 iterations, ~7 s here).
	perf ib_write_bw -d "$D" -F -R --report_gbits -s 1048576 -n 100 -- \
		ib_write_bw -d "$D" -F -R --report_gbits -s 1048576 -n 100 "$A1"
	perf ib_send_lat -d "$D" -F -R -s 8 -- ib_send_lat -d "$D" -F -R -s 8 "$A1"
	# librdmacm's own ping, both paths.
	perf rping -s -a "$A1" -C 3 -v -- rping -c -a "$A1" -C 3 -v
	perf rping -s -a "$A1" -C 3 -v -- rping -c -a "$A1" -I "$A2" -C 3 -v

	# The kernel's RTRS/RNBD, built on the host: load them and see their sysfs classes.
	vm_load_kernel_rtrs
	ls /sys/class/rtrs-client /sys/class/rtrs-server /sys/class/rnbd-client
	test -d /sys/class/rtrs-client
}
