#!/usr/bin/env bash
# Installs Debian packages for the project's scripts (as root): says what it installs, lets
# apt-get show its own list, and waits for another package manager (unattended-upgrades,
# cloud-init, a second test run) instead of failing when it holds a lock. apt-get waits for
# dpkg's lock itself (DPkg::Lock::Timeout) but not for the package lists' or the archive
# cache's, so a run that fails on a held lock is tried again until the same deadline.
# Usage: scripts/apt-install.sh [--update | --no-update] package...
#   --update: only `apt-get update`; --no-update: install from the package lists as they are.
#   RTRS_APT_WAIT: seconds to wait for a lock, 600 by default.
set -euo pipefail
update=1 install=1
case ${1:-} in
--update) install=0 && shift ;;
--no-update) update=0 && shift ;;
esac
[ $# -gt 0 ] || [ "$install" = 0 ] || exit 0
if [ "$(id -u)" != 0 ]; then
	if [ "$install" = 0 ]; then echo "apt-get update: run as root" >&2; else echo "missing $*; run as root or install them" >&2; fi
	exit 1
fi
wait_s=${RTRS_APT_WAIT:-600}
deadline=$((SECONDS + wait_s))
export DEBIAN_FRONTEND=noninteractive
out=$(mktemp)
trap 'rm -f "$out"' EXIT

aptget() { # apt-get "$@", again while another process holds one of apt's locks
	while :; do
		if apt-get -q -o DPkg::Lock::Timeout="$wait_s" "$@" 2>&1 | tee "$out"; then
			return 0
		fi
		if ! grep -q 'Could not get lock' "$out" || [ "$SECONDS" -ge "$deadline" ]; then
			return 1
		fi
		echo "apt-get: another process holds the lock (above); trying again in 5 s" >&2
		sleep 5
	done
}

if [ "$install" = 0 ]; then
	aptget update
	exit
fi
pkgs=$(printf '%s\n' "$@" | sort -u | tr '\n' ' ')
echo "installing with apt-get: $pkgs"
[ "$update" = 0 ] || aptget update
# shellcheck disable=SC2086 # one word per package
aptget install -y --no-install-recommends $pkgs
