"""`colossal train --plugin hybrid --pp ...` end to end on CPU ranks: 1F1B, ZB-V, interleaved,
tp2 x pp2 and dp2 x pp2 with ZeRO-1 against `--plugin none` on the same global batch (every
step's loss and gradient norm within 1e-5 relative: fp32, the micro-batch means summed with
weight 1/M round differently from the one-process mean at 2^-24 per operation), gradient
accumulation, resume across (pp, tp, dp) changes on the same curve, `colossal bench -p 3d --pp 2`,
and bad input exiting 2 with the named message."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import BIN, MODEL, make_work, metrics, rel  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = make_work(tmp_path_factory.mktemp("pipeline"))
    # Four decoder layers: pp 4, or pp 2 with 2 chunks. A tied variant too.
    m = dict(MODEL, num_hidden_layers=4)
    (d / "model4.json").write_text(json.dumps(m))
    (d / "tied4.json").write_text(json.dumps(dict(m, tie_word_embeddings=True)))
    return d


def train(work, name, nproc, extra, steps=10, model="model4.json"):
    out = work / name
    out.mkdir(exist_ok=True)
    args = [BIN, "train", "--model", str(work / model), "--data", str(work / "tokens.bin"),
            "--seq_len", "16", "--steps", str(steps), "--lr", "3e-3", "--schedule", "cosine", "--warmup", "2",
            "--weight_decay", "0.1", "--max_grad_norm", "1.0", "--seed", "7", "--shuffle", "true",
            "--metrics_file", str(out / "metrics.jsonl")] + list(extra)
    if nproc > 0:
        args = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + args
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out, p


@pytest.fixture(scope="module")
def single(work):
    out, p = train(work, "single", 0, ["--plugin", "none", "--micro_batch", "4"])
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def single_tied(work):
    out, p = train(work, "single_tied", 0, ["--plugin", "none", "--micro_batch", "4"], model="tied4.json")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def assert_same_curve(out, ref, steps=range(1, 11)):
    a, b = metrics(out), metrics(ref)
    assert [m["step"] for m in a] == list(steps), a
    b = [m for m in b if m["step"] in steps]
    for x, y in zip(a, b):
        assert rel(x["loss"], y["loss"]) <= 1e-5, (x, y)
        assert rel(x["grad_norm"], y["grad_norm"]) <= 1e-5, (x, y)


@pytest.mark.parametrize("nproc,extra,tied", [
    (2, ["--pp", "2", "--num_microbatches", "4", "--micro_batch", "4", "--num_layers_per_stage", "1,3",
         "--num_ckpt_layers_per_stage", "1,2"], False),
    (2, ["--pp", "2", "--pp_style", "zbv", "--num_model_chunks", "2", "--num_microbatches", "4",
         "--micro_batch", "4", "--pp_balance", "cost"], True),
    (2, ["--pp", "2", "--pp_style", "interleaved", "--num_model_chunks", "2", "--microbatch_size", "1",
         "--micro_batch", "2", "--accumulation", "2"], False),
    (4, ["--pp", "4", "--num_microbatches", "4", "--micro_batch", "4", "--fused_ce", "false"], True),
    (4, ["--pp", "2", "--tp", "2", "--sp_mode", "split_gather", "--num_microbatches", "2", "--micro_batch", "4"],
     False),
    (4, ["--pp", "2", "--zero_stage", "1", "--num_microbatches", "2", "--micro_batch", "2"], True),
    (4, ["--pp", "2", "--sp", "2", "--sp_mode", "all_to_all", "--num_microbatches", "2", "--micro_batch", "4"],
     False),
])
def test_pipeline_matches_single_process(work, single, single_tied, nproc, extra, tied):
    name = "pp" + "_".join(extra).replace("-", "")
    out, p = train(work, name, nproc, ["--plugin", "hybrid"] + extra, model="tied4.json" if tied else "model4.json")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert_same_curve(out, single_tied if tied else single)


def test_schedule_table_and_fp16(work, single, tmp_path):
    """A user's schedule table (written by `colossal schedule --csv`, here zbh1's) drives the
    pipeline and gives the same curve; fp16 through the pipeline follows fp32 within what 11
    mantissa bits allow (2e-2 relative on these losses, as test_hybrid.py's) with no step skipped
    at the initial scale."""
    table = tmp_path / "zbh1.csv"
    p = subprocess.run([BIN, "schedule", "--pp", "2", "--num_microbatches", "4", "--pp_style", "zbh1",
                        "--csv", str(table)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    out, p = train(work, "pp_table", 2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "4",
                                         "--micro_batch", "4", "--pp_schedule_table", str(table)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert_same_curve(out, single)
    out, p = train(work, "pp_fp16", 2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "4",
                                        "--micro_batch", "4", "--precision", "fp16"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for x, y in zip(metrics(out), metrics(single)):
        assert rel(x["loss"], y["loss"]) <= 2e-2, (x, y)
        assert not x["skipped"]


def test_resume_across_layouts(work, single):
    """Saved at pp 2 (2 ranks), resumed at step 5 under tp 2, under dp2 x pp2 ZeRO-1 and under pp 4
    (4 ranks); and a tp 2 checkpoint resumed under pp 2: steps 6-10 follow the uninterrupted
    one-process curve within 1e-5 relative."""
    ckpt = work / "pp_ckpt"
    out, p = train(work, "pp_saved", 2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "2",
                                          "--micro_batch", "4", "--save_dir", str(ckpt), "--save_every", "5"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (ckpt / "step-00000005" / "model" / "model.safetensors.index.json").exists()
    for name, nproc, extra in [
            ("pp_to_tp", 2, ["--plugin", "hybrid", "--tp", "2", "--micro_batch", "4"]),
            ("pp_to_dp_pp", 4, ["--plugin", "hybrid", "--pp", "2", "--zero_stage", "1", "--num_microbatches", "2",
                                "--micro_batch", "2"]),
            ("pp_to_pp4", 4, ["--plugin", "hybrid", "--pp", "4", "--num_microbatches", "4", "--micro_batch", "4"])]:
        out, p = train(work, name, nproc, extra + ["--resume", str(ckpt / "step-00000005")])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert_same_curve(out, single, steps=range(6, 11))
    tp_ckpt = work / "tp_ckpt"
    out, p = train(work, "tp_saved", 2, ["--plugin", "hybrid", "--tp", "2", "--micro_batch", "4",
                                          "--save_dir", str(tp_ckpt), "--save_every", "5"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out, p = train(work, "tp_to_pp", 2, ["--plugin", "hybrid", "--pp", "2", "--pp_style", "zbh1",
                                         "--num_microbatches", "4", "--micro_batch", "4",
                                         "--resume", str(tp_ckpt / "step-00000005")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert_same_curve(out, single, steps=range(6, 11))


def test_bench_pp_matches_one_process(work, tmp_path):
    """`colossal bench -p 3d --pp 2` (the same random tokens as one process, dp 1) trains like
    `-p none`, and reports the pipeline's simulated and measured step times."""
    def bench(args, out, nproc=0):
        cmd = [BIN, "bench", "--device", "cpu", "-c", str(work / "model4.json"), "-l", "32", "-b", "4", "-s", "3",
               "-i", "1", "--json", str(out)] + args
        if nproc > 0:
            cmd = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + cmd
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        return json.loads(out.read_text())
    a = bench(["-p", "3d", "--pp", "2", "--num_microbatches", "4"], tmp_path / "pp.json", nproc=2)
    b = bench(["-p", "none"], tmp_path / "none.json")
    assert a["config"]["pp"] == 2 and a["config"]["pp_style"] == "1f1b"
    assert rel(a["final_loss"], b["final_loss"]) <= 1e-5, (a["final_loss"], b["final_loss"])


@pytest.mark.parametrize("nproc,extra,message", [
    (2, ["--plugin", "hybrid", "--pp", "2"], "needs exactly one of num_microbatches and microbatch_size"),
    (2, ["--plugin", "hybrid", "--pp", "2", "--zero_stage", "2", "--num_microbatches", "4"],
     "zero_stage=2 with pp_size=2"),
    (2, ["--plugin", "hybrid", "--pp", "2", "--pp_style", "zbv", "--num_microbatches", "4"],
     "pp_style zbv with num_model_chunks=1"),
    (2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "1"], "micro"),
    (2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "3"], "does not split"),
    (2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "4", "--num_layers_per_stage", "1,1"],
     "num_layers_per_stage"),
    (2, ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "4", "--pp_style", "zbh1",
         "--num_ckpt_layers_per_stage", "1,1"], "activation checkpointing does not support"),
])
def test_bad_input(work, nproc, extra, message):
    _, p = train(work, "bad", nproc, extra + ["--micro_batch", "4"], steps=2)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert message in p.stderr, p.stderr[-2000:]
