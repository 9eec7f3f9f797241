#!/usr/bin/env bash
# Packs every side of a docs/wip check for one device call: the committed tree's binaries as
# build-carry-old (A), then each patch applied in turn (and left applied) with its binaries:
# build-carry-<patch name> for all but the last, build-carry for the last. Carry them all and
# compare them in one call (device_bench.sh's PREBUILT=<folder> and ATTNAB_OLD="<folders>";
# docs/wip/README.md names each patch's command). Patches that build on each other are listed in
# the order they apply.
# Usage: scripts/wip_ab_pack.sh docs/wip/A.patch [docs/wip/B.patch ...] [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/wip_ab_pack.sh docs/wip/NAME.patch [more patches, in order] [build-dir]"
patches=()
B=build
for a in "$@"; do
  case "$a" in
    *.patch) patches+=("$a") ;;
    *) B=$a ;;
  esac
done
[ ${#patches[@]} -gt 0 ] || { echo "$usage" >&2; exit 1; }
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "wip_ab_pack: the working tree has uncommitted changes; A must be the committed tree" >&2
  exit 1
fi
[ -f "$B/build.ninja" ] || { echo "wip_ab_pack: no build in $B (run make build first)" >&2; exit 1; }
# Every patch must apply on top of the ones before it: checked before anything is built.
git apply --check "${patches[0]}"
echo "== A: the committed tree ($(git rev-parse --short HEAD))"
BUILD_FIRST=1 scripts/device_pack.sh "$B"
rm -rf build-carry-old
mv build-carry build-carry-old
made=(build-carry-old)
last=$((${#patches[@]} - 1))
for i in "${!patches[@]}"; do
  p=${patches[$i]}
  if ! git apply "$p"; then
    echo "wip_ab_pack: $p does not apply on top of the patches before it" >&2
    exit 1
  fi
  echo "== with ${patches[*]:0:$((i + 1))} applied (left applied in the working tree)"
  BUILD_FIRST=1 scripts/device_pack.sh "$B"
  if [ "$i" -lt "$last" ]; then
    name=$(basename "$p" .patch)
    rm -rf "build-carry-$name"
    mv build-carry "build-carry-$name"
    made+=("build-carry-$name")
  else
    made+=(build-carry)
  fi
done
du -sh "${made[@]}"
