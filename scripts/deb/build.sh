#!/usr/bin/env bash
# Builds the Debian packages rtrs-serverd and rtrs-clientd (amd64, the verbs provider built in)
# from this checkout, uncommitted changes included, with debian/ and dpkg-buildpackage. The
# version is scripts/version.sh's (from git describe); debian/changelog is written for it.
# Installs what the build needs (dpkg-dev, debhelper, rdma-core's development files, a Go new
# enough for go.mod) when it is missing.
# Usage: scripts/deb/build.sh [OUTDIR]   (dist/ by default): the .deb files, .changes, .buildinfo.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-dist}
need=()
for p in dpkg-dev debhelper golang-go libibverbs-dev librdmacm-dev pkgconf; do
	dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
scripts/apt-install.sh ${need[@]+"${need[@]}"}
. scripts/go-toolchain.sh
rtrs_use_go
version=$(scripts/version.sh)
work=$(mktemp -d /tmp/rtrs-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
src=$work/rtrs
mkdir -p "$src"
scripts/deb/copy-tree.sh "$src"
when=$(git log -1 --format=%ct HEAD)
cat >"$src/debian/changelog" <<CL
rtrs ($version) bookworm; urgency=medium

  * Built from $(git describe --always --dirty --abbrev=12):
    $(git log -1 --format=%s HEAD | cut -c1-72)

 -- rtrs developers <maintainers@users.noreply.a-seed-fe787eb3.example>  $(date -u -R -d "@$when")
CL
echo "deb: building rtrs $version in $src"
(
	cd "$src"
	GO=$(command -v go) GOTOOLCHAIN=local GOCACHE=$(go env GOCACHE) GOMODCACHE=$(go env GOMODCACHE) \
		GOPATH=$(go env GOPATH) GOFLAGS=-modcacherw GOPROXY=$(go env GOPROXY) \
		dpkg-buildpackage -b -us -uc
) >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; echo "deb: dpkg-buildpackage failed" >&2; exit 1; }
mkdir -p "$out"
rm -f "$out"/rtrs-*.deb "$out"/rtrs_*.changes "$out"/rtrs_*.buildinfo
cp "$work"/*.deb "$work"/*.changes "$work"/*.buildinfo "$out"/
cp "$work/build.log" "$out/rtrs_${version}_build.log"
echo "deb: $(cd "$out" && ls rtrs-*.deb | tr '\n' ' ')in $(cd "$out" && pwd)"
