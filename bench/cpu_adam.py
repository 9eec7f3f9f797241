"""Python side of bench/cpu_adam.sh: torch.optim.AdamW(fused=True) on CPU, one JSON line per
measurement (median of `repeats` interleaved rounds after a warm-up), like bench_cpu_adam:
  copy  dst.copy_(src) of n fp32 (8 bytes per element)
  fp32  opt.step() over one fp32 parameter of n elements with an fp32 grad (28 bytes/param)
  bf16  the offload step done the PyTorch way: bf16 grad upcast into the fp32 master's .grad,
        opt.step(), the bf16 working weights copied down from the master (counted as the same
        28 bytes/param of useful traffic)
usage: cpu_adam.py [n=100000000] [threads=1] [repeats=7]"""
import json
import statistics
import sys
import time

import torch


def report(impl, mode, n, threads, seconds, bytes_per_elem):
    print(json.dumps({"side": "python", "impl": impl, "mode": mode, "n": n, "threads": threads,
                      "median_s": round(seconds, 6), "elems_per_s": n / seconds,
                      "gb_per_s": round(n * bytes_per_elem / seconds / 1e9, 3)}), flush=True)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000_000
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with torch.no_grad():
        src, dst = torch.rand(n), torch.zeros(n)
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        g16 = p.grad.to(torch.bfloat16)
        w16 = torch.zeros(n, dtype=torch.bfloat16)
        opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                fused=True)

        def offload_step():
            p.grad.copy_(g16)
            opt.step()
            w16.copy_(p)

        cases = [("torch", "copy", 8, lambda: dst.copy_(src)),
                 ("torch_adamw_fused", "fp32", 28, opt.step),
                 ("torch_adamw_fused", "bf16", 28, offload_step)]
        # Interleaved rounds after one warm-up round, as bench_cpu_adam does.
        times = [[] for _ in cases]
        for r in range(repeats + 1):
            for i, (_, _, _, fn) in enumerate(cases):
                t0 = time.perf_counter()
                fn()
                if r:
                    times[i].append(time.perf_counter() - t0)
        for (impl, mode, nbytes, _), t in zip(cases, times):
            report(impl, mode, n, threads, statistics.median(t), nbytes)


if __name__ == "__main__":
    main()
