#!/usr/bin/env bash
# examples/text: from text to a trained model and back, on CPU.
#   1. corpus + tokenizer: this Python's standard library source, a byte-level BPE trained on it
#   2. colossal prepare:   the corpus -> token file + document index
#   3. colossal train:     a 4-layer Llama on 2 CPU ranks (ddp), with an HTML report
#   4. colossal generate:  the same prompt before training (1 step) and after
# Run after `make` (about 5-10 minutes on 2 cores). OUT (default out/text) and STEPS (300)
# may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
C=${COLOSSAL:-build/colossal}
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/text}
STEPS=${STEPS:-300}
mkdir -p $OUT
echo "== 1/4 corpus and tokenizer"
$PY examples/text/make_tokenizer.py $OUT
echo "== 2/4 prepare"
$C prepare --tokenizer $OUT/tokenizer --out $OUT/data/train.bin $OUT/corpus.jsonl
echo "== 3/4 train ($STEPS steps, 2 CPU ranks)"
# "Untrained": one step at a negligible learning rate, saved as the trained one will be.
$C run --nproc_per_node 1 $C train --config examples/text/train.toml --data $OUT/data/train.bin \
  --steps 1 --warmup 0 --lr 1e-9 --save_dir $OUT/untrained \
  --metrics_file $OUT/untrained/metrics.jsonl --report false --overwrite > $OUT/untrained.log 2>&1
$C run --nproc_per_node 2 $C train --config examples/text/train.toml --data $OUT/data/train.bin \
  --steps $STEPS --warmup $((STEPS / 10)) --save_dir $OUT/run --metrics_file $OUT/run/metrics.jsonl \
  --overwrite
echo "== 4/4 generate (greedy, 48 tokens)"
PROMPT='def main(argv):
    '
for run in untrained run; do
  model=$(ls -d $OUT/$run/step-* | tail -1)/model
  echo "--- $run ($model):"
  $C generate --model $model --tokenizer $OUT/tokenizer --prompt "$PROMPT" --max-new-tokens 48 \
    --repetition-penalty 1.1 2>/dev/null | sed 's/^/    /'
done
echo "report: $OUT/run/report.html"
