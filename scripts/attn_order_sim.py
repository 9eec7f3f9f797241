#!/usr/bin/env python3
"""The attention backward's launch order on paper: a list-scheduling count (no GPU).

The backward launches one CTA per (128-key tile, kv head) and the GPU starts them in launch
order as SMs free up (one CTA per SM). This script builds the same work lists as
src/kernels/attention.cpp (a key tile's work: the query steps that see it), the same head
sections (kernels::attention_sections at the default 24 MiB) and the launch order of
kernels::attention_backward_order (src/kernels/attention.cpp; interleave 0 is the sections
one after another) for each interleave and for the automatic choice
(kernels::attention_bwd_interleave_auto, its pick in brackets), then hands the CTAs to 132
SMs in that order (each to the SM that frees first) and prints the makespan against the
average work per SM: the share of the SMs' time the order keeps busy. A step costs 1 (a
masked step 1 + --mask_cost), a CTA --cta_cost more. It counts neither L2 traffic (which the
sections are for) nor anything else a GPU does, so it says what an order can gain at most,
not what it gains: the measurement decides (scripts/device_bench.sh attnab with ATTNAB_BI;
on an H100 on 2026-12-07 interleave 100 lost the sections' L2 reuse, docs/benchmarks.md).

It then counts the persistent forward's items the same way (no interleave there: the count
finds its order already 97-100 % busy at these shapes).

Shapes: the issue's W1 (8 x 2048, 32 / 4 heads, head dim 64, 128 queries a step), W2 B1 and
B4 (1 and 4 x 4096, 32 / 32 heads, head dim 128, 64 queries a step), dense and with the
documents of a `colossal prepare` index packed as bench/documents.h packs them.
Usage:
    scripts/attn_order_sim.py [--doc_index .carry/fp8text/stdlib.bin.docs] [--sms 132]
"""
import argparse
import heapq

# The document index reader and bench/documents.h's packing, as the tile-count script has them.
from attention_tile_efficiency import pack as pack_lengths, read_doc_index

L2_BUDGET = 24 << 20
# (name, sequences, sequence length, kv heads, query heads per kv head, head dim, bwd_block_m)
SHAPES = [("W1", 8, 2048, 4, 8, 64, 128),
          ("W2 B1", 1, 4096, 32, 1, 128, 64),
          ("W2 B4", 4, 4096, 32, 1, 128, 64)]


def cases(lengths, b, s):
    """Dense rows, and the documents packed into them when there are lengths."""
    out = [("dense", [s] * b)]
    if lengths:
        docs = pack_lengths(lengths, b, s)
        out.append(("%d real docs" % len(docs), docs))
    return out


def key_tiles(docs, bm, mask_cost):
    """(work-list work, cost) per 128-key tile, heaviest first as attention_backward_tiles
    orders them (work in 64-query steps; cost in the kernel's bm-query steps)."""
    out = []
    for n in docs:
        for j in range((n + 127) // 128):
            work = (n + 63) // 64 - j * 2
            cost = 0.0
            for m in range(j * 128 // bm, (n + bm - 1) // bm):
                k0, q0 = j * 128, m * bm
                masked = k0 + 128 > n or q0 + bm > n or k0 + 127 > q0
                cost += 1 + (mask_cost if masked else 0)
            out.append((work, cost))
    out.sort(key=lambda t: -t[0])  # stable, as std::stable_sort
    return out


def query_tiles(docs):
    """(work, cost) per 128-query item of the persistent forward, heaviest first as
    attention_forward_tiles orders them (work and cost: the 128-key tiles it reads)."""
    out = []
    for n in docs:
        for m in range((n + 127) // 128):
            out.append((m + 1, m + 1))
    out.sort(key=lambda t: -t[0])
    return out


def launch_order(tiles, kv_heads, section, interleave):  # kernels::attention_backward_order
    n = len(tiles)
    sec = kv_heads if section <= 0 or section >= kv_heads else section
    wmax = max(w for w, _ in tiles)
    keyed = []
    for b in range(n * kv_heads):
        s, rest = divmod(b, n * sec)
        inn = min(sec, kv_heads - s * sec)
        keyed.append((100 * tiles[rest // inn][0] - (100 - interleave) * s * wmax, b, rest // inn))
    keyed.sort(key=lambda k: -k[0])
    return [t for _, _, t in keyed]


def auto_interleave(tiles, kv_heads, section, group, sms, slack=0.01, cap=60):
    """kernels::attention_bwd_interleave_auto: the lowest interleave (0, 10, ..., cap) whose
    busy share, counting a CTA as work x group + 2, is within `slack` of the best."""
    if section <= 0 or section >= kv_heads:
        return 0
    shares = []
    for lvl in range(0, cap + 1, 10):
        costs = [tiles[t][0] * group + 2 for t in launch_order(tiles, kv_heads, section, lvl)]
        shares.append((lvl, sum(costs) / sms / makespan(costs, sms)))
    best = max(r for _, r in shares)
    return next(lvl for lvl, r in shares if r >= best - slack)


def makespan(costs, sms):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc_index", default="")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--mask_cost", type=float, default=0.3)
    ap.add_argument("--cta_cost", type=float, default=2.0)
    ap.add_argument("--interleave", default="0,25,50,75,100")
    args = ap.parse_args()
    lengths = read_doc_index(args.doc_index) if args.doc_index else []
    levels = [int(x) for x in args.interleave.split(",")]
    print("share of the SMs' time kept busy (average work per SM / makespan), by interleave:")
    print("%-24s %s    auto" % ("shape", " ".join("%7d" % l for l in levels)))
    for name, b, s, hkv, group, d, bm in SHAPES:
        section = max(1, min(hkv, L2_BUDGET // (group * b * s * d * 8)))
        for tag, docs in cases(lengths, b, s):
            tiles = key_tiles(docs, bm, args.mask_cost)
            def share(lvl):
                costs = [tiles[t][1] * group + args.cta_cost
                         for t in launch_order(tiles, hkv, section, lvl)]
                return sum(costs) / args.sms / makespan(costs, args.sms)
            row = [share(lvl) for lvl in levels]
            pick = auto_interleave(tiles, hkv, section, group, args.sms)
            print("%-24s %s  %.3f (%d)" % ("%s %s" % (name, tag),
                                          " ".join("%7.3f" % r for r in row), share(pick), pick))
    # The forward: persistent CTAs draw (query tile, head) items in list order from a counter,
    # which hands items out as list scheduling does; its head sections hold K and V
    # (kernels::attention_sections). It has no interleave; the columns say what one would gain.
    print("the forward's items (no interleave in the kernel; an item costs its key tiles + 0.5):")
    for name, b, s, hkv, group, d, _ in SHAPES:
        heads = hkv * group
        section = max(1, min(hkv, L2_BUDGET // (b * s * d * 4))) * group
        for tag, docs in cases(lengths, b, s):
            tiles = query_tiles(docs)
            row = []
            for lvl in levels:
                costs = [tiles[t][1] + 0.5 for t in launch_order(tiles, heads, section, lvl)]
                row.append(sum(costs) / args.sms / makespan(costs, args.sms))
            print("%-24s %s" % ("%s %s" % (name, tag), " ".join("%7.3f" % r for r in row)))


if __name__ == "__main__":
    main()
