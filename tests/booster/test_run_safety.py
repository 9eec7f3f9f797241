"""`colossal train` never loses a run: an unusable --save_dir fails before step 1, the folder is
locked for the job and a used one is not overwritten without --overwrite, resume finds the
newest complete checkpoint and cleans the leftovers of interrupted saves, a resume says (and
applies) what its options change and refuses other data, the metrics file is truncated to the
resumed step and its write errors are loud, --keep_last prunes, a diverging run stops with an
error and never saves a non-finite model, and SIGTERM / SIGUSR1 save at a step boundary and exit
with 128 + signo (2 ranks under `colossal run`, resumed bitwise).

The tiny model of train_helpers; steps take milliseconds, so each case is one or a few short
runs of a few steps."""
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import BIN, SEQ, make_work  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("safety"))


def args(work, out, steps, extra, nproc=0):
    """`colossal train` of the tiny model for `steps` steps, metrics in out/metrics.jsonl and
    checkpoints in out/ckpt unless `extra` says otherwise; a constant lr, so --steps changes
    nothing but the number of steps."""
    a = [BIN, "train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
         "--seq_len", str(SEQ), "--steps", str(steps), "--lr", "3e-3", "--schedule", "constant",
         "--weight_decay", "0.1", "--max_grad_norm", "1.0", "--seed", "7", "--micro_batch", "2",
         "--metrics_file", str(out / "metrics.jsonl"), "--save_dir", str(out / "ckpt")]
    a += ["--plugin", "ddp" if nproc else "none"] + list(extra)
    if nproc:
        a = [BIN, "run", "--nproc_per_node", str(nproc), "--master_port", "0"] + a
    return a


def train(work, out, steps, extra=(), ok=True, nproc=0):
    out.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(args(work, out, steps, extra, nproc), capture_output=True, text=True, timeout=300,
                       env=ENV)
    if ok:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def steps_of(out, name="metrics.jsonl"):
    f = out / name
    return [json.loads(l)["step"] for l in f.read_text().splitlines()] if f.exists() else []


def latest(out):
    return (out / "ckpt" / "latest").read_text().strip()


