"""Helpers shared by the `colossal train` plugin tests (tests/zero/test_train_*.py): a small
Llama config, a token file, one training run (optionally under `colossal run`), its metrics and
final weights, and the run-vs-run comparison."""
import json
import os
import subprocess

import numpy as np
from safetensors.torch import load_file

BIN = os.environ["COLOSSAL_BIN"]
MODEL = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
SEQ = 16


def make_work(d):
    """Writes model.json and tokens.bin (a repeating pattern with 20 % noise) into d."""
    (d / "model.json").write_text(json.dumps(MODEL))
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(3, 60, dtype=np.uint16), 200)
    noise = rng.integers(0, 96, size=base.size, dtype=np.uint16)
    np.where(rng.random(base.size) < 0.2, noise, base).astype(np.uint16).tofile(d / "tokens.bin")
    return d


def train(work, name, nproc, extra, shuffle=True, expect_ok=True):
    """10 steps of `colossal train` (under `colossal run` when nproc > 0); stderr kept in out/log.
    shuffle: True/False pass --shuffle, None leaves the flag to `extra`. Returns (out, process)."""
    out = work / name
    args = [BIN, "train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
            "--seq_len", str(SEQ), "--steps", "10", "--lr", "3e-3", "--schedule", "cosine", "--warmup", "2",
            "--weight_decay", "0.1", "--max_grad_norm", "1.0", "--seed", "7"]
    if shuffle is not None:
        args += ["--shuffle", "true" if shuffle else "false"]
    args += ["--metrics_file", str(out / "metrics.jsonl"), "--save_dir", str(out / "ckpt")] + list(extra)
    if nproc > 0:
        args = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + args
    out.mkdir(exist_ok=True)
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if expect_ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (out / "log").write_text(p.stderr)
    return out, p


def run_losses(out, args, nproc=0, ok=True, env=None):
    """`colossal train` + args with its metrics in out/m.jsonl (out is created; under `colossal run`
    when nproc > 0), env: variables added to the environment. ok: asserts success and returns
    (losses per step, stderr); else returns the process."""
    out.mkdir(exist_ok=True)
    args = [BIN, "train"] + list(args) + ["--metrics_file", str(out / "m.jsonl")]
    if nproc > 0:
        args = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + args
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if not ok:
        return p
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(l)["loss"] for l in (out / "m.jsonl").read_text().splitlines()], p.stderr


def run_train(work, name, nproc, extra):
    """train() with --shuffle true; returns the output folder."""
    return train(work, name, nproc, extra)[0]


def metrics(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out, step=10):
    return load_file(str(out / "ckpt" / f"step-{step:08d}" / "model" / "model.safetensors"))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_runs_close(a_out, b_out, tol=1e-5, first=0):
    """Per-step loss (and 10x tol on the grad norm) from step `first` on, and the final weights
    norm-wise (as tests/booster/test_train.py explains), within tol."""
    a, b = metrics(a_out), metrics(b_out)
    assert [m["step"] for m in a] == list(range(1, 11))
    for x, y in zip(a[first:], b[first:]):
        assert rel(x["loss"], y["loss"]) <= tol, (x, y)
        assert rel(x["grad_norm"], y["grad_norm"]) <= 10 * tol, (x, y)
    wa, wb = final_weights(a_out), final_weights(b_out)
    assert wa.keys() == wb.keys()
    for k in wa:
        d = ((wa[k].float() - wb[k].float()).norm() / wb[k].float().norm().clamp_min(1e-12)).item()
        assert d <= tol, (k, d)
