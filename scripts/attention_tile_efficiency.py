#!/usr/bin/env python3
"""What packed documents can reach in our attention kernels, by tile count alone (issue 25).

A 128 x 128 tile computes every (query, key) pair in it, masked ones too. This counts, for a
packing of documents into rows, the causal pairs that matter against the pairs the kernels'
tiles compute, and compares it with dense causal rows of the same token count (the goal:
documents at >= 90 % of the dense rate, counting each document's own causal FLOPs). It is an
upper bound set by the work decomposition, before any kernel speed or per-tile overhead.

Rows: W1's packing (8 x 2048) and W2's (1 x 4096). Documents: a document index's real lengths
(`colossal prepare`'s .docs file, e.g. the Python standard library's), packed as
bench/documents.h's pack_lengths cuts them, and a log-normal stand-in (median ~400, as
bench/documents.h's packed_documents; Python's generator, not the C++ one, so the draws differ).
Variants: the kernels as built (128-query tiles, 128-key tiles), a warpgroup skipping its 64
rows when all lie past the document's end, and that plus 64-key tiles.

A second bound, with --times SHAPE=MAIN,PASSES (µs of dense rows' main kernels, forward and
backward, and of the passes that run over every token: the delta pass with dQ's zeroing, and
dQ's conversion; from `device_bench.sh attnkt`): the passes cost documents as much as dense
rows, over a fraction f of dense's FLOPs, so with the main kernels at dense's rate per
computed tile (efficiency e above) documents reach f (MAIN + PASSES) / (f MAIN / e + PASSES)
of the dense rate.

  python3 scripts/attention_tile_efficiency.py .carry/fp8text/stdlib.bin.docs
  python3 scripts/attention_tile_efficiency.py .carry/fp8text/stdlib.bin.docs --times W1=1177,170 --times W2=966,86
"""
import argparse
import math
import random
import struct
import sys


def read_doc_index(path):
    raw = open(path, "rb").read()
    magic, version, lo, hi = struct.unpack("<4i", raw[:16])
    count = (lo & 0xFFFFFFFF) | (hi << 32)
    header = len(raw) - (count + 1) * 8
    off = struct.unpack("<%dQ" % (count + 1), raw[header:])
    return [off[i + 1] - off[i] for i in range(count) if off[i + 1] > off[i]]


def pack(lengths, rows, seq):
    docs, nxt, carry = [], 0, 0
    for _ in range(rows):
        left = seq
        while left > 0:
            if carry > 0:
                n = carry
            else:
                n = lengths[nxt % len(lengths)]
                nxt += 1
            take = min(n, left)
            docs.append(take)
            carry, left = n - take, left - take
    return docs


def lognormal(rows, seq, seed=7):
    rnd = random.Random(seed)
    lengths = [max(16, int(math.exp(rnd.gauss(6.0, 1.0)))) for _ in range(10000)]
    return pack(lengths, rows, seq)


def efficiency(docs, rows_per_unit=128, key_tile=128, skip_empty_rows=False):
    """Useful causal pairs / computed pairs. A unit of `rows_per_unit` query rows computes every
    key tile up to the one holding its last valid row (the CTA's 128 rows share their key tiles
    unless skip_empty_rows lets a 64-row warpgroup with no valid rows stop)."""
    useful = computed = 0
    for n in docs:
        useful += n * (n + 1) / 2
        for start in range(0, math.ceil(n / 128) * 128, rows_per_unit):
            if start >= n and skip_empty_rows:
                continue
            tile_last = min(n, (start // 128) * 128 + 128) - 1
            last = min(n, start + rows_per_unit) - 1 if skip_empty_rows else tile_last
            computed += (last // key_tile + 1) * rows_per_unit * key_tile
    return useful / computed


def useful_fraction(docs, rows, seq):
    """The documents' own causal pairs against dense causal rows of the same token count."""
    return sum(n * (n + 1) / 2 for n in docs) / (rows * seq * (seq + 1) / 2)


def parse_times(values):
    times = {}
    for v in values:
        shape, _, rest = v.partition("=")
        parts = rest.split(",")
        try:
            main_us, passes_us = (float(x) for x in parts)
        except ValueError:
            sys.exit("--times %r: expected SHAPE=MAIN,PASSES in microseconds, e.g. W2=966,86" % v)
        if shape not in ("W1", "W2") or main_us <= 0 or passes_us < 0:
            sys.exit("--times %r: SHAPE is W1 or W2, MAIN > 0 and PASSES >= 0" % v)
        times[shape] = (main_us, passes_us)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("doc_index", nargs="?", help="a document index (.docs) for real lengths")
    parser.add_argument("--times", action="append", default=[], metavar="SHAPE=MAIN,PASSES")
    args = parser.parse_args()
    times = parse_times(args.times)
    real = read_doc_index(args.doc_index) if args.doc_index else None
    variants = [("as built (128 x 128 tiles)", dict()),
                ("+ a warpgroup skips rows past the end", dict(rows_per_unit=64, skip_empty_rows=True)),
                ("+ 64-key tiles", dict(rows_per_unit=64, skip_empty_rows=True, key_tile=64))]
    for shape, name, rows, seq in (("W1", "W1 8 x 2048", 8, 2048), ("W2", "W2 1 x 4096", 1, 4096)):
        packings = [("log-normal", lognormal(rows, seq))]
        if real:
            packings.append(("real lengths", pack(real, rows, seq)))
        for label, docs in packings:
            shares = [(vname, efficiency(docs, **kw) / efficiency([seq] * rows, **kw)) for vname, kw in variants]
            print("%s, %s (%d pieces): documents / dense: %s" %
                  (name, label, len(docs), "; ".join("%s %.1f %%" % (v, 100 * e) for v, e in shares)))
            if shape in times:
                f, (m, p) = useful_fraction(docs, rows, seq), times[shape]
                bound = lambda e: 100 * f * (m + p) / (f * m / e + p)  # noqa: E731
                print("  with the passes (f = %.3f, main %g µs, passes %g µs): %s; no masked pair "
                      "computed %.1f %%" % (f, m, p, "; ".join("%s %.1f %%" % (v, bound(e)) for v, e in shares),
                                            bound(1.0)))

if __name__ == "__main__":
    main()
