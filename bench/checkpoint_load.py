"""Python side of bench/checkpoint_load.sh: safetensors.torch.load_file on the same file.
Prints one JSON line per mode, like bench_checkpoint_load:
  mapped        load_file(path) (default mmap backend: tensors view the mapping, data not read)
  mapped_touch  load_file(path), then every page of every tensor read once
  pread         load_file(path, backend="pread"), then every page touched
  clone         load_file(path) + .clone() of every tensor (owned, materialized copies)
usage: checkpoint_load.py <file.safetensors> [repeats=5]"""
import json
import statistics
import sys
import time

import torch
from safetensors.torch import load_file


def touch(tensors):
    s = 0
    for t in tensors.values():
        b = t.reshape(-1).view(torch.uint8)
        if b.numel():
            s += int(b[::4096].sum()) + int(b[-1])
    return s


def main():
    path = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    nbytes = sum(t.numel() * t.element_size() for t in load_file(path).values())
    modes = {
        "mapped": lambda: len(load_file(path)),
        "mapped_touch": lambda: touch(load_file(path)),
        "pread": lambda: touch(load_file(path, backend="pread")),
        "clone": lambda: touch({k: v.clone() for k, v in load_file(path).items()}),
    }
    for name, fn in modes.items():
        fn()  # warm-up
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        print(json.dumps({"impl": "python", "mode": name, "median_s": round(med, 6), "min_s": round(min(ts), 6),
                          "GBps": round(nbytes / med / 1e9, 2), "bytes": nbytes}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
