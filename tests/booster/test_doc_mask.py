"""`colossal train` on packed documents and masked targets (what `colossal prepare --sft` writes):
the loss is the mean over the counted targets of the global batch, for any layout.

Oracle: transformers. Step by step (lr 0, so every step sees the initial weights), the reported
loss equals a Hugging Face LlamaForCausalLM run on each document piece of each sample on its own
(--doc_mask: a document's tokens see only that document, its positions start at 0, the target
that would predict a document's first token from the one before does not count) or on the whole
sample (mask only), the summed cross-entropy of the counted targets divided by their number in
the global batch. Then layouts with lr > 0: one process, two DDP ranks, gradient accumulation,
ZeRO-2, tensor parallelism (vocab-parallel loss) and the unfused loss give the same curve; with
the mask alone, also sequence parallelism and pipeline parallelism (fused and unfused loss).

Tolerances: fp32 on the CPU. HF and our forward agree to 1e-5 (tests/nn/test_hf_parity.py); the
per-document runs and the masked composite differ only in summation order: 1e-5 relative.
Layouts: reordered sums amplified by 6 AdamW steps: 1e-5 for the loss as tests/booster/test_train.py.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from train_helpers import MODEL, rel  # noqa: E402

BIN = os.environ["COLOSSAL_BIN"]
SEQ = 16
DOC_MAGIC, MASK_MAGIC = 20241204, 20241205


def write_files(d, tokens, offsets, mask, packed=0):
    tokens = np.asarray(tokens, dtype=np.uint16)
    h = np.zeros(256, dtype=np.int32)
    h[0], h[1], h[2] = 20240520, 1, tokens.size
    with open(d / "tokens.bin", "wb") as f:
        f.write(h.tobytes() + tokens.tobytes())
    h = np.zeros(256, dtype=np.int32)
    h[0], h[1], h[2] = DOC_MAGIC, 1, len(offsets) - 1
    (d / "tokens.bin.docs").write_bytes(h.tobytes() + np.asarray(offsets, dtype=np.uint64).tobytes())
    if mask is not None:
        h = np.zeros(256, dtype=np.int32)
        h[0], h[1], h[2], h[4] = MASK_MAGIC, 1, len(mask), packed
        (d / "tokens.bin.mask").write_bytes(h.tobytes() + np.asarray(mask, dtype=np.uint8).tobytes())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("doc_mask")
    torch.manual_seed(5)
    cfg = LlamaConfig(**{k: v for k, v in MODEL.items() if k not in ("model_type", "architectures")})
    LlamaForCausalLM(cfg).save_pretrained(str(d / "init"))
    (d / "model.json").write_text(json.dumps(MODEL))
    rng = np.random.default_rng(2)
    lens = rng.integers(1, 30, size=60)  # documents of 1..29 tokens, some shorter than a sample
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = rng.integers(3, 96, size=int(offsets[-1]))
    mask = (rng.random(tokens.size) < 0.7).astype(np.uint8)
    mask[offsets[:-1]] = 0  # a record's first token is a prompt
    write_files(d, tokens, offsets, mask)
    return d, tokens, offsets, mask


def train(d, name, extra, nproc=0, steps=4, lr="0"):
    out = d / name
    out.mkdir()
    args = [BIN, "train", "--data", str(d / "tokens.bin"), "--seq_len", str(SEQ), "--steps", str(steps),
            "--lr", lr, "--schedule", "constant", "--seed", "3", "--shuffle", "false", "--precision", "fp32",
            "--metrics_file", str(out / "m.jsonl")] + extra
    if nproc:
        args = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + args
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(l)["loss"] for l in (out / "m.jsonl").read_text().splitlines()], p.stderr


def reference(d, tokens, offsets, mask, doc_mask, global_batch, steps):
    """The masked mean loss of each step's global batch by HF transformers (no shuffle: step s reads
    samples s*G .. s*G+G-1)."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(d / "init"), torch_dtype=torch.float32).eval()
    starts = set(int(o) for o in offsets[1:-1])
    out = []
    for s in range(steps):
        total, count = 0.0, 0
        for k in range(s * global_batch, (s + 1) * global_batch):
            base = k * SEQ
            cuts = [0] + [t - base for t in range(base + 1, base + SEQ) if doc_mask and t in starts] + [SEQ]
            for a, b in zip(cuts, cuts[1:]):
                ids = torch.tensor(tokens[base + a:base + b], dtype=torch.long).unsqueeze(0)
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0].double()
                for j in range(a, b):
                    t = base + j + 1  # the target token
                    if not mask[t] or (doc_mask and t in starts):
                        continue
                    total -= torch.log_softmax(logits[j - a], -1)[int(tokens[t])].item()
                    count += 1
        out.append(total / count)
    return out


