"""`colossal train --plugin zero1/zero2` end to end on CPU: against one process and ddp, no_sync
accumulation under ZeRO-2, and resume across data-parallel sizes and plugins (full-shape optimizer
checkpoints: a ZeRO-2 run on 4 ranks resumed on 2, under ddp, and a ddp checkpoint under ZeRO-2).

Tolerances: fp32 on CPU. ZeRO ranks reduce their own rows' gradients (all-reduce or
reduce-scatter), one process sums all rows at once: only the summation order differs, a few ulps
(~1e-7 relative) per step, below 1e-5 over 10 AdamW steps (the bound of tests/booster/test_train.py).
The same holds after a resume on another rank count: the restored state is the same fp32 values,
only the order of the gradient sums changes."""
import json
import pathlib
import shutil
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import assert_runs_close, final_weights, make_work, metrics, run_train  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("train_zero"))


@pytest.fixture(scope="module")
def single(work):
    return run_train(work, "single", 0, ["--plugin", "none", "--micro_batch", "8"])


@pytest.fixture(scope="module")
def zero2_4(work):
    return run_train(work, "zero2_4", 4, ["--plugin", "zero2", "--micro_batch", "2", "--save_every", "5"])


_runs = {}


def zero_run(work, plugin, nproc, mb, overlap=False):
    """One run per configuration per module (shared by the tests that compare against it)."""
    name = f"{plugin}_{nproc}" + ("_overlap" if overlap else "")
    if name not in _runs:
        extra = ["--plugin", plugin, "--micro_batch", str(mb)]
        _runs[name] = run_train(work, name, nproc, extra + (["--overlap_allgather", "true"] if overlap else []))
    return _runs[name]


@pytest.mark.parametrize("plugin,nproc,mb", [("zero1", 2, 4), ("zero1", 4, 2), ("zero2", 2, 4), ("zero2", 1, 8)])
def test_zero_matches_single_process(work, single, plugin, nproc, mb):
    out = zero_run(work, plugin, nproc, mb)
    assert_runs_close(out, single)
    assert metrics(single)[-1]["loss"] < metrics(single)[0]["loss"] - 0.3  # it learns


def test_zero2_4_ranks_matches_ddp_and_single(work, single, zero2_4):
    ddp = run_train(work, "ddp_4", 4, ["--plugin", "ddp", "--micro_batch", "2"])
    assert_runs_close(zero2_4, ddp)
    assert_runs_close(zero2_4, single)


@pytest.mark.parametrize("nproc,mb", [(2, 1), (1, 2)])
def test_zero2_accumulation_equals_big_batch(work, single, nproc, mb):
    # One rank takes the gradients straight from backward (no reduce-scatter): the first
    # micro-step's gradient is copied into the fp32 shard, the next three added.
    acc = run_train(work, f"acc_{nproc}", nproc, ["--plugin", "low_level_zero", "--stage", "2",
                                                   "--micro_batch", str(mb), "--accumulation", "4"])
    assert_runs_close(acc, single)


def resume_from(work, src, name, nproc, extra):
    """Steps 6-10 from `src`'s step-5 checkpoint, in a fresh folder (as if the job died there)."""
    part = work / name
    (part / "ckpt").mkdir(parents=True)
    shutil.copytree(src / "ckpt" / "step-00000005", part / "ckpt" / "step-00000005")
    (part / "ckpt" / "latest").write_text("step-00000005\n")
    (part / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics(src)[:5]))
    return run_train(work, name, nproc, extra + ["--resume", str(part / "ckpt")])


def test_resume_zero2_4_ranks_on_2_ranks(work, zero2_4):
    # The optimizer checkpoint is full-shape: the same names as plain AdamW's.
    from safetensors import safe_open
    with safe_open(str(zero2_4 / "ckpt" / "step-00000005" / "optimizer.safetensors"), "pt") as f:
        keys = set(f.keys())
    w = final_weights(zero2_4, 5)
    assert keys == {f"{k}.{s}" for k in w for s in ("exp_avg", "exp_avg_sq")}
    with safe_open(str(zero2_4 / "ckpt" / "step-00000005" / "optimizer.safetensors"), "pt") as f:
        for k in w:
            assert f.get_tensor(f"{k}.exp_avg").shape == w[k].shape
    part = resume_from(work, zero2_4, "resume_z2_2", 2, ["--plugin", "zero2", "--micro_batch", "4"])
    assert_runs_close(part, zero2_4, first=5)


def test_resume_zero2_under_ddp_and_back(work, zero2_4):
    part = resume_from(work, zero2_4, "resume_ddp_2", 2, ["--plugin", "ddp", "--micro_batch", "4"])
    assert_runs_close(part, zero2_4, first=5)
    ddp_full = run_train(work, "ddp_2_full", 2, ["--plugin", "ddp", "--micro_batch", "4", "--save_every", "5"])
    back = resume_from(work, ddp_full, "resume_z1_4", 4, ["--plugin", "zero1", "--micro_batch", "2"])
    assert_runs_close(back, ddp_full, first=5)


def assert_runs_identical(a_out, b_out, steps=(10,)):
    a, b = metrics(a_out), metrics(b_out)
    assert len(a) == len(b) == 10
    for x, y in zip(a, b):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), (x, y)
    for step in steps:
        wa, wb = final_weights(a_out, step), final_weights(b_out, step)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert (wa[k] == wb[k]).all(), (step, k)


@pytest.mark.parametrize("plugin,nproc,mb", [("zero1", 2, 4), ("zero1", 4, 2), ("zero2", 2, 4)])
def test_overlap_allgather_is_bitwise_synchronous(work, plugin, nproc, mb):
    """--overlap_allgather true only moves the weight all-gather off step()'s critical path (the
    decoder layers' forward pre hooks wait for their buckets): same fp32 arithmetic, so losses,
    norms and the saved weights are bitwise those of the synchronous run."""
    assert_runs_identical(zero_run(work, plugin, nproc, mb, overlap=True), zero_run(work, plugin, nproc, mb))


def test_overlap_allgather_zero2_4_ranks_checkpoint_after_step(work, zero2_4):
    # --save_every 5: the step-5 checkpoint is written right after step(), before any forward
    # could have waited for the gathers: save_model must wait for them itself.
    out = run_train(work, "zero2_4_overlap", 4, ["--plugin", "zero2", "--micro_batch", "2", "--save_every", "5",
                                                  "--overlap_allgather", "true"])
    assert_runs_identical(out, zero2_4, steps=(5, 10))
