"""`colossal train` with the chunked fused linear + cross-entropy (the default) against the
unfused loss (--fused_ce false), with chunks smaller than a micro-batch's tokens (one partial),
untied and tied heads, fp32 and bf16, one process and two ddp ranks.

Tolerances: fp32 on CPU. The two losses differ only in summation order (chunked log-sum-exp and
dW accumulated over chunks vs one GEMM, and dlogits = softmax - onehot vs ATen's log_softmax
backward): measured 1.1e-7 relative over 6 AdamW steps; bound 1e-5, as tests/booster/test_train.py
uses for reordered sums. Final weights, norm-wise per tensor: 1e-4. Measured 4.3e-5 on one tensor
of the tied model (others < 1e-5), the same with a single chunk (so from the dlogits formula, not
the chunking): AdamW turns an ulp-level change of a near-zero gradient entry into an lr-sized step
(see test_train.py's assert_weights_close), while the losses still agree to 1e-7. bf16:
both compute the logits in bf16 and the softmax in fp32; dlogits are rounded to bf16 before the
GEMMs in both, so the curves agree to bf16 precision (2e-2 as in test_train.py)."""
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.torch import load_file

BIN = os.environ["COLOSSAL_BIN"]
SEQ = 16


def model(tied):
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
        "tie_word_embeddings": tied, "hidden_act": "silu",
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused_ce")
    for tied in (False, True):
        (d / f"model_{int(tied)}.json").write_text(json.dumps(model(tied)))
    rng = np.random.default_rng(1)
    base = np.tile(np.arange(3, 60, dtype=np.uint16), 100)
    noise = rng.integers(0, 97, size=base.size, dtype=np.uint16)
    np.where(rng.random(base.size) < 0.2, noise, base).astype(np.uint16).tofile(d / "tokens.bin")
    return d


def train(work, name, tied, extra, nproc=0):
    out = work / name
    out.mkdir()
    args = [BIN, "train", "--model", str(work / f"model_{int(tied)}.json"), "--data", str(work / "tokens.bin"),
            "--seq_len", str(SEQ), "--steps", "6", "--lr", "3e-3", "--micro_batch", "4", "--seed", "3",
            "--metrics_file", str(out / "m.jsonl"), "--save_dir", str(out / "ckpt")] + extra
    if nproc:
        args = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + args
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [json.loads(l)["loss"] for l in (out / "m.jsonl").read_text().splitlines()]
    return losses, load_file(str(out / "ckpt" / "step-00000006" / "model" / "model.safetensors"))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("tied", [False, True])
def test_fused_equals_unfused_fp32(work, tied):
    # 64 tokens per micro-batch in chunks of 24: 24 + 24 + 16.
    ref, w_ref = train(work, f"unfused_{tied}", tied, ["--plugin", "none", "--fused_ce", "false"])
    got, w = train(work, f"fused_{tied}", tied, ["--plugin", "none", "--ce_chunk_tokens", "24"])
    assert len(got) == len(ref) == 6
    for a, b in zip(got, ref):
        assert rel(a, b) <= 1e-5, (got, ref)
    assert ref[-1] < ref[0]  # it trains
    for k in w_ref:
        d = ((w[k] - w_ref[k]).norm() / w_ref[k].norm()).item()
        assert d <= 1e-4, (k, d)


def test_fused_bf16_ddp(work):
    ref, _ = train(work, "unfused_bf16", False, ["--plugin", "ddp", "--precision", "bf16", "--fused_ce", "false"], 2)
    got, _ = train(work, "fused_bf16", False, ["--plugin", "ddp", "--precision", "bf16", "--ce_chunk_tokens", "24"], 2)
    for a, b in zip(got, ref):
        assert rel(a, b) <= 2e-2, (got, ref)


def test_bad_chunk(work):
    p = subprocess.run([BIN, "train", "--model", str(work / "model_0.json"), "--data", str(work / "tokens.bin"),
                        "--ce_chunk_tokens", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "ce_chunk_tokens" in p.stderr, p.stderr[-2000:]
