#!/usr/bin/env python3
"""Per-kernel GPU times of one bench_kernels --op attention run under Nsight Compute.

device_bench.sh's attnkt phase runs
    ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none ...
        bench_kernels --op attention --attn_case C
and this script reads that CSV log: every launch's kernel, grid and duration. It prints, per
(kernel, grid) pair in order of first launch, the launches seen and their median time in µs, so
a backward splits into its parts (delta, main kernel, dQ convert for ours; cuDNN's own kernels
for SDPA's rows). Dense and packed-document launches of one kernel differ in grid, so they land
in different lines; kernels whose grid follows the token count (delta, convert) are shared.
Usage:
    scripts/attn_kernel_times.py NCU_CSV [--top N]
"""
import argparse
import collections
import csv
import re
import statistics
import sys


def short_name(name):
    """A readable kernel name: the function without its template arguments, and for our
    attention kernels the head dim and flags that tell them apart."""
    base = name.replace("(anonymous namespace)::", "")
    base = re.sub(r"^void ", "", base)
    base = re.split(r"[<(]", base)[0].split("::")[-1]
    m = re.search(r"(Fwd|Bwd)Traits<(\d+)", name)
    if m:
        base += " d%s" % m.group(2)
    return base[:90]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    lines = open(args.csv, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit("attn_kernel_times: no ncu CSV header in %s (did ncu run?)" % args.csv)
    times = collections.OrderedDict()
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit)
        if scale is None:
            sys.exit("attn_kernel_times: unknown unit %r" % unit)
        key = (short_name(row["Kernel Name"]), row.get("Grid Size", "?"))
        times.setdefault(key, []).append(ns * scale)
    if not times:
        sys.exit("attn_kernel_times: no gpu__time_duration rows in %s" % args.csv)
    print("%-92s %-16s %6s %10s" % ("kernel", "grid", "calls", "median us"))
    for (name, grid), v in list(times.items())[: args.top]:
        print("%-92s %-16s %6d %10.1f" % (name, grid, len(v), statistics.median(v)))


if __name__ == "__main__":
    main()
