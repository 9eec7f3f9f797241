#!/usr/bin/env python3
"""Loss curves of two or more `colossal train` metrics files (JSON lines with step and loss) as one
SVG plot (no plotting library needed), and their largest relative gap to the first file after
--after steps. usage: scripts/plot_curves.py A.jsonl B.jsonl [...] --labels a,b --after 50 --out plot.svg"""
import argparse
import json
import sys

ap = argparse.ArgumentParser()
ap.add_argument("files", nargs="+")
ap.add_argument("--labels", default="")
ap.add_argument("--after", type=int, default=0)
ap.add_argument("--title", default="training loss")
ap.add_argument("--out", required=True)
a = ap.parse_args()
labels = a.labels.split(",") if a.labels else a.files
curves = []
for f in a.files:
    rows = [json.loads(line) for line in open(f) if line.strip()]
    curves.append({r["step"]: r["loss"] for r in rows})
ref = curves[0]
for lab, c in zip(labels[1:], curves[1:]):
    common = [s for s in sorted(c) if s in ref and s > a.after]
    if not common:
        print(f"{lab}: no common steps after {a.after}")
        continue
    gaps = [abs(c[s] - ref[s]) / abs(ref[s]) for s in common]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"{lab} vs {labels[0]}: {len(common)} steps after {a.after}; max relative gap {gaps[worst]:.4%} "
          f"at step {common[worst]}; mean {sum(gaps) / len(gaps):.4%}; final {c[common[-1]]:.4f} vs {ref[common[-1]]:.4f}")

W, H, L, R, T, B = 900, 500, 70, 20, 40, 50
steps = sorted({s for c in curves for s in c})
lo = min(min(c.values()) for c in curves)
hi = max(max(c.values()) for c in curves)
x = lambda s: L + (s - steps[0]) / max(1, steps[-1] - steps[0]) * (W - L - R)  # noqa: E731
y = lambda v: T + (hi - v) / max(1e-9, hi - lo) * (H - T - B)  # noqa: E731
colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{a.title}</text>',
       f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
       f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
for i in range(6):
    v = lo + (hi - lo) * i / 5
    svg.append(f'<text x="{L - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    s = steps[0] + (steps[-1] - steps[0]) * i / 5
    svg.append(f'<text x="{x(s):.1f}" y="{H - B + 16}" text-anchor="middle">{s:.0f}</text>')
svg.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step</text>')
for i, (lab, c) in enumerate(zip(labels, curves)):
    pts = " ".join(f"{x(s):.1f},{y(c[s]):.1f}" for s in sorted(c))
    col = colors[i % len(colors)]
    svg.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.2" points="{pts}"/>')
    svg.append(f'<text x="{W - R - 160}" y="{T + 16 * (i + 1)}" fill="{col}">{lab}</text>')
svg.append("</svg>")
open(a.out, "w").write("\n".join(svg))
print(f"plot: {a.out}", file=sys.stderr)
