#!/usr/bin/env bash
# Copies the checkout's files as they are now into DEST: tracked and new ones (what the
# packages are built from, and what scripts/version.sh counts as dirty), not ignored ones,
# not .git, not tracked files deleted since.
# Usage: scripts/deb/copy-tree.sh DEST
set -euo pipefail
dest=${1:?usage: copy-tree.sh DEST}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
cd "$(dirname "$0")/../.."
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
	[ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$dest"
