#!/usr/bin/env bash
# Copies the binaries a device call needs from a local build into build-carry/ (git-ignored),
# stripped and xz-compressed, so the GPU machine can skip its own build: pass build-carry in `carry` and start
# scripts/device_bench.sh with the `prebuilt` phase. Usage: scripts/device_pack.sh [build-dir]
# (BUILD_FIRST=1: build those binaries in build-dir first).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
BINARIES="colossal tests/kernels/test_kernels tests/kernels/test_kernels_cuda tests/kernels/test_attention_cuda tests/kernels/test_model_cuda tests/kernels/test_vocab_ce_cuda tests/nn/test_nn_ring_blocks
          tests/zero/test_gemini_1rank tests/zero/test_zero_1rank tests/booster/test_step_overlap tests/pipeline/test_pipeline_stages tests/pipeline/test_pipeline_executor tests/checkpoint/test_async_writer
          bench/bench_kernels"
# shellcheck disable=SC2086  # one binary per word
[ "${BUILD_FIRST:-0}" = 1 ] && ninja -C "$B" $BINARIES
rm -rf build-carry
mkdir -p build-carry/tests/kernels build-carry/tests/nn build-carry/tests/zero build-carry/tests/booster build-carry/tests/pipeline build-carry/tests/checkpoint build-carry/bench
for f in $BINARIES; do
  cp "$B/$f" "build-carry/$f"
  strip --strip-unneeded "build-carry/$f"
done
# Libraries from this machine's apt packages that the GPU machine's image lacks (SentencePiece
# and its protobuf, PCRE2, ICU): carried next to the binaries; device_bench.sh's prebuilt phase
# puts build-carry/lib on the loader path.
mkdir -p build-carry/lib
for f in $(find build-carry -type f -perm -u+x); do
  ldd "$f" 2>/dev/null | awk '/=> \// {print $3}' | grep -E 'sentencepiece|protobuf|pcre2|icu' || true
done | sort -u | while read -r lib; do cp -L "$lib" build-carry/lib/; done
# One xz archive (the stripped binaries are ~68 MB, more than a call's 64 MiB `carry` allows next
# to .carry/): device_bench.sh's prebuilt phase unpacks it in place.
tar -C build-carry -cf - colossal tests bench lib | xz -6 -T2 > build-carry.tar.xz
rm -rf build-carry/*
mv build-carry.tar.xz build-carry/binaries.tar.xz
du -sh build-carry
