"""Fused unscale + clip of colossal.cpp (via optim_tool) against torch.nn.utils.clip_grad_norm_
computed in fp64 on the unscaled gradients."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
TOOL = os.path.join(BUILD, "tests", "optim", "optim_tool")
SHAPES = {"a": (33, 7), "b": (5,), "c": (2, 3, 4)}


def run(tmp_path, grads, scale, max_norm, dtype):
    for n, g in grads.items():
        g.numpy().astype(np.float32).tofile(tmp_path / f"grad_{n}.f32")
    spec = {"names": list(grads), "shapes": [list(SHAPES[n]) for n in grads], "scale": scale,
            "max_norm": max_norm, "dtype": dtype}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([TOOL, "clip", tmp_path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "result.json").read_text())
    out = {n: torch.from_numpy(np.fromfile(tmp_path / f"out_{n}.f32", dtype=np.float32).reshape(SHAPES[n]))
           for n in grads}
    return res, out


@pytest.mark.parametrize("scale,max_norm", [(1.0, 1.0), (1024.0, 1.0), (512.0, 1e6), (1.0, 0.0), (8.0, 0.3)])
def test_unscale_clip_matches_torch(tmp_path, scale, max_norm):
    g = torch.Generator().manual_seed(int(scale) + 7)
    grads = {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}
    res, out = run(tmp_path, grads, scale, max_norm, "float32")
    ref = [torch.nn.Parameter(torch.zeros(SHAPES[n], dtype=torch.float64)) for n in grads]
    for p, gr in zip(ref, grads.values()):
        p.grad = gr.double() / scale
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm).item()
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref])).item()
    assert not res["overflow"]
    assert res["norm"] == pytest.approx(norm, rel=1e-12)
    for p, n in zip(ref, grads):
        torch.testing.assert_close(out[n], p.grad.float(), rtol=1e-6, atol=1e-7)


def test_overflow_leaves_grads(tmp_path):
    grads = {n: torch.ones(s) for n, s in SHAPES.items()}
    grads["b"][1] = float("inf")
    res, out = run(tmp_path, grads, 4.0, 1.0, "float16")
    assert res["overflow"]
    torch.testing.assert_close(out["a"], grads["a"])
