"""`colossal train --plugin gemini` end to end on CPU: static placements 0/0/0 (replicated chunks,
ZeRO-DDP), 1/0/0 (ZeRO-3), 1/1/1 (full offload) and 0.3/0.3/0.3 (mixed) and `auto` at 1, 2 and 4
ranks against ddp (or one process) on the same global batch; the memory report's accounting per
placement; no_sync accumulation; fp16/bf16 against ddp; resume across plugins (gemini -> ddp,
zero2 -> gemini) through full-shape checkpoints.

Tolerances: fp32 on CPU. Gemini reduce-scatters per chunk (ddp all-reduces per bucket) and sums
the squared norms per chunk shard: only the order of the sums differs, a few ulps (~1e-7
relative) per step, below 1e-5 over 10 AdamW steps (tests/booster/test_train.py's bound). The CPU
Adam of offloaded chunks matches ATen's fused AdamW to ~1e-7 per step (tests/optim), inside the
same bound. bf16/fp16: the working weights round identically when the fp32 masters agree to a few
ulps, so runs stay within 2e-3 of ddp in the same precision (observed: equal to print precision)."""
import json
import pathlib
import shutil
import sys

import pytest
from safetensors import safe_open

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import assert_runs_close, final_weights, make_work, metrics, rel, run_train  # noqa: E402


# Small chunks so the ~99k-parameter model spans several (4 chunks of 28672 elements).
CHUNKS = ["--min_chunk_size_m", "0.01", "--search_range_m", "0.02"]
GLOBAL = 8  # sequences per step


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("train_gemini"))


def memory_report(out):
    for line in (out / "log").read_text().splitlines():
        if line.startswith("[rank 0]") and "gemini memory after warm-up: " in line:
            return json.loads(line.split("gemini memory after warm-up: ", 1)[1])
    raise AssertionError("no memory report in the log")


_runs = {}


def cached(work, name, nproc, extra):
    if name not in _runs:
        _runs[name] = run_train(work, name, nproc, extra)
    return _runs[name]


