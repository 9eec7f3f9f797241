"""`colossal train --async_save` (issue 23): checkpoints written by a background thread while
training goes on.

- Per plugin (ddp, zero2, gemini, hybrid tp2 and pp2) at 2 ranks: every file of every checkpoint is
  byte-identical to the synchronous run's, `latest` names the last step, no staging folder or
  rank marker is left, and a run resumed from an asynchronously written checkpoint (itself
  saving asynchronously) ends bitwise equal to the unbroken synchronous run.
- A rank SIGKILLed while a checkpoint is being saved (its staging folder exists; with a save
  every step, mostly while it is written in the background) leaves `latest` naming a complete
  checkpoint, from which the run resumes."""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import BIN, SEQ, make_work, train  # noqa: E402

PLUGINS = {
    "ddp": ["--plugin", "ddp", "--micro_batch", "2"],
    "zero2": ["--plugin", "zero2", "--micro_batch", "2", "--precision", "fp32"],
    "gemini": ["--plugin", "gemini", "--micro_batch", "2", "--precision", "fp32"],
    "hybrid": ["--plugin", "hybrid", "--tp", "2", "--micro_batch", "4", "--precision", "fp32"],
    # Both stages write files into the step folder; the model folder is staged by the IO itself.
    "hybrid_pp": ["--plugin", "hybrid", "--pp", "2", "--num_microbatches", "2", "--micro_batch", "4", "--precision", "fp32"],
}
# trainer_state.json records the run's config (which names --async_save): every other file.
SKIP = {"trainer_state.json"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("async"))


def files(step_dir):
    return sorted(p.relative_to(step_dir) for p in step_dir.rglob("*") if p.is_file() and p.name not in SKIP)


def assert_same_checkpoint(a, b):
    fa, fb = files(a), files(b)
    assert fa == fb, (fa, fb)
    assert fa, a
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{a / f} differs from {b / f}"


def assert_clean(ckpt):
    left = [p.name for p in ckpt.iterdir() if ".staging" in p.name or ".tmp-" in p.name]
    assert not left, left
    markers = [str(p) for p in ckpt.rglob(".written-rank*")]
    assert not markers, markers


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_async_equals_sync_and_resumes_bitwise(work, plugin):
    extra = PLUGINS[plugin] + ["--save_every", "5", "--shuffle", "true"]
    sync, _ = train(work, f"{plugin}_sync", 2, extra, shuffle=None)
    asyn, _ = train(work, f"{plugin}_async", 2, extra + ["--async_save", "true"], shuffle=None)
    for step in (5, 10):
        name = f"step-{step:08d}"
        assert_same_checkpoint(asyn / "ckpt" / name, sync / "ckpt" / name)
    assert (asyn / "ckpt" / "latest").read_text().strip() == "step-00000010"
    assert_clean(asyn / "ckpt")
    # Resume from the asynchronously written step 5, saving asynchronously again.
    part = work / f"{plugin}_part"
    (part / "ckpt").mkdir(parents=True)
    shutil.copytree(asyn / "ckpt" / "step-00000005", part / "ckpt" / "step-00000005")
    (part / "ckpt" / "latest").write_text("step-00000005\n")
    train(work, f"{plugin}_part", 2, extra + ["--async_save", "true", "--resume", str(part / "ckpt")], shuffle=None)
    assert_same_checkpoint(part / "ckpt" / "step-00000010", sync / "ckpt" / "step-00000010")
    assert_clean(part / "ckpt")


def children(pid):
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(d.name))
    return out


@pytest.mark.parametrize("delay", [0.0, 0.003, 0.02])
def test_kill_during_async_saves_keeps_latest(work, delay):
    name = f"kill{int(delay * 1000)}"
    out = work / name
    out.mkdir()
    ckpt = out / "ckpt"

    def args(steps, extra=()):
        return [BIN, "run", "--nproc_per_node", "2", "--master_port", "0", BIN, "train", "--model",
                str(work / "model.json"), "--data", str(work / "tokens.bin"), "--seq_len", str(SEQ),
                "--steps", str(steps), "--lr", "1e-3", "--seed", "7", "--plugin", "zero2", "--precision",
                "fp32", "--micro_batch", "2", "--save_every", "1", "--async_save", "true", "--save_dir",
                str(ckpt)] + list(extra)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(args(400), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.time() + 120
        while not (ckpt / "latest").exists():
            assert p.poll() is None and time.time() < deadline, "no checkpoint was written"
            time.sleep(0.01)
        # A save in progress: its staging folder exists until rank 0's writer publishes it.
        while not list(ckpt.glob("*.staging")):
            assert p.poll() is None and time.time() < deadline, "no save in progress seen"
        time.sleep(delay)
        ranks = children(p.pid)
        assert len(ranks) >= 2, ranks
        os.kill(max(ranks), signal.SIGKILL)  # one rank, while saves run every step
        p.communicate(timeout=120)
        assert p.returncode != 0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    latest = (ckpt / "latest").read_text().strip()
    step_dir = ckpt / latest
    assert (step_dir / "trainer_state.json").exists(), latest
    assert (step_dir / "optimizer.safetensors").exists(), latest
    assert not list(step_dir.glob(".written-rank*"))
    step = int(latest.split("-")[1])
    # The checkpoint `latest` names loads: resume it for two more steps.
    r = subprocess.run(args(step + 2, ["--resume", str(ckpt)]), capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == f"step-{step + 2:08d}"
