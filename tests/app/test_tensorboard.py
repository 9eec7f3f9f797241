"""`colossal train --tensorboard DIR`: the event files are read back by TensorBoard's own code
(the `tensorboard` package pinned in scripts/requirements.txt): every record passes its
TFRecord CRC checks and parses as TensorFlow's `Event`; the EventAccumulator (and the plugin
accumulator the TensorBoard server uses) sees every metric as a scalar with exactly one point per
step, equal to the metrics file's value (rounded to float32). Two ranks write one file (rank 0);
a resumed run's points replace what the first attempt wrote after the checkpoint; a folder that
cannot be made is a named error."""
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
from tensorboard.util import tensor_util

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import BIN, make_work  # noqa: E402

STEPS = 6
ENV = dict(os.environ, OMP_NUM_THREADS="1")
FIGURES = ["loss", "lr", "grad_norm", "loss_scale", "tok_s", "host_rss_bytes", "device_allocated_bytes",
           "device_peak_allocated_bytes"]


def train_args(work, extra, steps=STEPS):
    return [BIN, "train", "--model", str(work / "model.json"), "--data", str(work / "tokens.bin"),
            "--seq_len", "16", "--micro_batch", "2", "--steps", str(steps), "--lr", "3e-3", "--warmup", "2"] + extra


def run(args, ok=True):
    p = subprocess.run(args, capture_output=True, text=True, timeout=240, env=ENV)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def event_files(tb):
    return sorted(tb.glob("events.out.tfevents.*"))


def raw_events(path):
    """Every record of the file through TensorBoard's reader, which checks both CRCs of each
    record (a mismatch raises DataLossError), parsed as TensorFlow's Event."""
    reader = pywrap_tensorflow.PyRecordReader_New(str(path).encode())
    out = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return out
        out.append(event_pb2.Event.FromString(reader.record()))


def check_scalars(tb, rows):
    """Both accumulators over the folder hold, per figure of the metrics rows, one point per step
    with the row's value as float32."""
    expected = [k for k in FIGURES if k in rows[0]]
    assert {"loss", "lr", "grad_norm", "loss_scale", "tok_s", "host_rss_bytes"} <= set(expected)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1))

    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(f"train/{k}" for k in expected)
    for k in expected:
        points = acc.Scalars(f"train/{k}")
        assert [p.step for p in points] == steps, k
        assert [p.value for p in points] == [float(np.float32(r[k])) for r in rows], k
        assert all(a.wall_time <= b.wall_time for a, b in zip(points, points[1:])), k
        assert acc.SummaryMetadata(f"train/{k}").plugin_data.plugin_name == "scalars"

    # What the TensorBoard server reads: simple_value migrated to scalar tensors.
    pacc = plugin_event_accumulator.EventAccumulator(str(tb), size_guidance={plugin_event_accumulator.TENSORS: 0})
    pacc.Reload()
    assert sorted(pacc.PluginTagToContent("scalars")) == sorted(f"train/{k}" for k in expected)
    for k in expected:
        points = pacc.Tensors(f"train/{k}")
        assert [p.step for p in points] == steps, k
        assert [float(tensor_util.make_ndarray(p.tensor_proto)) for p in points] == \
            [float(np.float32(r[k])) for r in rows], k


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("tensorboard"))


def test_single_rank(work, tmp_path):
    tb = tmp_path / "out" / "tb"  # parents are made
    metrics = tmp_path / "metrics.jsonl"
    p = run(train_args(work, ["--plugin", "none", "--metrics_file", str(metrics), "--tensorboard", str(tb)]))
    files = event_files(tb)
    assert len(files) == 1, files
    assert f"TensorBoard event file: {files[0]}" in p.stderr, p.stderr[-2000:]
    name = re.fullmatch(r"events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.(\d+)", files[0].name)
    assert name, files[0].name
    assert name.group(2) == socket.gethostname()
    rows = rows_of(metrics)
    assert len(rows) == STEPS

    events = raw_events(files[0])
    assert events[0].file_version == "brain.Event:2"
    assert abs(events[0].wall_time - int(name.group(1))) < 1
    assert events[1].WhichOneof("what") == "session_log" and events[1].step == 1
    assert events[1].session_log.status == event_pb2.SessionLog.START
    scalars = events[2:]
    assert all(e.WhichOneof("what") == "summary" and len(e.summary.value) == 1 for e in scalars)
    tags = {e.summary.value[0].tag for e in scalars}
    assert len(scalars) == STEPS * len(tags)
    for e in scalars:
        assert e.summary.value[0].WhichOneof("value") == "simple_value"
    check_scalars(tb, rows)


