#!/usr/bin/env bash
# CPU Adam vs torch.optim.AdamW(fused=True) on CPU, same machine, same run, same thread count:
# (a) the plain fp32 step, (b) the offload step (bf16 grads in, fp32 master and moments updated,
# bf16 weights out), next to the memory bandwidth measured by a large copy in the same run.
# usage: bench/cpu_adam.sh [build-dir=build] [n=100000000] [repeats=7] [threads="1 2"] [paths=auto,avx2]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
n=${2:-100000000}
repeats=${3:-7}
threads=${4:-1 2}
paths=${5:-auto,avx2}
py=${COLOSSAL_PYTHON:-$root/.venv/bin/python}
bin=$build/bench/bench_cpu_adam
[[ -x $bin ]] || { echo "build $bin first: ninja -C $build bench_cpu_adam" >&2; exit 1; }
out=$(mktemp "${TMPDIR:-/tmp}/cpu_adam_bench.XXXXXX")
trap 'rm -f "$out"' EXIT
echo "# $(date -u +%FT%TZ) $(uname -n) $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p');" \
  "n=$n, median of $repeats; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for t in $threads; do
  "$bin" "$n" "$t" "$repeats" "$paths" | tee -a "$out"
  "$py" "$root/bench/cpu_adam.py" "$n" "$t" "$repeats" | tee -a "$out"
done
"$py" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for t in sorted({r["threads"] for r in rows}):
    r = {(d["impl"], d["mode"]): d for d in rows if d["threads"] == t}
    bw = max(d["gb_per_s"] for (i, m), d in r.items() if m == "copy")
    print(f"threads={t}: copy bandwidth {bw:.1f} GB/s (best of ATen copy_, memcpy, torch copy_)")
    ours = [k for k in r if k[0].startswith("cpu_adam_")]
    for mode in ("fp32", "bf16"):
        torch_s = r[("torch_adamw_fused", mode)]["median_s"]
        aten_s = r[("aten_fused_adamw", mode)]["median_s"]
        for impl in sorted({i for i, m in ours if m == mode}):
            d = r[(impl, mode)]
            print(f"  {mode:4s} {impl:16s} {d['median_s']*1e3:7.1f} ms  {d['elems_per_s']/1e9:5.3f} Gparam/s"
                  f"  {d['gb_per_s']:5.1f} GB/s = {100*d['gb_per_s']/bw:3.0f}% of copy"
                  f"  {torch_s/d['median_s']:.2f}x torch, {aten_s/d['median_s']:.2f}x ATen fused (interleaved)")
        for impl in ("torch_adamw_fused", "aten_fused_adamw"):
            d = r[(impl, mode)]
            print(f"  {mode:4s} {impl:16s} {d['median_s']*1e3:7.1f} ms  {d['elems_per_s']/1e9:5.3f} Gparam/s"
                  f"  {d['gb_per_s']:5.1f} GB/s = {100*d['gb_per_s']/bw:3.0f}% of copy")
PY
