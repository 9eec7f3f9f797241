#!/usr/bin/env python3
"""Host<->device copy traffic of a Chrome trace written by `colossal bench --profile`:
bytes, busy time and GB/s per memcpy kind (Kineto's gpu_memcpy events carry args.bytes).
Usage: scripts/trace_memcpy.py profile/rank0.json"""
import collections
import json
import sys


def main(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    stats = collections.defaultdict(lambda: [0, 0.0, 0])  # bytes, us, count
    for e in events:
        if e.get("cat") != "gpu_memcpy":
            continue
        s = stats[e.get("name", "?")]
        s[0] += int(e.get("args", {}).get("bytes", 0))
        s[1] += float(e.get("dur", 0.0))
        s[2] += 1
    if not stats:
        print(f"{path}: no gpu_memcpy events")
        return
    for name, (nbytes, us, count) in sorted(stats.items(), key=lambda kv: -kv[1][0]):
        gbs = nbytes / (us * 1e3) if us > 0 else 0.0
        print(f"memcpy {name}: {count} copies, {nbytes / 2**20:.1f} MiB in {us / 1e3:.2f} ms "
              f"= {gbs:.1f} GB/s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