@pytest.mark.parametrize("case", ["under_a_file", "name_too_long", "read_only"])
def test_unusable_save_dir_fails_before_step_1(work, tmp_path, case):
    if case == "under_a_file":
        (tmp_path / "file").write_text("x")
        bad, reason = tmp_path / "file" / "ckpt", "Not a directory"
    elif case == "name_too_long":
        bad, reason = tmp_path / ("x" * 300), "File name too long"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        if os.access(ro, os.W_OK):  # root: permissions do not stop it; sysfs refuses anyone
            bad, reason = pathlib.Path("/sys/colossal_probe/ckpt"), "ermitted"
        else:
            bad, reason = ro / "ckpt", "Permission denied"
    p = train(work, tmp_path, 5, ["--save_dir", str(bad)], ok=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "option 'save_dir'" in p.stderr and str(bad) in p.stderr and reason in p.stderr, p.stderr[-2000:]
    assert steps_of(tmp_path) == []  # before step 1


def test_save_dir_locked_by_another_job(work, tmp_path):
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("host otherhost pid 4242\n")
        f.flush()
        p = train(work, tmp_path, 3, ok=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "in use by another training job" in p.stderr and "pid 4242" in p.stderr, p.stderr[-2000:]
    assert str(tmp_path / "ckpt") in p.stderr
    assert steps_of(tmp_path) == []


def test_used_save_dir_needs_overwrite(work, tmp_path):
    train(work, tmp_path, 3)
    assert latest(tmp_path) == "step-00000003"
    p = train(work, tmp_path, 2, ok=False)
    assert p.returncode == 2 and "already holds a run" in p.stderr and "--overwrite" in p.stderr, p.stderr[-2000:]
    assert latest(tmp_path) == "step-00000003"  # untouched
    assert steps_of(tmp_path) == [1, 2, 3]
    # --overwrite deletes the old run only once everything else is built: a run that cannot
    # start (seq_len past the model's positions) leaves it.
    p = train(work, tmp_path, 2, ["--overwrite", "--seq_len", "100"], ok=False)
    assert p.returncode == 2 and "max_position_embeddings" in p.stderr, p.stderr[-2000:]
    assert latest(tmp_path) == "step-00000003"
    train(work, tmp_path, 2, ["--overwrite"])
    assert latest(tmp_path) == "step-00000002"
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".lock", "latest", "step-00000002"]
    assert steps_of(tmp_path) == [1, 2]  # the old run's lines are gone too


def test_resume_picks_newest_complete_step_and_cleans_leftovers(work, tmp_path):
    train(work, tmp_path, 4, ["--save_every", "2"])
    ck = tmp_path / "ckpt"
    # Killed between committing step-4 and rewriting latest, and during other saves.
    (ck / "latest").write_text("step-00000002\n")
    (ck / "latest.tmp-12345").write_text("step-00000004\n")
    (ck / "step-00000006.staging").mkdir()
    shutil.copytree(ck / "step-00000002", ck / "step-00000002.old")
    p = train(work, tmp_path, 6, ["--resume", str(ck)])
    assert "step-00000004 is newer and complete" in p.stderr, p.stderr[-3000:]
    assert "resumed from " + str(ck / "step-00000004") in p.stderr
    assert steps_of(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(ck)) == [".lock", "latest", "step-00000002", "step-00000004", "step-00000006"]
    # No latest at all: the newest complete step.
    (ck / "latest").unlink()
    p = train(work, tmp_path, 7, ["--resume", str(ck)])
    assert "has no latest file" in p.stderr and "resumed from " + str(ck / "step-00000006") in p.stderr, \
        p.stderr[-3000:]


def test_resume_applies_new_optimizer_options_and_truncates_metrics(work, tmp_path):
    train(work, tmp_path, 4, ["--save_every", "2"])
    before = {m["step"]: m for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert all(m["lr"] == 3e-3 for m in before.values())
    p = train(work, tmp_path, 4, ["--resume", str(tmp_path / "ckpt" / "step-00000002"), "--lr", "1e-3",
                                  "--weight_decay", "0"])
    assert "lr: 0.003 in the checkpoint, 0.001 now" in p.stderr, p.stderr[-3000:]
    assert "weight_decay: 0.1 in the checkpoint, 0 now" in p.stderr, p.stderr[-3000:]
    after = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in after] == [1, 2, 3, 4]  # no step twice
    assert after[2]["lr"] == 1e-3 and after[3]["lr"] == 1e-3
    assert after[2]["loss"] == before[3]["loss"]  # step 3's loss is before its update
    assert after[3]["loss"] != before[4]["loss"]  # the new lr really moved the weights


def test_resume_refuses_other_data(work, tmp_path):
    train(work, tmp_path, 2)
    other = tmp_path / "other.bin"
    data = bytearray((work / "tokens.bin").read_bytes())
    data[100] ^= 1
    other.write_bytes(bytes(data))
    p = train(work, tmp_path, 4, ["--resume", str(tmp_path / "ckpt"), "--data", str(other)], ok=False)
    assert p.returncode == 2 and "Differences:" in p.stderr and "data: " in p.stderr, p.stderr[-2000:]
    # The same bytes under another name are the same data.
    same = tmp_path / "same.bin"
    shutil.copy(work / "tokens.bin", same)
    p = train(work, tmp_path, 3, ["--resume", str(tmp_path / "ckpt"), "--data", str(same), "--seed", "8"],
              ok=False)
    assert p.returncode == 2 and "seed: 7 in the checkpoint, 8 now" in p.stderr, p.stderr[-2000:]
    p = train(work, tmp_path, 3, ["--resume", str(tmp_path / "ckpt"), "--data", str(same)])
    assert "(the same content)" in p.stderr, p.stderr[-2000:]
    assert latest(tmp_path) == "step-00000003"


def test_metrics_write_error_is_loud(work, tmp_path):
    p = train(work, tmp_path, 4, ["--save_every", "1", "--metrics_file", "/dev/full"], ok=False)
    assert p.returncode != 0
    assert "cannot write the metrics file /dev/full" in p.stderr and "No space left" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "ckpt" / "step-00000001").exists()  # stopped at the first line


def test_keep_last(work, tmp_path):
    train(work, tmp_path, 5, ["--save_every", "1", "--keep_last", "2"])
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".lock", "latest", "step-00000004", "step-00000005"]


