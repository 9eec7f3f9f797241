"""Token files written by numpy exactly as nanoGPT (raw uint16) and llm.c's
dev/data/data_common.py (256-int32 header) write them, read back by colossal.cpp."""
import json
import os
import subprocess

import numpy as np
import pytest

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
TOOL = os.path.join(BUILD, "tests", "data", "data_tool")


def dump(path, fmt=None):
    r = subprocess.run([TOOL, "dump", str(path)] + ([fmt] if fmt else []), capture_output=True, text=True)
    return r


def llmc(path, toks, magic, version, dtype):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=dtype).tobytes())


@pytest.mark.parametrize("name,fmt,writer,expect", [
    ("train.bin", None, "u16", "u16"),
    ("train.u32.bin", None, "u32", "u32"),
    ("tokens.raw", "u32", "u32", "u32"),
    ("gpt2.bin", None, "llmc", "llmc"),
    ("llama3.bin", None, "llmc-llama3", "llmc-llama3"),
])
def test_numpy_written_files(tmp_path, name, fmt, writer, expect):
    rng = np.random.default_rng(0)
    hi = 50257 if writer in ("u16", "llmc") else 128256
    toks = rng.integers(0, hi, size=1000).tolist()
    p = tmp_path / name
    if writer == "u16":
        np.array(toks, dtype=np.uint16).tofile(p)
    elif writer == "u32":
        np.array(toks, dtype=np.uint32).tofile(p)
    elif writer == "llmc":
        llmc(p, toks, 20240520, 1, np.uint16)
    else:
        llmc(p, toks, 20240801, 7, np.uint32)
    r = dump(p, fmt)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["format"] == expect
    assert out["tokens"] == toks


def test_truncated_llmc_names_sizes(tmp_path):
    p = tmp_path / "bad.bin"
    llmc(p, list(range(100)), 20240520, 1, np.uint16)
    with open(p, "r+b") as f:
        f.truncate(256 * 4 + 150)
    r = dump(p)
    assert r.returncode == 1
    assert str(p) in r.stderr and "100 tokens" in r.stderr and "1174 bytes" in r.stderr
