#!/usr/bin/env bash
# The demo: both daemons on this machine, a 1 GiB tmpfs-backed export mapped over two paths on
# loopback (127.0.0.1 and 127.0.0.2). Ctrl-C stops them cleanly and removes what the demo made
# (mounts, socket, config, the export; RTRS_DEMO_KEEP=1 keeps the export). Needs root (FUSE
# mounts) and Go.
set -euo pipefail
# Piped into another program (`make demo | tee log`) that Ctrl-C stops first: writes to the
# dead pipe must fail, not kill the script before it has stopped the daemons.
trap '' PIPE
cd "$(dirname "$0")/.."
# Go as go.mod asks for it (fetched through the Go module proxy if the go found is older).
. scripts/go-toolchain.sh
rtrs_use_go
if [ "$(id -u)" != 0 ]; then
	echo "the demo mounts FUSE trees: run it as root" >&2
	exit 1
fi
go build -o bin/ ./cmd/rtrs-serverd ./cmd/rtrs-clientd

run=/run/rtrs-demo
exports=/dev/shm/rtrs-demo-exports
mkdir -p "$run" "$exports"
[ -e "$exports/disk" ] || truncate -s 1G "$exports/disk"
# The client's config: what to map; the daemon writes back what changes at runtime.
cat >"$run/rtrs-clientd.conf" <<CONF
# demo: one session over two loopback paths, one device
map_device sessname=demo device_path=disk dest_port=11234 path=ip:127.0.0.1@ip:127.0.0.1 path=ip:127.0.0.2@ip:127.0.0.1
CONF

pids=()
stop() {
	trap - INT TERM EXIT
	set +e # everything below runs, whatever fails
	echo
	echo "stopping"
	# The client first, so that its sessions close before the server goes.
	for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
		kill -TERM "${pids[i]}" 2>/dev/null || true
		wait "${pids[i]}" 2>/dev/null || true
	done
	bin/rtrs-clientd -cleanup -mount "$run/rtrs-client" -dev-mount "$run/dev" || true
	bin/rtrs-serverd -cleanup -mount "$run/rtrs-server" -rnbd-mount "$run/rnbd-server" || true
	rm -rf "$run"
	if [ -z "${RTRS_DEMO_KEEP:-}" ]; then
		rm -rf "$exports"
	fi
	echo "stopped; nothing left behind${RTRS_DEMO_KEEP:+ but the export in $exports}"
}
trap stop INT TERM EXIT

bin/rtrs-serverd -config /dev/null -listen 127.0.0.1:11234 -dev-search-path "$exports" \
	-mount "$run/rtrs-server" -rnbd-mount "$run/rnbd-server" -names-file "$run/sessions.json" &
pids+=($!)
sleep 0.5
bin/rtrs-clientd -config "$run/rtrs-clientd.conf" -mount "$run/rtrs-client" -dev-mount "$run/dev" \
	-nbd-socket "$run/nbd.sock" &
pids+=($!)
for _ in $(seq 50); do [ -e "$run/dev/demo/disk" ] && break; sleep 0.2; done

cat <<TXT

rtrs demo is running.
  client tree   $run/rtrs-client   (/sys/class/rtrs-client's files)
  server tree   $run/rtrs-server   (/sys/class/rtrs-server's files)
  rnbd-server   $run/rnbd-server   (/sys/class/rnbd-server's: who has which export open)
  device        $run/dev/demo/disk (1 GiB on $exports/disk, over two paths)
  NBD           nbd+unix:///demo/disk?socket=$run/nbd.sock

Try:
  cat $run/rtrs-client/demo/paths/*/state $run/rtrs-client/demo/mpath_policy
  dd if=/dev/urandom of=$run/dev/demo/disk bs=1M count=64 conv=fsync; cat $run/rtrs-client/demo/paths/*/stats/rdma
  echo 1 > "$run/rtrs-client/demo/paths/ip:127.0.0.2@ip:127.0.0.1/disconnect"; ls $run/rtrs-server/demo/paths
  grep . $run/rnbd-server/ctl/devices/*/sessions/*/*

Ctrl-C stops both daemons.
TXT
wait
