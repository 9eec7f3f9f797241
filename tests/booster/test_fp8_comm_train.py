"""`colossal train --fp8_communication true` (ColossalAI's fp8_communication): gradient buckets
all-reduced (ddp, ZeRO-1) or reduce-scattered (ZeRO-2) in FP8 e5m2 with per-slice scales, and
ZeRO's and Gemini's weight all-gathers in FP8 e4m3 (dist/fp8_collectives.h; the collectives
themselves are checked bit for bit in tests/dist/test_fp8_collectives.cpp).

- ddp, zero1, zero2 and gemini at 2 ranks stay within 1 % of the loss of the same run without
  FP8 communication over 10 steps, and differ from it (FP8 really travels).
- Checkpoints hold exact weights: the saved model is gathered exactly (an FP8-gathered tensor
  would have at most 2 x 255 distinct values), and resuming from it continues the unbroken run.
- `colossal bench --use_fp8_comm` (ColossalAI's benchmark flag) turns it on and reports it.
- Plugins that do not wire it (hybrid, none) refuse the flag by name.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from train_helpers import SEQ, make_work, rel, run_losses  # noqa: E402

BIN = os.environ["COLOSSAL_BIN"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("fp8_comm_train"))


def train(d, name, extra, nproc=2, ok=True):
    return run_losses(d / name, ["--model", str(d / "model.json"), "--data", str(d / "tokens.bin"), "--seq_len",
                                 str(SEQ), "--steps", "10", "--lr", "3e-3", "--warmup", "2", "--shuffle", "false",
                                 "--precision", "fp32", "--micro_batch", "2", "--seed", "7"] + extra, nproc, ok)


@pytest.mark.parametrize("plugin", ["ddp", "zero1", "zero2", "gemini"])
def test_close_to_plain_and_not_equal(work, plugin):
    fp8, log = train(work, f"fp8_{plugin}", ["--plugin", plugin, "--fp8_communication", "true"])
    assert "fp8 communication" in log, log[-2000:]
    plain, _ = train(work, f"plain_{plugin}", ["--plugin", plugin])
    assert len(fp8) == len(plain) == 10
    diff = max(rel(a, b) for a, b in zip(fp8, plain))
    assert diff > 1e-6, (plugin, fp8, plain)  # the gradients (and ZeRO's weights) went through FP8
    assert diff < 1e-2, (plugin, fp8, plain)


@pytest.mark.parametrize("plugin", ["zero2", "gemini"])
def test_checkpoints_are_exact_and_resume(work, plugin):
    fp8 = ["--plugin", plugin, "--fp8_communication", "true", "--save_every", "5"]
    full, _ = train(work, f"ck_{plugin}", fp8 + ["--save_dir", str(work / f"ck_{plugin}" / "ck")])
    ck = work / f"ck_{plugin}" / "ck"
    weights = load_file(str(ck / "step-00000005" / "model" / "model.safetensors"))
    big = max(weights.values(), key=lambda t: t.size)
    assert len(np.unique(big)) > 4 * 255, (plugin, len(np.unique(big)))
    resumed, _ = train(work, f"re_{plugin}", fp8 + ["--save_dir", str(work / f"re_{plugin}" / "ck"),
                                                    "--resume", str(ck / "step-00000005")])
    assert resumed == full[5:], (plugin, resumed, full)


def test_bench_flag(work):
    args = [BIN, "run", "--nproc_per_node", "2", "--master_port", "0", BIN, "bench", "-c", str(work / "model.json"),
            "-p", "zero2", "--use_fp8_comm", "-s", "3", "-i", "1", "-b", "2", "-l", str(SEQ)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(next(l for l in p.stdout.splitlines() if "RESULT " in l).split("RESULT ", 1)[1])
    assert result["config"]["fp8_communication"] is True
    assert "fp8 communication" in p.stderr


def test_unsupported_plugins_are_named(work):
    for plugin, nproc in (("hybrid", 2), ("none", 0)):
        p = train(work, f"bad_{plugin}", ["--plugin", plugin, "--fp8_communication", "true"], nproc=nproc, ok=False)
        assert p.returncode != 0
        assert "--fp8_communication is available with --plugin ddp, low_level_zero, zero1, zero2, gemini or " \
            "gemini_auto, not '" + plugin + "'" in p.stderr, (plugin, p.stderr[-2000:])
        assert "Exception raised from" not in p.stderr
