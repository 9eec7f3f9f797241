#!/usr/bin/env bash
# Copies the binaries a device call needs from a local build into build-carry/ (git-ignored),
# stripped, so the GPU machine can skip its own build: pass build-carry in `carry` and start
# scripts/device_bench.sh with the `prebuilt` phase. Usage: scripts/device_pack.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
rm -rf build-carry
mkdir -p build-carry/tests/kernels build-carry/tests/zero build-carry/tests/pipeline build-carry/tests/checkpoint build-carry/bench
for f in colossal tests/kernels/test_kernels tests/kernels/test_kernels_cuda tests/kernels/test_model_cuda tests/kernels/test_vocab_ce_cuda \
         tests/zero/test_gemini_1rank tests/zero/test_zero_1rank tests/pipeline/test_pipeline_stages tests/pipeline/test_pipeline_executor tests/checkpoint/test_async_writer \
         bench/bench_kernels; do
  cp "$B/$f" "build-carry/$f"
  strip --strip-unneeded "build-carry/$f"
done
du -sh build-carry
