#!/usr/bin/env python3
"""Per-kernel GPU times of one bench_kernels --op attention run under Nsight Compute.

device_bench.sh's attnkt phase runs
    ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none ...
        bench_kernels --op attention --attn_case C
and this script reads that CSV log: every launch's kernel, grid and duration, in launch order.
Each benchmark row is a run of the same call repeated (warm-up and timed repetitions), so the
sequence cuts into runs of one repeating pattern; per run it prints the sum of the kernels'
median times in µs, the repetitions, and each kernel's median, so a backward splits into its
parts (delta, main kernel, dQ convert for ours; cuDNN's own kernels for SDPA's rows), and the
persistent forward (one grid for every row) is told apart by its place in the sequence.
Usage:
    scripts/attn_kernel_times.py NCU_CSV [--min_us 5]
"""
import argparse
import csv
import re
import statistics
import sys


def short_name(name):
    """A readable kernel name: the function without its template arguments, and for our
    attention kernels the traits and flags that tell them apart (forward: head dim, key tile,
    stages, then causal, overlap, pingpong; backward: head dim, query tile, dq_tma, then
    causal, deterministic, dq_tma)."""
    base = re.sub(r"\(anonymous namespace\)::|<unnamed>::", "", name)
    base = re.sub(r"^void ", "", base)
    fn = re.split(r"[<(]", base)[0].split("::")[-1]
    m = re.search(r"(Fwd|Bwd)Traits<([\d, ]+)>((?:, *\d+)+)", base)
    if m:
        fn += " <%s>%s" % (m.group(2).replace(" ", ""), m.group(3).replace(" ", ""))
    else:
        m = re.search(r"<(\d+)>\(", base)
        if m:
            fn += " <%s>" % m.group(1)
    return fn[:90]


def segments(launches, min_us):
    """The launch sequence cut into runs that repeat one pattern: a benchmark row is warm-up and
    timed repetitions of the same call (forward: one kernel; forward+backward: forward, delta,
    main, convert), so each run is one row. Launches under min_us (fills) are left out."""
    seq = [(k, t) for k, t in launches if t >= min_us]
    out, i = [], 0
    while i < len(seq):
        keys = [seq[i][0]]
        j = i + 1
        while j < len(seq) and seq[j][0] != seq[i][0]:
            keys.append(seq[j][0])
            j += 1
        period = len(keys)
        j = i
        while j < len(seq) and seq[j][0] == keys[(j - i) % period]:
            j += 1
        if j - i < 2 * period:  # no repetition starts here: a launch of its own
            out.append(([seq[i][0]], [[seq[i][1]]]))
            i += 1
            continue
        run = seq[i:j]
        out.append((keys, [[t for k, t in run[p::period]] for p in range(period)]))
        i = j
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--min_us", type=float, default=5.0)
    args = ap.parse_args()
    lines = open(args.csv, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit("attn_kernel_times: no ncu CSV header in %s (did ncu run?)" % args.csv)
    launches = []
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            value = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                 "ms": 1e3}.get(unit)
        if scale is None:
            sys.exit("attn_kernel_times: unknown unit %r" % unit)
        key = "%s %s" % (short_name(row["Kernel Name"]), row.get("Grid Size", "?").replace(" ", ""))
        launches.append((key, value * scale))
    if not launches:
        sys.exit("attn_kernel_times: no gpu__time_duration rows in %s" % args.csv)
    # One line per run of repeated calls (a benchmark row): each kernel's median and the sum.
    for keys, times in segments(launches, args.min_us):
        if len(times[0]) < 2:
            continue  # set-up launches (input fills), not a timed row
        parts = ["%s %.1f" % (k, statistics.median(t)) for k, t in zip(keys, times)]
        total = sum(statistics.median(t) for t in times)
        print("%8.1f us x%-3d | %s" % (total, len(times[0]), " | ".join(parts)))


if __name__ == "__main__":
    main()
