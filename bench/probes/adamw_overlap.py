"""Probe: can the optimizer step hide under the next forward's GEMMs on one GPU?

Times, on the same tensors and alternated rep by rep:
  seq   - the forward GEMMs of L layers, then AdamW over those layers' parameters (one stream)
  over  - AdamW per layer on a side stream (event per layer); the forward of layer i waits for
          layer i's update, so the update of layers > i runs beside layer i's GEMMs
  lowp  - the same with the side stream at low priority
Layer shapes: a Llama-7b block at seq 4096, batch 1 (bf16 GEMMs; fp32 params/states, fp32
grads, torch's fused AdamW: 28 B a parameter, like ours with bf16 grads and working copy).
Usage: python bench/probes/adamw_overlap.py [layers] [reps]
"""
import statistics
import sys

import torch

L = int(sys.argv[1]) if len(sys.argv) > 1 else 8
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
dev = "cuda"
H, I, T = 4096, 11008, 4096
torch.manual_seed(0)

x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
W = []  # per layer: bf16 working weights for the GEMMs
P = []  # per layer: fp32 lists for AdamW
for _ in range(L):
    ws = [torch.randn(H, 3 * H, device=dev, dtype=torch.bfloat16) * 0.01,
          torch.randn(H, H, device=dev, dtype=torch.bfloat16) * 0.01,
          torch.randn(H, 2 * I, device=dev, dtype=torch.bfloat16) * 0.01,
          torch.randn(I, H, device=dev, dtype=torch.bfloat16) * 0.01]
    W.append(ws)
    shapes = [w.shape for w in ws]
    p = [torch.randn(s, device=dev) for s in shapes]
    g = [torch.randn(s, device=dev) * 1e-3 for s in shapes]
    m = [torch.zeros(s, device=dev) for s in shapes]
    v = [torch.zeros(s, device=dev) for s in shapes]
    st = [torch.tensor(1.0, device=dev) for _ in shapes]
    P.append((p, g, m, v, st))
nparam = sum(t.numel() for lay in P for t in lay[0])


def layer_fwd(i, h):
    q = h @ W[i][0]
    a = q[:, :H] @ W[i][1]
    gu = a @ W[i][2]
    return (gu[:, :I] * gu[:, I:]) @ W[i][3]


def adam(i):
    p, g, m, v, st = P[i]
    torch._fused_adamw_(p, g, m, v, [], st, lr=1e-4, beta1=0.9, beta2=0.95,
                        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


side = torch.cuda.Stream()
low = torch.cuda.Stream(priority=0)
high_main = torch.cuda.Stream(priority=-1)


def run_seq():
    for i in range(L):
        adam(i)
    h = x
    for i in range(L):
        h = layer_fwd(i, h)


def run_over(s, main=None):
    cur = torch.cuda.current_stream()
    main = main or cur
    evs = []
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        for i in range(L):
            adam(i)
            e = torch.cuda.Event()
            e.record(s)
            evs.append(e)
    main.wait_stream(cur)
    with torch.cuda.stream(main):
        h = x
        for i in range(L):
            main.wait_event(evs[i])
            h = layer_fwd(i, h)
    cur.wait_stream(main)
    cur.wait_stream(s)


def run_fwd_only():
    h = x
    for i in range(L):
        h = layer_fwd(i, h)


def run_adam_only():
    for i in range(L):
        adam(i)


variants = {
    "fwd": run_fwd_only,
    "adam": run_adam_only,
    "seq": run_seq,
    "over": lambda: run_over(side),
    "lowp": lambda: run_over(low, high_main),
}
for f in variants.values():  # warm-up
    f()
torch.cuda.synchronize()
times = {k: [] for k in variants}
for r in range(REPS):
    order = list(variants) if r % 2 == 0 else list(reversed(variants))
    for k in order:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        variants[k]()
        b.record()
        torch.cuda.synchronize()
        times[k].append(a.elapsed_time(b))
print(f"{torch.cuda.get_device_name()} layers {L} params {nparam / 1e9:.2f}e9 reps {REPS}")
for k, t in times.items():
    print(f"{k:5s} median {statistics.median(t):8.3f} ms  min {min(t):8.3f}")
med = {k: statistics.median(t) for k, t in times.items()}
print(f"hidden by over: {(med['seq'] - med['over']) / med['adam'] * 100:.0f} % of adam; "
      f"by lowp: {(med['seq'] - med['lowp']) / med['adam'] * 100:.0f} %")
