"""`colossal train --attn_backend own` (our sm_90a attention kernels in every core-attention slot).
On the CPU every call goes to SDPA, so the curve is the SDPA run's bit for bit and the run says
how many calls took which kernel and why; `--deterministic` without `own`, and a bad
COLOSSAL_ATTENTION_SCHEDULE, COLOSSAL_ATTENTION_L2_MB or COLOSSAL_ATTENTION_BWD_INTERLEAVE, are
named errors. The
kernels themselves are tested on the GPU (tests/kernels/test_attention_cuda.cpp and the model
test in test_model_cuda.cpp).
"""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from train_helpers import SEQ, make_work, run_losses  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("own_attention"))


def train(d, name, extra, ok=True, env=None, nproc=0):
    return run_losses(d / name, ["--model", str(d / "model.json"), "--data", str(d / "tokens.bin"), "--seq_len",
                                 str(SEQ), "--steps", "4", "--lr", "3e-3", "--shuffle", "false", "--precision", "fp32",
                                 "--seed", "7"] + extra, nproc, ok, env)


def test_own_backend_falls_back_to_sdpa_on_the_cpu_and_says_so(work):
    sdpa, _ = train(work, "sdpa", [])
    own, log = train(work, "own", ["--attn_backend", "own"])
    assert own == sdpa
    assert "attention kernels: own 0 calls (schedule pingpong+dq_tma, L2 24 MiB, backward order auto), SDPA" in log, log[-2000:]
    assert "not on a CUDA device" in log or "no sm_90a attention kernels" in log, log[-2000:]


def test_deterministic_mode_is_named_in_the_report(work):
    sdpa, _ = train(work, "sdpa_det", [])
    own, log = train(work, "own_det", ["--attn_backend", "own", "--deterministic", "true"])
    assert own == sdpa
    assert "(schedule pingpong+dq_tma, L2 24 MiB, backward order auto, deterministic), SDPA" in log, log[-2000:]


def test_deterministic_needs_the_own_backend(work):
    p = train(work, "bad", ["--deterministic", "true"], ok=False)
    assert p.returncode == 2 and "needs attn_backend" in p.stderr, p.stderr[-2000:]
    assert "Exception raised from" not in p.stderr


def test_a_bad_schedule_is_a_named_error_before_training(work):
    p = train(work, "badsched", ["--attn_backend", "own"], ok=False, env={"COLOSSAL_ATTENTION_SCHEDULE": "fastest"})
    assert p.returncode == 2 and "COLOSSAL_ATTENTION_SCHEDULE" in p.stderr and "'fastest'" in p.stderr, p.stderr[-2000:]
    assert "Exception raised from" not in p.stderr and "step 1" not in p.stdout


def test_a_bad_l2_budget_is_a_named_error_before_training(work):
    p = train(work, "badl2", ["--attn_backend", "own"], ok=False, env={"COLOSSAL_ATTENTION_L2_MB": "24M"})
    assert p.returncode == 2 and "COLOSSAL_ATTENTION_L2_MB '24M'" in p.stderr, p.stderr[-2000:]
    assert "Exception raised from" not in p.stderr and "step 1" not in p.stdout


def test_a_bad_backward_interleave_is_a_named_error_before_training(work):
    p = train(work, "badbi", ["--attn_backend", "own"], ok=False, env={"COLOSSAL_ATTENTION_BWD_INTERLEAVE": "101"})
    assert p.returncode == 2 and "COLOSSAL_ATTENTION_BWD_INTERLEAVE '101'" in p.stderr, p.stderr[-2000:]
    assert "Exception raised from" not in p.stderr and "step 1" not in p.stdout


@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
def test_sequence_parallel_keeps_our_kernels_and_the_deterministic_setting(work, mode):
    """The hybrid plugin's sequence-parallel plan replaces the core-attention slots after
    `--attn_backend own` filled them: all_to_all keeps ours as its inner attention (counted in the
    report; on the CPU each call goes to SDPA). ring_attn's blocks on the CPU are the fp32
    composite either way, so here it only has to train and say so; that it takes `--deterministic`
    is checked in tests/nn/test_sequence_parallel.cpp. The curve is the plain run's bit for bit."""
    sp = ["--plugin", "hybrid", "--sp", "2", "--sp_mode", mode]
    plain, _ = train(work, f"sp_{mode}", sp, nproc=2)
    own, log = train(work, f"sp_{mode}_own", ["--attn_backend", "own", "--deterministic", "true"] + sp, nproc=2)
    assert own == plain
    if mode == "all_to_all":
        m = re.search(r"attention kernels: own 0 calls \(.*\), SDPA (\d+)", log)
        assert m and int(m.group(1)) > 0, log[-2000:]  # before, Ulysses's inner was SDPA itself
    else:
        assert "ring_attn: blocks computed by the composite kernel" in log, log[-2000:]
