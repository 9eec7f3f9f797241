#!/usr/bin/env bash
# One call on the GPU machine: build, `colossal check`, the CUDA paths of the unit tests, and a
# short bf16 training run on the GPU. Logs go to $OUT (the device tool's output folder) when set.
#   scripts/device_check.sh            (carry .carry/gloo for the Gloo headers)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
step() { echo; echo "=== $*"; }
step build
if ! TARGETS="colossal_cli test_nccl test_optim_state test_grad_scaler test_accelerator test_nn_module" \
     BUILD=$BUILD scripts/device_build.sh -DCOLOSSAL_WERROR=OFF > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; exit 1
fi
tail -2 "$OUT/build.log"
C=$BUILD/colossal
step check
$C check
step unit tests with CUDA cases
for t in tests/optim/test_optim_state tests/amp/test_grad_scaler tests/dist/test_accelerator tests/nn/test_nn_module; do
  $BUILD/$t > "$OUT/$(basename $t).log" 2>&1 && echo "PASS $t" || { echo "FAIL $t"; tail -30 "$OUT/$(basename $t).log"; }
done
step NCCL collectives, 1 rank per GPU
$C run --nproc_per_node "$(nvidia-smi -L | wc -l)" --master_port 0 $BUILD/tests/dist/test_nccl 2>&1 | tail -4
step bf16 training on cuda through colossal run + ddp
$C demo-data --out /tmp/cc_demo --tokens 4000000 >/dev/null 2>&1
for preset in tiny 100m; do
  $C run --nproc_per_node 1 --master_port 0 $C train --model $preset --data /tmp/cc_demo/train.bin --seq_len 512 \
    --micro_batch 8 --steps 30 --warmup 5 --lr 3e-4 --device cuda --precision bf16 --plugin ddp --log_every 10 \
    --metrics_file "$OUT/train_$preset.jsonl" 2>&1 | tail -5
done
