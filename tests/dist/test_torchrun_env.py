"""Ranks started the torch.distributed way -- plain RANK/WORLD_SIZE/... variables, and torchrun
itself -- rendezvous and pass the collectives test."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BUILD = Path(os.environ["COLOSSAL_BUILD_DIR"])
BINARY = BUILD / "tests" / "dist" / "test_collectives"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plain_env_two_ranks():
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([str(BINARY), "--gtest_brief=1"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"
        assert "PASSED" in out


def test_torchrun_two_ranks():
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        torchrun = shutil.which("torchrun")
    if not torchrun:
        pytest.skip("torchrun not installed")
    port = free_port()
    r = subprocess.run([str(torchrun), "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                        f"--master_port={port}", "--no-python", str(BINARY), "--gtest_brief=1"],
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
