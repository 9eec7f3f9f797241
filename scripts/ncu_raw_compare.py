#!/usr/bin/env python3
"""Side by side: the metrics of several Nsight Compute reports exported with `ncu -i REP --page raw
--csv` (device_bench.sh attnprof writes them as ncu_<case>_<what>_raw.csv), one column per file.
Prints the metrics whose names match --grep (a regex; a default set on time, throughput, the
tensor pipe, shared memory and the warps' stall reasons). Usage:
    scripts/ncu_raw_compare.py A_raw.csv B_raw.csv ... [--grep REGEX]
"""
import argparse
import csv
import os
import re

DEFAULT = (r"^gpu__time_duration.sum$|^sm__throughput.avg.pct|^sm__pipe_tensor_op_gmma.*pct|"
           r"^sm__inst_executed_pipe_.*pct|^l1tex__data_pipe_lsu_wavefronts_mem_shared.*pct|"
           r"^l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum$|^smsp__average_warp.*issue_stalled|"
           r"^smsp__warp_issue_stalled_.*_per_warp_active.pct$|^sm__warps_active.avg.pct|"
           r"^smsp__issue_active.avg.pct|^dram__throughput.avg.pct|^lts__t_sectors.*pct|"
           r"^launch__(registers_per_thread|grid_size|block_size|shared_mem_per_block)")


def load(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # The first row that names gpu__time_duration.sum is the header; the next the units, then
    # one row per profiled launch (the first is kept).
    for i, r in enumerate(rows):
        if "gpu__time_duration.sum" in r:
            head, units, vals = r, rows[i + 1], rows[i + 2]
            return {h: (v, u) for h, u, v in zip(head, units, vals)}
    raise SystemExit(f"{path}: no header with gpu__time_duration.sum")


ap = argparse.ArgumentParser()
ap.add_argument("files", nargs="+")
ap.add_argument("--grep", default=DEFAULT)
a = ap.parse_args()
reports = [load(f) for f in a.files]
names = sorted({k for r in reports for k in r if re.search(a.grep, k)})
w = max(len(n) for n in names) if names else 10
print(" " * w, *[os.path.basename(f).replace("_raw.csv", "")[:22].rjust(22) for f in a.files])
for n in names:
    unit = next((r[n][1] for r in reports if n in r), "")
    print(n.ljust(w), *[(r[n][0] if n in r else "-")[:22].rjust(22) for r in reports], unit)