def test_without_metrics_file(work, tmp_path):
    """--tensorboard alone: the same figures (checked against a run with --metrics_file that is
    identical on the CPU in fp32, apart from timings and memory)."""
    tb = tmp_path / "tb"
    run(train_args(work, ["--plugin", "none", "--tensorboard", str(tb)], steps=3))
    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    for k in ["loss", "lr", "grad_norm", "tok_s"]:
        assert [p.step for p in acc.Scalars(f"train/{k}")] == [1, 2, 3], k


def test_two_ranks_write_one_file(work, tmp_path):
    tb = tmp_path / "tb"
    metrics = tmp_path / "metrics.jsonl"
    run([BIN, "run", "--nproc_per_node", "2", "--master_port", "0"]
        + train_args(work, ["--metrics_file", str(metrics), "--tensorboard", str(tb)], steps=3))
    assert len(event_files(tb)) == 1, event_files(tb)
    check_scalars(tb, rows_of(metrics))


def test_resumed_run(work, tmp_path):
    """Resumed from step 3 of a 6-step run into the same folder: a second file whose SessionLog
    START makes TensorBoard drop the first attempt's steps 4-6, so each step has one point. Then a
    fresh run of 2 steps into the folder: only its points are shown (as in the metrics file)."""
    tb = tmp_path / "tb"
    metrics = tmp_path / "metrics.jsonl"
    common = ["--plugin", "none", "--save_dir", str(tmp_path / "ckpt"), "--save_every", "3",
              "--metrics_file", str(metrics), "--tensorboard", str(tb)]
    run(train_args(work, common))
    first = rows_of(metrics)
    run(train_args(work, common + ["--resume", str(tmp_path / "ckpt" / "step-00000003")]))
    files = event_files(tb)
    assert len(files) == 2, files
    start = raw_events(files[1])[1]
    assert start.WhichOneof("what") == "session_log" and start.step == 4
    assert start.session_log.status == event_pb2.SessionLog.START
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in first]  # fp32 on CPU: exact resume
    check_scalars(tb, rows)
    run(train_args(work, ["--plugin", "none", "--save_dir", str(tmp_path / "ckpt"), "--overwrite",
                          "--metrics_file", str(metrics), "--tensorboard", str(tb)], steps=2))
    assert len(event_files(tb)) == 3
    check_scalars(tb, rows_of(metrics))


def test_folder_under_a_file_is_a_named_error(work, tmp_path):
    (tmp_path / "plain").write_text("not a folder\n")
    bad = tmp_path / "plain" / "tb"
    p = run(train_args(work, ["--plugin", "none", "--tensorboard", str(bad)], steps=2), ok=False)
    assert p.returncode != 0
    assert str(bad) in p.stderr, p.stderr[-3000:]
    for junk in ["Traceback", "Exception raised from", "terminate called"]:
        assert junk not in p.stderr, p.stderr[-3000:]
    assert "it exists and is not a folder" in run(
        train_args(work, ["--plugin", "none", "--tensorboard", str(tmp_path / "plain")], steps=2), ok=False).stderr
    # Two ranks: rank 0's error, and rank 1 stops saying so (not at a broken collective).
    p = run([BIN, "run", "--nproc_per_node", "2", "--master_port", "0"]
            + train_args(work, ["--tensorboard", str(bad)], steps=2), ok=False)
    assert p.returncode != 0
    assert f"TensorBoard folder {bad}: cannot create it" in p.stderr, p.stderr[-3000:]
    assert "option 'tensorboard': rank 0 failed" in p.stderr, p.stderr[-3000:]
    assert "all_reduce" not in p.stderr, p.stderr[-3000:]
    for junk in ["Traceback", "Exception raised from", "terminate called"]:
        assert junk not in p.stderr, p.stderr[-3000:]


def test_sentencepiece_in_the_same_program(tmp_path):
    """Debian's libsentencepiece exports a protobuf-lite 3.14 of its own: the program must keep
    SentencePiece on that copy and the event writer on ours (3.21), each passing protobuf's version
    check (a wrong binding fails it: "compiled against version ...")."""
    lines = ["a corpus line number %d with some words in it" % i for i in range(500)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "m"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, minloglevel=2, num_threads=1)
    (tmp_path / "a.txt").write_text("\n".join(lines[:50]) + "\n")
    p = run([BIN, "prepare", "--tokenizer", str(tmp_path / "m.model"), "--out", str(tmp_path / "t.bin"),
             str(tmp_path / "a.txt")])
    assert "Protocol Buffer" not in p.stderr, p.stderr[-3000:]
    assert (tmp_path / "t.bin").stat().st_size > 0
