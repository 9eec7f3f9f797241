"""AdamW / SGD / LR schedules of colossal.cpp against torch.optim and HF transformers.

The C++ side is tests/optim/optim_tool: it reads params and per-step grads as raw float32
files, runs the project's optimizer and writes the results; here torch runs the same updates.
"""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
TOOL = os.path.join(BUILD, "tests", "optim", "optim_tool")

SHAPES = {"w": (8, 5), "b": (5,), "e": (3, 2, 4)}


def run_tool(*args):
    r = subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def make_inputs(steps, seed=0, skip=None):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = []
    for s in range(steps):
        step = {}
        for n, shape in SHAPES.items():
            if skip and (s, n) in skip:
                continue
            step[n] = torch.randn(shape, generator=g)
        grads.append(step)
    return params, grads


def write_case(tmp_path, spec, params, grads):
    for n, p in params.items():
        p.numpy().astype(np.float32).tofile(tmp_path / f"param_{n}.f32")
    for s, step in enumerate(grads):
        for n, gr in step.items():
            gr.numpy().astype(np.float32).tofile(tmp_path / f"grad_{s}_{n}.f32")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_tool("optim", tmp_path)
    out = {n: torch.from_numpy(np.fromfile(tmp_path / f"out_{n}.f32", dtype=np.float32).reshape(SHAPES[n]))
           for n in params}
    masters = {}
    for n in params:
        f = tmp_path / f"master_{n}.f32"
        if f.exists():
            masters[n] = torch.from_numpy(np.fromfile(f, dtype=np.float32).reshape(SHAPES[n]))
    return out, masters


def groups_spec(opt, g1, g2):
    return [dict(g1, params=[{"name": "w", "shape": list(SHAPES["w"])}, {"name": "b", "shape": list(SHAPES["b"])}]),
            dict(g2, params=[{"name": "e", "shape": list(SHAPES["e"])}])]


def torch_run(cls, g1, g2, params, grads, dtype=torch.float32, master=False, **kw):
    """Reference: torch optimizer over fp32 tensors; with master=True the working copy is
    dtype and the optimizer updates fp32 masters, working = master.to(dtype) after each step."""
    work = {n: p.to(dtype) for n, p in params.items()}
    ref = {n: (w.float().clone() if master else w.clone()).requires_grad_(True) for n, w in work.items()}
    tg = lambda g: {k: v for k, v in g.items() if k not in ("params", "beta1", "beta2")}
    groups = [dict(tg(g1), params=[ref["w"], ref["b"]]), dict(tg(g2), params=[ref["e"]])]
    for grp, g in zip(groups, (g1, g2)):
        if "beta1" in g:
            grp["betas"] = (g["beta1"], g["beta2"])
    opt = cls(groups, **kw)
    for step in grads:
        opt.zero_grad(set_to_none=True)
        for n, gr in step.items():
            ref[n].grad = gr.to(dtype).to(ref[n].dtype)
        opt.step()
        if master:
            for n in work:
                work[n] = ref[n].detach().to(dtype)
    if master:
        return work, {n: r.detach() for n, r in ref.items()}
    return {n: r.detach() for n, r in ref.items()}, {}