def test_diverging_run_stops_and_never_saves_nan(work, tmp_path):
    # lr 1e30: step 1 moves the weights to ~1e30 (finite), the gradients of step 2 on are not
    # finite (each step skipped, the run learning nothing).
    p = train(work, tmp_path / "a", 30, ["--lr", "1e30", "--max_nonfinite_steps", "3"], ok=False)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "training diverged: 3 consecutive steps" in p.stderr and "max_nonfinite_steps" in p.stderr, \
        p.stderr[-2000:]
    assert steps_of(tmp_path / "a") == [1, 2, 3, 4]
    assert not (tmp_path / "a" / "ckpt" / "latest").exists()
    # lr 1e39 (past fp32's range): the first update makes the weights inf; saving that is refused
    # and latest keeps naming the finite step-2.
    b = tmp_path / "b"
    train(work, b, 2)
    p = train(work, b, 30, ["--resume", str(b / "ckpt"), "--lr", "1e39", "--save_every", "1"], ok=False)
    assert p.returncode == 1 and "refusing to save step 3" in p.stderr, p.stderr[-2000:]
    assert latest(b) == "step-00000002"
    assert sorted(os.listdir(b / "ckpt")) == [".lock", "latest", "step-00000002"]


def test_fp16_run_with_non_finite_losses_stops(work, tmp_path):
    # fp16: overflow skips while the scale backs off are normal; steps whose loss itself is not
    # finite count (here from step 2 on).
    p = train(work, tmp_path, 30, ["--plugin", "ddp", "--precision", "fp16", "--initial_scale", "16",
                                   "--lr", "1e30", "--max_nonfinite_steps", "3"], ok=False)
    assert p.returncode == 1 and "training diverged: 3 consecutive steps" in p.stderr, p.stderr[-2000:]
    assert steps_of(tmp_path) == [1, 2, 3, 4]


def wait_for_metrics(proc, out, timeout=60):
    t0 = time.time()
    while not steps_of(out):
        assert proc.poll() is None, "the run ended before its first step"
        assert time.time() - t0 < timeout
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_signal_saves_and_exits(work, tmp_path, sig):
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(args(work, tmp_path, 100000, []), stdout=log, stderr=log, env=ENV)
        wait_for_metrics(proc, tmp_path)
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    assert rc == 128 + sig, (tmp_path / "log").read_text()[-2000:]
    n = steps_of(tmp_path)[-1]
    assert latest(tmp_path) == f"step-{n:08d}" and n < 100000


def test_second_signal_stops_at_once(work, tmp_path):
    # Two signals delivered together (held back by SIGSTOP, then released): one handler asks for
    # the save, the other finds that asked already and takes the signal's default action. (Kept
    # from before: a second Ctrl-C never waits for a save.)
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(args(work, tmp_path, 100000, []), stdout=log, stderr=log, env=ENV)
        wait_for_metrics(proc, tmp_path)
        proc.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        rc = proc.wait(timeout=60)
    assert rc in (-signal.SIGINT, -signal.SIGUSR1), (rc, (tmp_path / "log").read_text()[-2000:])
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_sigterm_saves_on_every_rank_and_resumes_bitwise(work, tmp_path):
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    with open(stopped / "log", "w") as log:
        proc = subprocess.Popen(args(work, stopped, 100000, [], nproc=2), stdout=log, stderr=log, env=ENV)
        wait_for_metrics(proc, stopped)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    text = (stopped / "log").read_text()
    assert rc == 143, text[-3000:]
    k = steps_of(stopped)[-1]
    assert k < 100000 and latest(stopped) == f"step-{k:08d}", text[-3000:]
    assert "SIGKILL" not in text  # saved and left within the launcher's grace period
    # Resumed to k + 3 against an unbroken run of k + 3 steps: the same bits.
    train(work, stopped, k + 3, ["--resume", str(stopped / "ckpt")], nproc=2)
    whole = tmp_path / "whole"
    train(work, whole, k + 3, [], nproc=2)
    a = [json.loads(l) for l in (stopped / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in a] == list(range(1, k + 4))
    for x, y in zip(a[k:], b[k:]):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"], (x, y)
    wa = load_file(str(stopped / "ckpt" / f"step-{k + 3:08d}" / "model" / "model.safetensors"))
    wb = load_file(str(whole / "ckpt" / f"step-{k + 3:08d}" / "model" / "model.safetensors"))
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
