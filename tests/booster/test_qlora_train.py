"""`colossal train --quantize nf4|fp8` (QLoRA): LoRA on a base whose linear layers are stored quantized.

Reference: the same run on the *dequantized* base. Every linear weight but lm_head of the HF model
is quantized to NF4 (blocksize 64, double quantisation: QLoRA's storage) by bitsandbytes 0.50.2 and
dequantized by the published algorithm (tests/nf4_reference.py), and we train LoRA on that fp32
folder; for FP8 (e4m3, one fp32 scale per output
row) torch does the same. Our QLoRA run quantizes the original folder as it loads it and dequantizes
each weight at every GEMM, so it multiplies by the same fp32 values: its loss curve and trained
adapter equal the reference's within 1e-6 (fp32; only the place of the dequantisation differs,
observed bitwise equal). The layouts (ddp, ZeRO-2, Gemini at 2 ranks) reproduce the one-process
QLoRA curve within 1e-5 (reordered sums, as tests/booster/test_lora_train.py). A resumed run is
bitwise the uninterrupted one (the base is quantized again from the same folder: the same codes).
"""
import json
import math
import re
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nf4_reference import nf4_dequantized  # noqa: E402
from train_helpers import MODEL, SEQ, make_work, rel, run_losses  # noqa: E402