ADAM_G1 = {"lr": 1e-2, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
ADAM_G2 = {"lr": 3e-3, "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adamw_fp32(tmp_path, impl):
    params, grads = make_inputs(5, skip={(2, "b")})
    spec = {"optimizer": "adamw", "impl": impl, "dtype": "float32", "master_weights": True, "steps": 5,
            "groups": groups_spec("adamw", ADAM_G1, ADAM_G2)}
    out, _ = write_case(tmp_path, spec, params, grads)
    ref, _ = torch_run(torch.optim.AdamW, ADAM_G1, ADAM_G2, params, grads, foreach=False)
    for n in params:
        torch.testing.assert_close(out[n], ref[n], rtol=1e-6, atol=1e-7, msg=f"{impl} {n}")
        assert not torch.equal(out[n], params[n])


def test_adamw_bf16_masters(tmp_path):
    params, grads = make_inputs(5, seed=1)
    spec = {"optimizer": "adamw", "impl": "auto", "dtype": "bfloat16", "master_weights": True, "steps": 5,
            "groups": groups_spec("adamw", ADAM_G1, ADAM_G2)}
    out, masters = write_case(tmp_path, spec, params, grads)
    work, ref_masters = torch_run(torch.optim.AdamW, ADAM_G1, ADAM_G2, params, grads, dtype=torch.bfloat16,
                                  master=True, foreach=False)
    for n in params:
        torch.testing.assert_close(masters[n], ref_masters[n], rtol=1e-6, atol=1e-7)
        # working = master rounded to bf16: equal up to a rounding flip of 1 bf16 ulp
        torch.testing.assert_close(out[n], work[n].float(), rtol=8e-3, atol=0)
        assert torch.equal(out[n], masters[n].to(torch.bfloat16).float())


@pytest.mark.parametrize("g1", [
    {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False},
    {"lr": 0.05, "weight_decay": 0.01, "momentum": 0.9, "dampening": 0.1, "nesterov": False},
    {"lr": 0.05, "weight_decay": 0.01, "momentum": 0.9, "dampening": 0.0, "nesterov": True},
])
def test_sgd_fp32(tmp_path, g1):
    g2 = dict(g1, lr=0.02, weight_decay=0.0)
    params, grads = make_inputs(4, seed=2, skip={(1, "w")})
    spec = {"optimizer": "sgd", "dtype": "float32", "master_weights": True, "steps": 4,
            "groups": groups_spec("sgd", g1, g2)}
    out, _ = write_case(tmp_path, spec, params, grads)
    ref, _ = torch_run(torch.optim.SGD, g1, g2, params, grads, foreach=False)
    for n in params:
        torch.testing.assert_close(out[n], ref[n], rtol=1e-6, atol=1e-7)


def test_sgd_bf16_masters(tmp_path):
    g1 = {"lr": 0.05, "weight_decay": 0.01, "momentum": 0.9, "dampening": 0.0, "nesterov": False}
    params, grads = make_inputs(4, seed=3)
    spec = {"optimizer": "sgd", "dtype": "bfloat16", "master_weights": True, "steps": 4,
            "groups": groups_spec("sgd", g1, g1)}
    out, masters = write_case(tmp_path, spec, params, grads)
    work, ref_masters = torch_run(torch.optim.SGD, g1, g1, params, grads, dtype=torch.bfloat16, master=True,
                                  foreach=False)
    for n in params:
        torch.testing.assert_close(masters[n], ref_masters[n], rtol=1e-6, atol=1e-7)


def hf_lrs(kind, warmup, total, min_ratio, cycles, steps):
    import transformers.optimization as o
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    if kind == "constant":
        s = o.get_constant_schedule_with_warmup(opt, warmup)
    elif kind == "linear":
        s = o.get_linear_schedule_with_warmup(opt, warmup, total)
    elif min_ratio > 0:
        s = o.get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, num_cycles=cycles,
                                                          min_lr_rate=min_ratio)
    else:
        s = o.get_cosine_schedule_with_warmup(opt, warmup, total, num_cycles=cycles)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    return out


@pytest.mark.parametrize("case", [
    ("constant", 0, 0, 0.0, 0.5), ("constant", 7, 0, 0.0, 0.5),
    ("linear", 0, 30, 0.0, 0.5), ("linear", 5, 30, 0.0, 0.5),
    ("cosine", 5, 30, 0.0, 0.5), ("cosine", 0, 30, 0.0, 1.5), ("cosine", 4, 25, 0.1, 0.5),
])
def test_lr_schedules_match_hf(case):
    kind, warmup, total, min_ratio, cycles = case
    steps = 40  # past the end: linear clamps at 0, cosine keeps its formula
    ours = json.loads(run_tool("lr", kind, warmup, total, min_ratio, cycles, steps))
    ref = hf_lrs(kind, warmup, total, min_ratio, cycles, steps)
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), f"step {i}: {a} vs {b}"
