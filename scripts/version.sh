#!/usr/bin/env bash
# Prints the version a build of this checkout carries, in Debian's syntax, from `git describe`:
#   tag v1.2.3 on HEAD           1.2.3
#   5 commits after v1.2.3       1.2.3+5.g7b7e44b
#   no v* tag yet                0.0~git20261124.203913.7b7e44b   (HEAD's commit time, UTC)
#   uncommitted changes          the above, then +dirty (on a tag itself: 1.2.3+0.dirty, so
#                                that it sorts below the next commit's 1.2.3+1.g…); new files
#                                not ignored by .gitignore count, as the packages take them
# Versions sort as the commits do (a later commit, a later version), so a package built from a
# newer checkout upgrades an older one. Outside a git checkout it fails.
# Usage: scripts/version.sh [DIR]   (DIR: the checkout, the repository's by default)
set -euo pipefail
dir=${1:-$(dirname "$0")/..}
git -C "$dir" rev-parse --git-dir >/dev/null 2>&1 || { echo "version.sh: $dir is not a git checkout" >&2; exit 1; }
dirty=
[ -z "$(git -C "$dir" status --porcelain --untracked-files=normal)" ] || dirty=+dirty
d=$(git -C "$dir" describe --tags --match 'v[0-9]*' --long --abbrev=7 2>/dev/null) || d=
if [ -n "$d" ]; then
	# vX.Y.Z-N-gHASH
	hash=${d##*-}
	rest=${d%-*}
	n=${rest##*-}
	tag=${rest%-*}
	v=${tag#v}
	case $v in *[!0-9A-Za-z.+~]* | [!0-9]*) echo "version.sh: tag $tag is not a Debian upstream version" >&2; exit 1 ;; esac
	if [ "$n" != 0 ]; then
		v="$v+$n.$hash"
	elif [ -n "$dirty" ]; then
		dirty=+0.dirty
	fi
else
	v="0.0~git$(TZ=UTC git -C "$dir" log -1 --date=format-local:%Y%m%d.%H%M%S --format=%cd HEAD).$(git -C "$dir" rev-parse --short=7 HEAD)"
fi
echo "$v$dirty"
