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
