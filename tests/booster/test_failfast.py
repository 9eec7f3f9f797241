"""`colossal train` and `colossal generate` refuse bad input before step 1, naming the option or
field: non-finite numbers in a TOML file, an option given twice in one file, a folder as
--config, impossible model configs (sizes, eps, theta), a model too large for memory (refused
with its byte count before anything is allocated), a token id past the vocabulary (named with
its position when the file is loaded, not when its batch comes up) and generation past
max_position_embeddings. Each: exit code 2 (an InputError), one clean message, nothing
printed by a crash."""
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from train_helpers import BIN, MODEL, make_work  # noqa: E402

CRASH_TEXT = ("Traceback", "Aborted", "core dumped", "terminate called", "Exception raised from", "frame #",
              "Segmentation fault", "AddressSanitizer")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_work(tmp_path_factory.mktemp("failfast"))


def refused(args, *needles, cwd=None):
    t0 = time.monotonic()
    p = subprocess.run([BIN] + args, capture_output=True, text=True, timeout=60, cwd=cwd,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = p.stdout + p.stderr
    assert p.returncode == 2, f"exit {p.returncode}, expected 2 (a named input error):\n{out[-3000:]}"
    for needle in needles:
        assert needle in p.stderr, f"{needle!r} not in:\n{p.stderr[-3000:]}"
    for text in CRASH_TEXT:
        assert text not in out, out[-3000:]
    assert "step 1/" not in out, out[-3000:]
    return p, time.monotonic() - t0


def train_args(work, model=None, data=None):
    return ["train", "--model", str(model or work / "model.json"), "--data", str(data or work / "tokens.bin"),
            "--plugin", "none", "--seq_len", "16", "--steps", "2", "--shuffle", "false"]


@pytest.mark.parametrize("toml, needle", [
    ("[optim]\nlr = inf\n", "run.toml [optim]: option 'lr' must be a finite number, got inf"),
    ("weight_decay = inf\n", "run.toml: option 'weight_decay' must be a finite number, got inf"),
    ("[optim]\neps = +inf\n", "option 'eps' must be a finite number"),
    ("[optim]\nbeta2 = nan\n", "option 'beta2' must be a finite number, got nan"),
    ("lr = 0.001\n[optim]\nlr = 0.002\n", "option 'lr' is given twice, at top level and in [optim]"),
])
def test_config_file_values(work, tmp_path, toml, needle):
    cfg = tmp_path / "run.toml"
    cfg.write_text(toml)
    refused(train_args(work) + ["--config", str(cfg)], needle)


def test_flags_and_config_folder(work, tmp_path):
    refused(train_args(work) + ["--lr", "inf"], "flag --lr must be a finite number, got 'inf'")
    refused(train_args(work) + ["--weight_decay", "nan"], "flag --weight_decay must be a finite number")
    refused(train_args(work) + ["--config", str(tmp_path)], f"TOML file {tmp_path} is a folder, not a file")


@pytest.mark.parametrize("change, needle", [
    ({"num_hidden_layers": -1}, "num_hidden_layers must be positive, got -1"),
    ({"num_attention_heads": 3}, "hidden_size (64) must be a multiple of num_attention_heads (3)"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive finite number, got 0"),
    ({"rope_theta": 0}, "rope_theta must be a positive finite number, got 0"),
])
def test_model_config_fields(work, tmp_path, change, needle):
    path = tmp_path / "bad_model.json"
    path.write_text(json.dumps(dict(MODEL, **change)))
    refused(train_args(work, model=path), f"{path}: {needle}")


def test_model_too_large_for_memory(work, tmp_path):
    # ~1.6e14 parameters: refused with the byte count in well under a second, not by the allocator.
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(dict(MODEL, hidden_size=10**7)))
    p, secs = refused(train_args(work, model=path), f"model {path}: ", " parameters need ", " bytes (",
                      "MemAvailable")
    assert secs < 30, secs


def test_token_past_vocabulary_named_with_position(work, tmp_path):
    # The bad id sits in the file's last sample: a 2-step run never reaches its batch, so only
    # the load-time scan can find it.
    tokens = np.fromfile(work / "tokens.bin", dtype=np.uint16)
    pos = tokens.size - 3
    tokens[pos] = MODEL["vocab_size"] + 4
    data = tmp_path / "bad_tokens.bin"
    tokens.tofile(data)
    refused(train_args(work, data=data),
            f"token id {MODEL['vocab_size'] + 4} at position {pos} ", "vocab_size 96")


def test_generate_past_max_positions(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODEL))  # max_position_embeddings 64
    prompt = ",".join(["5"] * 60)
    refused(["generate", "--model", str(folder), "--prompt-ids", prompt, "--max-new-tokens", "5"],
            "the prompt (60 tokens) + --max-new-tokens (5)", "max_position_embeddings (64")
    refused(["generate", "--model", str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "9223372036854775807"],
            "max_position_embeddings (64")