def reference(work, nproc, precision="fp32"):
    """ddp at nproc ranks (one process with plugin none at nproc 1) on the same global batch."""
    if nproc == 1:
        return cached(work, f"none_{precision}", 0, ["--plugin", "none", "--micro_batch", str(GLOBAL),
                                                     "--precision", precision])
    return cached(work, f"ddp{nproc}_{precision}", nproc, ["--plugin", "ddp", "--micro_batch", str(GLOBAL // nproc),
                                                            "--precision", precision])


PLACEMENTS = {
    "0/0/0": ["--shard_param_frac", "0", "--offload_optim_frac", "0", "--offload_param_frac", "0"],
    "1/0/0": ["--shard_param_frac", "1", "--offload_optim_frac", "0", "--offload_param_frac", "0"],
    "1/1/1": ["--shard_param_frac", "1", "--offload_optim_frac", "1", "--offload_param_frac", "1"],
    "0.3/0.3/0.3": ["--shard_param_frac", "0.3", "--offload_optim_frac", "0.3", "--offload_param_frac", "0.3"],
    "auto": ["--placement_policy", "auto", "--max_prefetch", "2"],
}


def auto_capacity_mb(nproc):
    """A "device" on which, after warm-up (every chunk gathered + gradient buffers are the
    transient part), only some chunks' shards and optimizer data fit: the rest go to the host."""
    return {1: 2.0, 2: 1.6}.get(nproc, 1.2)


def gemini_run(work, placement, nproc, extra=(), precision="fp32"):
    name = f"gemini{nproc}_{placement.replace('/', '_')}_{precision}" + "".join(extra).replace("-", "_")
    mb = GLOBAL // max(nproc, 1)
    cap = ["--device_capacity_mb", str(auto_capacity_mb(nproc))] if placement == "auto" else []
    return cached(work, name, nproc, ["--plugin", "gemini", "--micro_batch", str(mb), "--precision", precision]
                  + CHUNKS + PLACEMENTS[placement] + cap + list(extra))


@pytest.mark.parametrize("nproc", [1, 2, 4])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_gemini_matches_ddp(work, placement, nproc):
    out = gemini_run(work, placement, nproc)
    ref = reference(work, nproc)
    assert_runs_close(out, ref)
    assert metrics(ref)[-1]["loss"] < metrics(ref)[0]["loss"] - 0.3  # it learns

    # The accounting of this placement, from rank 0's memory report after the first step
    # (between two steps: every sharded chunk holds only its shard, nothing is gathered).
    m = memory_report(out)
    W = nproc
    n, elems = m["num_chunks"], m["chunk_elements"]
    assert n == 4 and m["used_elements"] == 98624 and m["gathered_chunks"] == 0
    total = lambda k: m[k]["device"] + m[k]["host"]
    if placement == "0/0/0" or W == 1:
        assert m["sharded_chunks"] == (0 if placement == "0/0/0" or W == 1 else n)
        assert total("params") == 4 * elems  # full fp32 chunks on every rank
    if placement in ("1/0/0", "1/1/1", "auto") and W > 1:
        assert m["sharded_chunks"] == n
        assert total("params") == 4 * elems // W  # only the shards
        assert total("masters") == 4 * elems // W and total("optimizer_states") == 8 * elems // W
    if placement == "1/0/0":
        assert all(m[k]["host"] == 0 for k in ("params", "grads", "masters", "optimizer_states"))
        assert m["traffic"] == {"host_to_device": 0, "device_to_host": 0}
    if placement == "1/1/1":
        assert all(m[k]["device"] == 0 for k in ("masters", "optimizer_states", "grads"))
        # Every parameter shard on the host (one rank too: chunks are copied up at each access).
        assert m["params"]["device"] == 0 and m["params"]["host"] == 4 * elems // W
        # Step 1: each host shard gathered once; gradient parts (and the shards at boost) down.
        assert m["traffic"] == {"host_to_device": 4 * elems // W, "device_to_host": 2 * 4 * elems // W}
    if placement == "0.3/0.3/0.3":
        # first 30% of chunk memory (chunk 0 + part of 1 -> chunks 0 and 1 start before 30%):
        # optimizer on the host; last 30% sharded, and that one's parameter shard on the host.
        chunk = elems // n
        assert m["masters"]["host"] == 2 * 4 * chunk and m["masters"]["device"] == 4 * chunk + 4 * chunk // W
        if W > 1:
            assert m["sharded_chunks"] == 1 and m["params"]["host"] == 4 * chunk // W
    if placement == "auto":
        assert m["masters"]["host"] > 0 and m["masters"]["device"] > 0  # the budget split them
        assert m["peak_device"] <= auto_capacity_mb(W) * 1024 * 1024


def test_gemini_accumulation_equals_big_batch(work):
    """4 micro-steps of 1 sequence per rank (no_sync on the first 3) == 1 step of 4 per rank."""
    acc = cached(work, "gemini_acc", 2, ["--plugin", "gemini", "--micro_batch", "1", "--accumulation", "4"] + CHUNKS)
    assert_runs_close(acc, reference(work, 2))
    assert_runs_close(acc, reference(work, 1))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gemini_half_precision_tracks_ddp(work, precision):
    out = gemini_run(work, "1/0/0", 2, precision=precision)
    assert_runs_close(out, reference(work, 2, precision), tol=2e-3)
    assert metrics(out)[0]["loss_scale"] == (65536.0 if precision == "fp16" else 1.0)


def resume_from(work, src, name, nproc, extra):
    """Steps 6-10 from `src`'s step-5 checkpoint, in a fresh folder (as if the job died there)."""
    part = work / name
    (part / "ckpt").mkdir(parents=True)
    shutil.copytree(src / "ckpt" / "step-00000005", part / "ckpt" / "step-00000005")
    (part / "ckpt" / "latest").write_text("step-00000005\n")
    (part / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics(src)[:5]))
    return run_train(work, name, nproc, extra + ["--resume", str(part / "ckpt")])


def test_resume_gemini_under_ddp(work):
    src = cached(work, "gemini4_save", 4, ["--plugin", "gemini", "--micro_batch", "2", "--precision", "bf16",
                                           "--save_every", "5"] + CHUNKS + PLACEMENTS["0.3/0.3/0.3"])
    # Full-shape optimizer states by parameter name, bf16 masters included.
    w = final_weights(src, 5)
    with safe_open(str(src / "ckpt" / "step-00000005" / "optimizer.safetensors"), "pt") as f:
        assert set(f.keys()) == {f"{k}.{s}" for k in w for s in ("exp_avg", "exp_avg_sq", "master")}
        for k in w:
            assert f.get_tensor(f"{k}.master").shape == w[k].shape
            assert f.get_tensor(f"{k}.master").dtype == f.get_tensor(f"{k}.exp_avg").dtype
    part = resume_from(work, src, "resume_ddp2", 2, ["--plugin", "ddp", "--micro_batch", "4", "--precision", "bf16"])
    assert_runs_close(part, src, tol=2e-3, first=5)


def test_resume_zero2_under_gemini(work):
    src = cached(work, "zero2_save", 4, ["--plugin", "zero2", "--micro_batch", "2", "--save_every", "5"])
    part = resume_from(work, src, "resume_gemini2", 2, ["--plugin", "gemini", "--micro_batch", "4"] + CHUNKS
                       + PLACEMENTS["1/1/1"])
    assert_runs_close(part, src, first=5)


def test_gemini_fp16_overflow_skips_as_ddp(work):
    """A loss scale far too large: the first four steps overflow on every rank and are skipped (no
    update, the scale backs off by 1e-4 each time), then training proceeds; offloaded (CPU Adam)
    and device chunks alike. Skips, scales and losses as ddp in fp16."""
    f = ["--precision", "fp16", "--initial_scale", "1e20", "--max_scale", "1e20", "--hysteresis", "1",
         "--backoff_factor", "1e-4"]
    ddp = cached(work, "ddp2_fp16_overflow", 2, ["--plugin", "ddp", "--micro_batch", "4"] + f)
    g = cached(work, "gemini2_fp16_overflow", 2, ["--plugin", "gemini", "--micro_batch", "4", "--offload_optim_frac",
                                                  "0.5"] + CHUNKS + f)
    a, b = metrics(g), metrics(ddp)
    assert [m["skipped"] for m in a] == [m["skipped"] for m in b] == [True] * 4 + [False] * 6
    assert [m["loss_scale"] for m in a] == [m["loss_scale"] for m in b]
    for x, y in zip(a, b):
        assert rel(x["loss"], y["loss"]) <= 2e-3, (x, y)
    assert a[-1]["loss"] < a[0]["loss"] - 0.2
