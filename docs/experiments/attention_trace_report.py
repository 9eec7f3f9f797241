"""Where CTA 0 of our attention forward spends its cycles, from an event trace.

The trace comes from a build with docs/experiments/attention_fwd_trace.patch applied (not in the
normal build): `git apply` it, build, `scripts/device_pack.sh build`, move build-carry to
build-trace, and run `PREBUILT=build-trace bash scripts/device_bench.sh prebuilt attntrace`
(carry build-trace), which does the following for W1 and W2 and puts this script's report in
the summary:
    COLOSSAL_ATTENTION_TRACE_FILE=$OUT/trace_W1.txt COLOSSAL_ATTENTION_TRACE_LAUNCH=5 \
        build-trace/bench/bench_kernels --op attention --reps 10 --attn_case W1
(each schedule's kernel appends its sixth launch's trace). Then
    python3 docs/experiments/attention_trace_report.py trace_W1.txt
prints, per schedule and consumer warpgroup, the share of its time in each phase (the time
between two events is charged to the later one: "K wait" is the time from having the turn to
having the K tile, and so on) and how long K tiles took from the producer's issue to the first
consumer past its wait."""
import collections, gzip, statistics as st, sys

def traces(path):
    op = gzip.open if path.endswith('.gz') else open
    cur = None
    for line in op(path, 'rt'):
        if line.startswith('#'):
            if cur: yield cur
            cur = {'head': line.strip(), 'ev': []}
            continue
        t, e, wg, tile, item = map(int, line.split())
        cur['ev'].append((t, e, wg, tile, item))
    if cur: yield cur

NAMES = {10: 'turn wait', 12: 'K wait', 15: 'V wait', 13: 'S GEMM wait', 14: 'softmax',
         16: 'P V wait', 21: 'Q wait', 17: 'epilogue', 11: 'issue'}

for tr in traces(sys.argv[1]):  # roles: 0 producer, 1 and 2 the consumer warpgroups
    ev = sorted(tr['ev'])
    t0, t1 = ev[0][0], ev[-1][0]
    print(tr['head'], '| span %d cycles' % (t1 - t0))
    for wg in (1, 2):
        seq = [(t, e, tile, item) for t, e, w, tile, item in ev if w == wg and e >= 10]
        spent = collections.Counter()
        # Time between consecutive events is charged to the later event's wait/phase.
        for (ta, ea, _, _), (tb, eb, _, _) in zip(seq, seq[1:]):
            spent[NAMES.get(eb, str(eb))] += tb - ta
        tot = sum(spent.values())
        items = len({it for _, e, _, it in seq if e == 21})
        tiles = sum(1 for _, e, _, _ in seq if e == 12)
        print('  warpgroup %d: %d items, %d tiles, %.0f cycles a tile;' % (wg, items, tiles, tot / max(tiles, 1)),
              ', '.join('%s %.1f%%' % (k, 100 * v / tot) for k, v in spent.most_common()))
    # K tiles: producer issue (3) -> first consumer's arrival (12), same item and tile.
    issue = {(item, tile): t for t, e, w, tile, item in ev if e == 3}
    arrive = {}
    for t, e, w, tile, item in ev:
        if e == 12 and (item, tile) not in arrive: arrive[(item, tile)] = t
    lat = [arrive[k] - issue[k] for k in issue if k in arrive]
    if lat:
        print('  K issued -> first consumer past its wait: median %d, p90 %d cycles (%d tiles)' % (
            st.median(lat), sorted(lat)[int(0.9 * len(lat))], len(lat)))
    # Per tile (the loop's tiles 1..n-1, medians): the phases in order, so the chain one
    # warpgroup runs a tile in reads left to right; and per item the boundary's parts: the wait
    # for Q, Q to the first K tile in hand, the first S GEMM, the first softmax (no P V to
    # overlap), and the epilogue (last P V done to output written).
    for wg in (1, 2):
        by_item = collections.defaultdict(dict)
        for t, e, w, tile, item in ev:
            if w == wg: by_item[item].setdefault((e, tile), t)
        phase = collections.defaultdict(list)
        bound = collections.defaultdict(list)
        for d in by_item.values():
            for tl in range(1, 1000):
                keys = [(10, tl), (11, tl), (12, tl), (15, tl), (13, tl), (14, tl), (16, tl)]
                if not all(k in d for k in keys): break
                t = [d[k] for k in keys]
                for name, a, b in (('turn', 0, 1), ('K', 1, 2), ('S issue + V', 2, 3), ('S done', 3, 4),
                                   ('softmax', 4, 5), ('P V', 5, 6)):
                    phase[name].append(t[b] - t[a])
                if (10, tl + 1) in d: phase['to next turn'].append(d[(10, tl + 1)] - t[6])
            need = [(20, 0), (21, 0), (12, 0), (13, 0), (14, 0)]
            t17 = [t for (e, _), t in d.items() if e == 17]
            t16 = [t for (e, _), t in d.items() if e == 16]
            if all(k in d for k in need) and t17 and t16:
                last16 = max(t16)
                bound['Q wait'].append(d[(21, 0)] - d[(20, 0)])
                bound['Q to K_0'].append(d[(12, 0)] - d[(21, 0)])
                bound['S_0'].append(d[(13, 0)] - d[(12, 0)])
                bound['softmax_0'].append(d[(14, 0)] - d[(13, 0)])
                bound['epilogue'].append(min(t17) - last16)
        if phase:
            print('  warpgroup %d, a tile (median cycles): %s' % (wg, ', '.join(
                '%s %d' % (k, st.median(v)) for k, v in phase.items())))
        if bound:
            print('  warpgroup %d, an item boundary (median cycles): %s' % (wg, ', '.join(
                '%s %d' % (k, st.median(v)) for k, v in bound.items())))
