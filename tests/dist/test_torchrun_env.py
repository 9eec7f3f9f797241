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


def test_mpirun_two_ranks():
    # Open MPI's launcher (installed by scripts/setup.sh): ranks read OMPI_COMM_WORLD_RANK/SIZE/
    # LOCAL_RANK; only the rendezvous address comes from MASTER_ADDR/MASTER_PORT.
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: scripts/setup.sh installs openmpi-bin"
    port = free_port()
    cmd = [mpirun, "--oversubscribe", "-np", "2", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}",
           "-x", "OMP_NUM_THREADS=1", str(BINARY), "--gtest_brief=1"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("PASSED") >= 2, p.stdout
