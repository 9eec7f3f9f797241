#!/usr/bin/env bash
# Packs both sides of a docs/wip patch's check for one device call: the committed tree's
# binaries as build-carry-old (A), then, with the patch applied to the working tree (and left
# applied), its binaries as build-carry (B). Carry both and compare them in one call with
# device_bench.sh's PREBUILT=build-carry-old (docs/wip/README.md names each patch's command).
# Usage: scripts/wip_ab_pack.sh docs/wip/NAME.patch [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
P=${1:?usage: scripts/wip_ab_pack.sh docs/wip/NAME.patch [build-dir]}
B=${2:-build}
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "wip_ab_pack: the working tree has uncommitted changes; A must be the committed tree" >&2
  exit 1
fi
[ -f "$B/build.ninja" ] || { echo "wip_ab_pack: no build in $B (run make build first)" >&2; exit 1; }
git apply --check "$P"
echo "== A: the committed tree ($(git rev-parse --short HEAD))"
BUILD_FIRST=1 scripts/device_pack.sh "$B"
rm -rf build-carry-old
mv build-carry build-carry-old
echo "== B: with $P applied (left applied in the working tree)"
git apply "$P"
BUILD_FIRST=1 scripts/device_pack.sh "$B"
echo "A: build-carry-old, B: build-carry ($(du -sh build-carry-old build-carry | awk '{print $1}' | paste -sd' '))"