BIN = os.environ["COLOSSAL_BIN"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 10


def quantized_linear(name):
    return name.endswith("_proj.weight")


def dequantized_folder(src, dst, kind):
    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    out = {}
    for k, t in w.items():
        if not quantized_linear(k):
            out[k] = t
        elif kind == "nf4":
            out[k] = nf4_dequantized(t, 64)
        else:
            x = t.float()
            amax = x.abs().amax(1)
            scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            codes = (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[k] = (codes.float() * scale[:, None]).contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = make_work(tmp_path_factory.mktemp("qlora_train"))
    torch.manual_seed(5)
    cfg = LlamaConfig(**{k: v for k, v in MODEL.items() if k not in ("model_type", "architectures")})
    LlamaForCausalLM(cfg).save_pretrained(str(d / "base"))
    return d


def train(d, name, init, extra, nproc=0, ok=True, resume=None):
    out = d / name
    args = ["--init", str(init), "--data", str(d / "tokens.bin"), "--seq_len", str(SEQ), "--steps", str(STEPS),
            "--lr", "3e-3", "--schedule", "cosine", "--warmup", "2", "--weight_decay", "0.1", "--max_grad_norm", "1.0",
            "--shuffle", "false", "--precision", "fp32", "--lora_r", "4", "--lora_targets", ",".join(TARGETS),
            "--save_dir", str(out / "ck")] + extra + (["--resume", str(out / "ck")] if resume else [])
    r = run_losses(out, args, nproc, ok)
    if not ok:
        return r
    return r[0], load_file(str(out / "ck" / "adapter" / "adapter_model.safetensors")), out, r[1]


def norm_rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_equals_lora_on_the_dequantized_base(work, kind):
    ref, ref_adapter, _, _ = train(work, f"deq_{kind}", dequantized_folder(work / "base", work / f"base_{kind}", kind),
                                   ["--micro_batch", "4", "--plugin", "none"])
    ours, adapter, out, log = train(work, f"q_{kind}", work / "base",
                                    ["--micro_batch", "4", "--plugin", "none", "--quantize", kind])
    assert f"14 linear layers quantized to {kind}" in log, log[-2000:]
    assert len(set(ours)) == STEPS
    for a, b in zip(ours, ref):
        assert rel(a, b) <= 1e-6, (ours, ref)
    assert adapter.keys() == ref_adapter.keys() and len(adapter) == 2 * 7 * MODEL["num_hidden_layers"]
    for k in adapter:
        assert norm_rel(adapter[k], ref_adapter[k]) <= 1e-6, k
    # The quantization is not the identity: the same LoRA run on the original base differs.
    plain, _, _, _ = train(work, f"plain_{kind}", work / "base", ["--micro_batch", "4", "--plugin", "none"])
    assert max(rel(a, b) for a, b in zip(plain, ours)) > 1e-5
    # Checkpoints hold the adapters and the unquantized tensors, not the quantized base.
    final = load_file(str(out / "ck" / f"step-{STEPS:08d}" / "model" / "model.safetensors"))
    base = load_file(str(work / "base" / "model.safetensors"))
    assert not any(quantized_linear(k) for k in final)
    for k, t in base.items():
        if not quantized_linear(k):
            assert torch.equal(final[k], t), k
    # Loaded as a plain model, the checkpoint says what it is and what to do.
    p = subprocess.run([BIN, "generate", "--model", str(out / "ck" / f"step-{STEPS:08d}" / "model"), "--prompt-ids",
                        "1,2", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "it is from a QLoRA run" in p.stderr and "colossal lora merge" in p.stderr, p.stderr
    # The adapter merges into the full-precision base (as PEFT users merge a QLoRA adapter).
    p = subprocess.run([BIN, "lora", "merge", "--model", str(work / "base"), "--adapter", str(out / "ck" / "adapter"),
                        "--out", str(out / "merged")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    merged = load_file(str(out / "merged" / "model.safetensors"))
    assert merged.keys() == base.keys()


def test_initialised_base_and_activation_checkpointing(work):
    """A preset/config.json base is quantized as each weight is initialised (its values are the
    plain init's, tests/nn/test_quantized_linear.cpp); recomputing every decoder layer
    (--grad_checkpoint) gives the same curve bit for bit (the same ops on the same values)."""
    def run(name, extra):
        return run_losses(work / name, ["--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
                                        "--seq_len", str(SEQ), "--steps", "6", "--lr", "3e-3", "--shuffle", "false",
                                        "--precision", "fp32", "--lora_r", "4", "--quantize", "fp8", "--micro_batch",
                                        "4"] + extra)
    plain, log = run("init_plain", [])
    assert "14 linear layers quantized to fp8" in log, log[-2000:]
    # The LoRA line counts the quantized weights as the model's parameters (they are no
    # parameters of the module tree): the same total as the unquantized run's.
    _, unq_log = run_losses(work / "init_unquantized",
                            ["--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
                             "--seq_len", str(SEQ), "--steps", "1", "--precision", "fp32", "--lora_r", "4",
                             "--micro_batch", "4"])
    totals = [re.search(r"of (\d+) parameters train", text).group(1) for text in (log, unq_log)]
    assert totals[0] == totals[1], totals
    assert len(set(plain)) == 6 and all(math.isfinite(x) for x in plain)
    # Each decoder layer (its attention block with --ckpt_mode attention) is recomputed once per
    # step: the count the trainer reports, so an ignored flag cannot pass for a working one.
    layers = json.loads((work / "model.json").read_text())["num_hidden_layers"]
    ckpt, ckpt_log = run("init_ckpt", ["--grad_checkpoint", "true"])
    assert ckpt == plain
    assert f"activation checkpointing (full): {6 * layers} block recomputes in 6 steps" in ckpt_log, ckpt_log[-2000:]
    attn, attn_log = run("init_attn", ["--grad_checkpoint", "true", "--ckpt_mode", "attention"])
    assert attn == plain
    assert f"activation checkpointing (attention): {6 * layers} block recomputes in 6 steps" in attn_log, \
        attn_log[-2000:]


def test_plugins_give_one_curve(work):
    extra = ["--quantize", "nf4", "--lora_targets", "q_proj,v_proj,down_proj"]
    one, a1, _, _ = train(work, "lay_one", work / "base", extra + ["--micro_batch", "4", "--plugin", "none"])
    for name, plugin in (("lay_ddp", "ddp"), ("lay_zero2", "zero2"), ("lay_gemini", "gemini")):
        c, a, _, _ = train(work, name, work / "base", extra + ["--micro_batch", "2", "--plugin", plugin], nproc=2)
        for x, y in zip(c, one):
            assert rel(x, y) <= 1e-5, (name, c, one)
        for k in a1:
            assert norm_rel(a[k], a1[k]) <= 1e-5, (name, k)


def test_resume_is_bitwise(work):
    extra = ["--quantize", "nf4", "--micro_batch", "4", "--plugin", "none", "--save_every", "5"]
    full, _, out, _ = train(work, "res_full", work / "base", extra)
    part = work / "res_part"
    (part / "ck").mkdir(parents=True)
    shutil.copytree(out / "ck" / "step-00000005", part / "ck" / "step-00000005")
    (part / "ck" / "latest").write_text("step-00000005\n")
    (part / "m.jsonl").write_text("".join((out / "m.jsonl").read_text().splitlines(True)[:5]))
    resumed, _, _, _ = train(work, "res_part", work / "base", extra, resume=True)
    assert resumed == full
    assert (part / "ck" / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (out / "ck" / "adapter" / "adapter_model.safetensors").read_bytes()


def test_bad_options_are_named(work):
    args = [BIN, "train", "--init", str(work / "base"), "--data", str(work / "tokens.bin"), "--seq_len", str(SEQ),
            "--steps", "2"]
    for extra, needle in [
            (["--quantize", "nf4"], "option 'quantize' (nf4) needs LoRA"),
            (["--quantize", "int3", "--lora_r", "4"], "int3"),
            (["--quantize", "nf4", "--lora_r", "4", "--plugin", "hybrid"], "under plugin 'hybrid' is not supported"),
    ]:
        p = subprocess.run(args + extra, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and needle in p.stderr, (extra, p.returncode, p.stderr[-2000:])
        assert "Exception raised from" not in p.stderr