@pytest.mark.parametrize("doc_mask", [True, False])
def test_loss_equals_transformers_per_document(work, doc_mask):
    d, tokens, offsets, mask = work
    ours, log = train(d, f"hf_{doc_mask}", ["--init", str(d / "init"), "--micro_batch", "2", "--accumulation", "2",
                                           "--doc_mask", str(doc_mask).lower(), "--plugin", "none"])
    assert "loss mask" in log and "trained targets" in log, log
    ref = reference(d, tokens, offsets, mask, doc_mask, 4, 4)
    for a, b in zip(ours, ref):
        assert rel(a, b) <= 1e-5, (ours, ref)


LAYOUTS = {
    "one": ([], 0),
    "ddp2": (["--plugin", "ddp", "--micro_batch", "2"], 2),
    "accum": (["--micro_batch", "1", "--accumulation", "4"], 0),
    "zero2": (["--plugin", "zero2", "--micro_batch", "2"], 2),
    "tp2": (["--plugin", "hybrid", "--tp", "2", "--micro_batch", "4"], 2),
    "unfused": (["--fused_ce", "false"], 0),
}


def test_layouts_reproduce_the_single_process_curve(work):
    d = work[0]
    base = ["--model", str(d / "model.json"), "--doc_mask", "true", "--micro_batch", "4"]
    curves = {}
    for name, (extra, nproc) in LAYOUTS.items():
        curves[name], _ = train(d, f"layout_{name}", base + extra, nproc=nproc, steps=6, lr="3e-3")
    one = curves["one"]
    assert len(one) == 6 and len(set(one)) == 6, one  # random tokens: the loss moves, it need not fall
    for name, c in curves.items():
        for a, b in zip(c, one):
            assert rel(a, b) <= 1e-5, (name, c, one)
    # The loss mask alone also under sequence parallelism (each rank holds half of every sequence
    # and of its counted targets) and pipeline parallelism (each micro-batch of the schedule
    # divides its sum as the trainer does).
    base = ["--model", str(d / "model.json"), "--micro_batch", "4"]
    one, _ = train(d, "mask_one", base, steps=6, lr="3e-3")
    for name, extra in (("mask_sp", ["--plugin", "hybrid", "--sp", "2", "--sp_mode", "all_to_all"]),
                        ("mask_pp", ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "2"]),
                        ("mask_pp_unfused", ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "4",
                                             "--fused_ce", "false"])):
        c, _ = train(d, name, base + extra, nproc=2, steps=6, lr="3e-3")
        for a, b in zip(c, one):
            assert rel(a, b) <= 1e-5, (name, c, one)


def test_bad_input_is_named(work, tmp_path):
    d = work[0]
    base = [BIN, "train", "--model", str(d / "model.json"), "--seq_len", str(SEQ), "--steps", "1"]
    # doc_mask without an index.
    tokens = np.arange(3, 60, dtype=np.uint16)
    (tmp_path / "t.bin").write_bytes(tokens.tobytes())
    p = subprocess.run(base + ["--data", str(tmp_path / "t.bin"), "--doc_mask", "true"], capture_output=True, text=True)
    assert p.returncode != 0 and "needs the document index" in p.stderr and "t.bin.docs" in p.stderr, p.stderr
    # A mask that does not cover the tokens, one packed for another seq_len, pipeline parallelism.
    write_files(tmp_path, tokens, [0, tokens.size], np.ones(tokens.size - 1))
    p = subprocess.run(base + ["--data", str(tmp_path / "tokens.bin")], capture_output=True, text=True)
    assert p.returncode != 0 and "covers 56 tokens" in p.stderr, p.stderr
    write_files(tmp_path, tokens, [0, tokens.size], np.ones(tokens.size), packed=32)
    p = subprocess.run(base + ["--data", str(tmp_path / "tokens.bin")], capture_output=True, text=True)
    assert p.returncode != 0 and "packed for seq_len 32" in p.stderr and "--pack 16" in p.stderr, p.stderr
    for extra, needle in (
            (["--doc_mask", "true", "--plugin", "hybrid", "--sp", "2", "--sp_mode", "all_to_all"],
             "not supported with sequence parallelism"),
            (["--doc_mask", "true", "--plugin", "hybrid", "--pp", "2", "--num_microbatches", "2"],
             "not supported with pipeline")):
        p = subprocess.run([BIN, "run", "--nproc_per_node", "2", "--master_port", "0"] + base +
                           ["--data", str(d / "tokens.bin"), "--micro_batch", "4"] + extra, capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode != 0 and needle in p.stderr, p.stderr[-3000:]
        assert "Exception raised from" not in p.stderr
