#!/usr/bin/env python3
"""The medians of device_bench.sh attnab's interleaved rounds (ATTNAB_REPS > 1), per build.

Reads the rows attnab wrote to the summary ("<build>#<round>  <case> ... <dir>  <ms> ..."),
and prints, per case and direction, each build's rounds, their median and its ratio to the
reference build's median (--ref; else this build's "l2_24" rows, else its first L2 budget's,
else the first build seen), plus
the spread ((max - min) / median) of each build's rounds. Usage:
    scripts/attnab_medians.py SUMMARY [--ref BUILD] [--rows REGEX]
"""
import argparse
import collections
import re
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("summary")
    ap.add_argument("--ref", default="")
    ap.add_argument("--rows", default="", help="keep rows whose case and direction match")
    args = ap.parse_args()
    rows = collections.OrderedDict()
    builds = []
    pat = re.compile(r"^(\S+)#(\d+)\s+(W\S+ .*?)\s+(fwd\+bwd|fwd)\s+([\d.]+)\s")
    with open(args.summary) as f:
        for line in f:
            m = pat.match(line)
            if not m:
                continue
            build, _, case, direction, ms = m.groups()
            case = re.sub(r"\s+", " ", case.strip())
            if args.rows and not re.search(args.rows, case + " " + direction):
                continue
            rows.setdefault((case, direction), collections.defaultdict(list))[build].append(float(ms))
            if build not in builds:
                builds.append(build)
    if not rows:
        print("attnab medians: no interleaved rows (ATTNAB_REPS > 1) in", args.summary)
        return
    l2 = [b for b in builds if b.startswith("l2_")]
    ref = args.ref or ("l2_24" if "l2_24" in builds else (l2[0] if l2 else builds[0]))
    print("attnab medians (ms; ratio to %s; spread of the rounds)" % ref)
    for (case, direction), by_build in rows.items():
        base = statistics.median(by_build[ref]) if by_build.get(ref) else None
        cells = []
        for b in builds:
            v = by_build.get(b)
            if not v:
                continue
            med = statistics.median(v)
            ratio = " x%.3f" % (med / base) if base and b != ref else ""
            cells.append("%s %.3f%s (%.0f%%)" % (b, med, ratio, 100 * (max(v) - min(v)) / med))
        print("  %s %s: %s" % (case, direction, "; ".join(cells)))


if __name__ == "__main__":
    main()
