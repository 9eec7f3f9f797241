#!/usr/bin/env bash
# Loading a ~1 GB safetensors checkpoint: colossal's loader vs Python safetensors + torch, same
# file, page cache warm for both, median of several repeats.
# usage: bench/checkpoint_load.sh [build-dir=build] [size-MB=1024] [repeats=5]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
mb=${2:-1024}
repeats=${3:-5}
py=${COLOSSAL_PYTHON:-$root/.venv/bin/python}
bin=$build/bench/bench_checkpoint_load
[[ -x $bin ]] || { echo "build $bin first: ninja -C $build bench_checkpoint_load" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
file=$work/model.safetensors
# A Llama-like mix: bf16 matrices of 8 MB plus small fp32 norms, about $mb MB in all.
"$py" - "$file" "$mb" <<'PY'
import sys, torch
from safetensors.torch import save_file
path, mb = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
t, total, i = {}, 0, 0
while total < mb * 2**20:
    t[f"layers.{i}.w"] = torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
    t[f"layers.{i}.norm"] = torch.ones(2048)
    total += 2048 * 2048 * 2 + 2048 * 4
    i += 1
save_file(t, path, metadata={"format": "pt"})
PY
cat "$file" > /dev/null  # warm the page cache
echo "# $(date -u +%FT%TZ) $(uname -n) $(nproc) cores; file $(du -m "$file" | cut -f1) MB; median of $repeats" >&2
out=$work/results.jsonl
"$bin" "$file" "$repeats" | tee "$out"
"$py" "$root/bench/checkpoint_load.py" "$file" "$repeats" | tee -a "$out"
"$py" - "$out" <<'PY'
import json, sys
r = {(d["impl"], d["mode"]): d["median_s"] for d in map(json.loads, open(sys.argv[1]))}
def ratio(a, b):
    return f"{r[b] / r[a]:.2f}x" if a in r and b in r else "n/a"
print(f"mapped (views, no data read):   python {r[('python','mapped')]*1e3:.2f} ms / cpp {r[('cpp','mapped')]*1e3:.2f} ms = cpp {ratio(('cpp','mapped'), ('python','mapped'))} faster")
print(f"mapped + every page touched:    python {r[('python','mapped_touch')]*1e3:.1f} ms / cpp {r[('cpp','mapped_touch')]*1e3:.1f} ms = cpp {ratio(('cpp','mapped_touch'), ('python','mapped_touch'))} faster")
print(f"materialized (owned tensors):   python pread {r[('python','pread')]*1e3:.1f} ms, python clone {r[('python','clone')]*1e3:.1f} ms / cpp copy {r[('cpp','copy')]*1e3:.1f} ms = cpp {ratio(('cpp','copy'), ('python','pread'))} vs pread, {ratio(('cpp','copy'), ('python','clone'))} vs clone")
PY
