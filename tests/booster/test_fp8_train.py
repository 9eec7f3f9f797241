"""`colossal train --use_fp8` (FP8 linear layers; on the CPU the FP8 arithmetic is emulated, the
casts and scaling logic being the ones the GPU runs).

- Layouts: ddp, ZeRO-2 and Gemini at 2 ranks reproduce the one-process FP8 curve (accumulation 2,
  so every micro-batch, hence every activation cast, is the same). Tolerance 1e-5, as the other
  layout tests (reordered gradient sums); a weight moved by its last bit could round to a
  neighbouring FP8 code at the next cast, but on this model the curves came out identical.
- The hybrid plugin's pipeline (pp 2): 1F1B gives the same curve within 1e-5 (each stage computes
  its layers as one process does; measured equal). zbh1 splits the backward into B and W and
  reorders some fp32 accumulations (measured 6e-8 at tensorwise); with rowwise that flipped an
  FP8 code and AdamW carried it to 2.6e-4. Bound: the first step 1e-5, then 2e-3, as for tp below.
- The hybrid plugin at tp 2, without and with split_gather (tensorwise): the operands split over
  the group take the group's amax, so every element quantizes as in one process and the first
  step's loss (the same weights) is within 1e-5. Later steps: tensor parallelism reorders fp32
  sums (row outputs are sums of partial products), so an element that lands within 2^-24 of an
  e4m3 rounding midpoint takes the neighbouring FP8 code; AdamW's normalised update carries such a
  flip into the curve (measured: equal to 6e-8 for five steps, then up to 4.8e-4, the size of
  FP8's own effect on this model; the same tp run without FP8 stays within 6e-8). Bound 2e-3. The
  exactness of the scales themselves is tests/nn/test_fp8_tp.cpp's: one step of a layer and of a
  Llama at 1e-5, which local scales would miss by orders of magnitude.
- FP8 stays close to the unquantized run (1 % of the loss over 10 steps: the quantization noise of
  e4m3/e5m2 with per-tensor or per-row scales; measured 0.06 % tensorwise, 0.09 % rowwise), and is
  not equal to it.
- Activation checkpointing recomputes the same casts: the same curve bit for bit.
- Checkpoints of an FP8 run are ordinary: the same tensor names and dtypes as a plain run, loadable
  by transformers.
- Bad combinations are named errors.
"""
import json
import os
import sys

import pytest
from safetensors import safe_open

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from train_helpers import SEQ, make_work, rel, run_losses  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("fp8_train"))


def train(d, name, extra, nproc=0, ok=True):
    out = d / name
    r = run_losses(out, ["--model", str(d / "model.json"), "--data", str(d / "tokens.bin"), "--seq_len", str(SEQ),
                         "--steps", "10", "--lr", "3e-3", "--warmup", "2", "--shuffle", "false", "--precision",
                         "fp32", "--seed", "7", "--save_dir", str(out / "ck")] + extra, nproc, ok)
    return (r[0], out, r[1]) if ok else r


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_layouts_reproduce_one_process(work, recipe):
    fp8 = ["--use_fp8", "true", "--fp8_recipe", recipe]
    one, _, log = train(work, f"one_{recipe}", fp8 + ["--micro_batch", "2", "--accumulation", "2", "--plugin", "none"])
    assert f"FP8 ({recipe}, emulated on the CPU): 14 linear layers" in log, log[-2000:]
    plain, _, _ = train(work, f"plain_{recipe}", ["--micro_batch", "2", "--accumulation", "2", "--plugin", "none"])
    assert max(rel(a, b) for a, b in zip(one, plain)) > 1e-6
    assert max(rel(a, b) for a, b in zip(one, plain)) < 1e-2, (one, plain)
    for name, plugin in (("ddp", "ddp"), ("zero2", "zero2"), ("gemini", "gemini")):
        c, _, _ = train(work, f"{name}_{recipe}", fp8 + ["--micro_batch", "2", "--plugin", plugin], nproc=2)
        assert max(rel(a, b) for a, b in zip(c, one)) <= 1e-5, (name, c, one)
    # Pipeline stages (1F1B, and zbh1 whose W finds no deferred FP8 weight gradient: FP8 layers
    # compute theirs in B): two micro-batches of 2, as the accumulation above.
    for name, extra in (("pp2", []), ("pp2_zbh1", ["--pp_style", "zbh1"])):
        c, _, _ = train(work, f"{name}_{recipe}", fp8 + ["--micro_batch", "4", "--plugin", "hybrid", "--pp", "2",
                                                       "--num_microbatches", "2"] + extra, nproc=2)
        assert rel(c[0], one[0]) <= 1e-5, (name, c, one)
        assert max(rel(a, b) for a, b in zip(c, one)) <= (1e-5 if name == "pp2" else 2e-3), (name, c, one)
    if recipe == "tensorwise":  # tensor parallel: the same global batch on one data-parallel rank
        for name, extra in (("tp2", []), ("tp2_split_gather", ["--sp_mode", "split_gather", "--zero_stage", "1"])):
            c, _, log = train(work, f"{name}_{recipe}", fp8 + ["--micro_batch", "2", "--accumulation", "2",
                                                             "--plugin", "hybrid", "--tp", "2"] + extra, nproc=2)
            assert "FP8 (tensorwise, emulated on the CPU): 14 linear layers" in log, log[-2000:]
            assert rel(c[0], one[0]) <= 1e-5, (name, c, one)
            assert max(rel(a, b) for a, b in zip(c, one)) <= 2e-3, (name, c, one)


def test_checkpointing_and_checkpoints(work):
    fp8 = ["--use_fp8", "true", "--micro_batch", "4", "--plugin", "none"]
    a, out, _ = train(work, "ck_a", fp8)
    b, _, b_log = train(work, "ck_b", fp8 + ["--grad_checkpoint", "true"])
    assert a == b
    # The recompute did happen (one per decoder layer and step), FP8 layers inside it.
    layers = json.loads((work / "model.json").read_text())["num_hidden_layers"]
    assert f"activation checkpointing (full): {10 * layers} block recomputes in 10 steps" in b_log, b_log[-2000:]
    _, plain_out, _ = train(work, "ck_plain", ["--micro_batch", "4", "--plugin", "none"])

    def tensors(o):
        with safe_open(str(o / "ck" / "step-00000010" / "model" / "model.safetensors"), "pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert tensors(out) == tensors(plain_out)
    from transformers import LlamaForCausalLM
    LlamaForCausalLM.from_pretrained(str(out / "ck" / "step-00000010" / "model"))


def test_bad_options_are_named(work):
    tp2 = ["--plugin", "hybrid", "--tp", "2", "--micro_batch", "2"]
    for name, extra, nproc, needle in [
            ("lora", ["--use_fp8", "true", "--lora_r", "4"], 0, "'use_fp8' and LoRA"),
            ("recipe", ["--use_fp8", "true", "--fp8_recipe", "delayed"], 0, "delayed"),
            ("tp_ring", ["--use_fp8", "true", "--sp_mode", "ring"] + tp2, 2, "sequence_parallelism_mode ring"),
            ("tp_rowwise", ["--use_fp8", "true", "--fp8_recipe", "rowwise"] + tp2, 2, "rowwise recipe is not supported "
             "under tensor parallelism")]:
        p = train(work, "bad_" + name, extra, nproc=nproc, ok=False)
        assert p.returncode == 2 and needle in p.stderr, (name, p.stderr[-2000:])
        assert "Exception raised from" not in p.stderr
