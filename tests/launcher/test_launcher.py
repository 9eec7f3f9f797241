"""`colossal run` driven as a user would: rank environment, output prefixing, stopping the job
when a rank fails or the launcher is signalled (checked by pids: nothing may be left running),
clear errors for bad input, and multi-node jobs whose ranks really meet in torch.distributed
(gloo): two launchers on loopback, and the ssh fan-out through a fake ssh."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BIN = os.environ["COLOSSAL_BIN"]
HERE = Path(__file__).resolve().parent
FAKE_SSH = str(HERE / "fake_ssh.sh")
PY = sys.executable


def run(args, timeout=60, env=None, **kw):
    return subprocess.run([BIN, "run", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def alive(pid):
    """True while pid runs (a zombie counts as gone: it no longer runs anything)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_all_gone(pids, within=3.0):
    deadline = time.time() + within
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:  # don't leak them into the rest of the suite, but fail
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def wait_for_files(paths, timeout=20.0, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(Path(p).exists() for p in paths):
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited early ({proc.returncode}): "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise AssertionError(f"never appeared: {[p for p in paths if not Path(p).exists()]}")


def read_pids(d):
    return [int(p.read_text()) for p in Path(d).glob("*.pid")]


# A rank that records its pid and its child's pid (a `sleep` in its process group, standing in
# for a data-loader worker), waits until every rank has done so, then does `action` if it is the
# chosen rank, and otherwise sleeps.
RANK_PROGRAM = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    d, who, action, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    r = int(os.environ["RANK"])
    if action == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if action == "slow_exit":  # what `colossal train` does on a preemption notice: save, then go
        def slow(sig, _):
            open(os.path.join(d, "got%d" % r), "w").write(str(sig))
            time.sleep(1.5)
            os._exit(128 + sig)
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, slow)
    child = subprocess.Popen(["sleep", "120"])
    for name, pid in (("child%d" % r, child.pid), ("rank%d" % r, os.getpid())):
        with open(os.path.join(d, name + ".tmp"), "w") as f:
            f.write(str(pid))
        os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name + ".pid"))
    while len([f for f in os.listdir(d) if f.endswith(".pid")]) < 2 * n:
        time.sleep(0.02)
    if r == who:
        print("rank", r, "doing", action, flush=True)
        if action == "exit3":
            sys.exit(3)
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
""")


@pytest.fixture
def rank_prog(tmp_path):
    p = tmp_path / "rank.py"
    p.write_text(RANK_PROGRAM)
    d = tmp_path / "pids"
    d.mkdir()
    return str(p), str(d)


# ---- environment and output -------------------------------------------------------------------

def test_env_per_rank_and_prefix(tmp_path):
    prog = tmp_path / "env.py"
    prog.write_text(textwrap.dedent("""
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "OMP_NUM_THREADS"]
        print(json.dumps({k: os.environ.get(k) for k in keys}))
        print("to stderr from", os.environ["RANK"], file=sys.stderr)
    """))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["RANK"] = "77"  # a stale value must not leak into the ranks
    r = run(["--nproc_per_node", "3", "--master_port", "0", PY, str(prog)], env=env)
    assert r.returncode == 0, r.stderr
    seen = {}
    for line in r.stdout.splitlines():
        assert line.startswith("[rank "), line
        tag, payload = line.split("] ", 1)
        rank = int(tag[len("[rank "):])
        seen[rank] = json.loads(payload)
    assert sorted(seen) == [0, 1, 2]
    ports = {e["MASTER_PORT"] for e in seen.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, e in seen.items():
        assert e["RANK"] == str(rank) and e["LOCAL_RANK"] == str(rank)
        assert e["ROLE_RANK"] == str(rank) and e["GROUP_RANK"] == "0"
        assert e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["OMP_NUM_THREADS"] == "1"
    for rank in range(3):
        assert f"[rank {rank}] to stderr from {rank}" in r.stderr.splitlines()
    assert "[rank" not in "".join(l for l in r.stdout.splitlines() if "stderr" in l)


def test_whole_lines_never_mixed(tmp_path):
    # Every rank writes long lines in small pieces with flushes in between, so the launcher
    # reads partial lines from all of them at once; each relayed line must still be whole.
    prog = tmp_path / "lines.py"
    prog.write_text(textwrap.dedent("""
        import os, sys
        r = os.environ["RANK"]
        for i in range(300):
            line = ("%s:%d:" % (r, i)) + r * 3000
            for k in range(0, len(line), 700):
                sys.stdout.write(line[k:k + 700]); sys.stdout.flush()
            sys.stdout.write("\\n"); sys.stdout.flush()
        sys.stdout.write("tail-without-newline-" + r)
    """))
    r = run(["--nproc_per_node", "4", "--master_port", "0", PY, str(prog)])
    assert r.returncode == 0, r.stderr
    counts = {str(k): 0 for k in range(4)}
    tails = set()
    for line in r.stdout.splitlines():
        tag, payload = line.split("] ", 1)
        rank = tag[len("[rank "):]
        if payload.startswith("tail-without-newline-"):
            assert payload == "tail-without-newline-" + rank
            tails.add(rank)
            continue
        head, i, body = payload.split(":")
        assert head == rank and body == rank * 3000, line[:80]
        assert int(i) == counts[rank]  # in order, none lost
        counts[rank] += 1
    assert counts == {str(k): 300 for k in range(4)}
    assert tails == set(counts)


def test_exit_code_zero_and_command_args(tmp_path):
    r = run(["--nproc_per_node", "2", "--master_port", "0", "sh", "-c", 'echo "a b" "$RANK"'])
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[rank 0] a b 0", "[rank 1] a b 1"]


# ---- failures and signals -----------------------------------------------------------------------

def test_failing_rank_stops_the_job(rank_prog):
    prog, d = rank_prog
    t0 = time.time()
    r = run(["--nproc_per_node", "3", "--master_port", "0", PY, prog, d, "1", "exit3", "3"])
    took = time.time() - t0
    assert r.returncode != 0
    assert "rank 1" in r.stderr and "exited with code 3" in r.stderr, r.stderr
    assert took < 10, took
    pids = read_pids(d)
    assert len(pids) == 6
    assert_all_gone(pids)


def test_rank_killed_by_signal(rank_prog):
    prog, d = rank_prog
    t0 = time.time()
    r = run(["--nproc_per_node", "3", "--master_port", "0", PY, prog, d, "2", "sigkill", "3"])
    assert r.returncode != 0
    assert "rank 2" in r.stderr and "SIGKILL" in r.stderr, r.stderr
    assert time.time() - t0 < 10
    assert_all_gone(read_pids(d))


def test_sigterm_to_launcher_reaches_every_rank(rank_prog):
    prog, d = rank_prog
    p = subprocess.Popen([BIN, "run", "--nproc_per_node", "3", "--master_port", "0", PY, prog,
                          d, "-1", "none", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    wait_for_files([f"{d}/{k}{r}.pid" for k in ("rank", "child") for r in range(3)], proc=p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err
    assert_all_gone(read_pids(d))


def test_preemption_signal_reaches_ranks_with_time_to_save(rank_prog):
    # SIGUSR1 (and SIGTERM) sent to the launcher by a scheduler is passed on, and the ranks get
    # --save_grace_period (not the short --grace_period of a failed job) to save and exit.
    prog, d = rank_prog
    p = subprocess.Popen([BIN, "run", "--nproc_per_node", "2", "--master_port", "0",
                          "--grace_period", "0.2", "--save_grace_period", "20", PY, prog, d, "-1",
                          "slow_exit", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    wait_for_files([f"{d}/{k}{r}.pid" for k in ("rank", "child") for r in range(2)], proc=p)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGUSR1, err
    assert "SIGUSR1" in err and "SIGKILL" not in err, err
    for r in range(2):
        assert (Path(d) / f"got{r}").read_text() == str(int(signal.SIGUSR1))
    assert_all_gone(read_pids(d))


def test_ranks_ignoring_sigterm_get_sigkill(rank_prog):
    prog, d = rank_prog
    p = subprocess.Popen([BIN, "run", "--nproc_per_node", "2", "--master_port", "0",
                          "--grace_period", "1", "--save_grace_period", "1", PY, prog, d, "-1",
                          "ignore_term", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_files([f"{d}/{k}{r}.pid" for k in ("rank", "child") for r in range(2)], proc=p)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    assert time.time() - t0 < 5
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "SIGKILL" in err, err
    assert_all_gone(read_pids(d))


def test_launcher_killed_outright_takes_ranks_along(rank_prog):
    prog, d = rank_prog
    p = subprocess.Popen([BIN, "run", "--nproc_per_node", "2", "--master_port", "0", PY, prog,
                          d, "-1", "none", "2"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    wait_for_files([f"{d}/rank{r}.pid" for r in range(2)], proc=p)
    p.kill()
    p.wait(timeout=5)
    ranks = [int(Path(f"{d}/rank{r}.pid").read_text()) for r in range(2)]
    assert_all_gone(ranks)  # PR_SET_PDEATHSIG
    for pid in read_pids(d):  # the orphaned `sleep` children are not the launcher's to reach
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# ---- input errors -------------------------------------------------------------------------------

def expect_input_error(args, *needles, env=None):
    r = run(args, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == ""
    for n in needles:
        assert n in r.stderr, r.stderr
    return r


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        expect_input_error(["--nproc_per_node", "2", "--master_port", str(port), "true"],
                           f"--master_port {port}", "already in use")


def test_missing_or_unrunnable_command(tmp_path):
    expect_input_error(["--nproc_per_node", "2", "--master_port", "0", "no-such-program-x"],
                       "no-such-program-x", "not found")
    expect_input_error(["--nproc_per_node", "2", "--master_port", "0", str(tmp_path / "nope")],
                       "not found")
    script = tmp_path / "script.py"
    script.write_text("print(1)\n")
    expect_input_error(["--nproc_per_node", "1", "--master_port", "0", str(script)],
                       "not executable")
    expect_input_error(["--nproc_per_node", "1", "--master_port", "0", str(tmp_path)],
                       "directory")
    expect_input_error(["--nproc_per_node", "1"], "no command")


@pytest.mark.parametrize("content,needle", [
    ("node1 slots=8\n", "line 1: expected one host name per line"),
    ("node1\n\n# comment\nnode$2\n", "line 4: 'node$2' is not a host name"),
    ("node1\nnode1\n", "line 2: host 'node1' is listed twice"),
    ("# nothing\n\n", "lists no hosts"),
])
def test_malformed_hostfile(tmp_path, content, needle):
    hf = tmp_path / "hostfile"
    hf.write_text(content)
    env = dict(os.environ, COLOSSAL_SSH=FAKE_SSH)
    expect_input_error(["--nproc_per_node", "1", "--hostfile", str(hf), "true"], str(hf), needle,
                       env=env)


def test_bad_flag_values(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("a\nb\n")
    cases = [
        (["--nproc_per_node", "0", "true"], "--nproc_per_node 0"),
        (["--nproc_per_node", "x", "true"], "expects an integer"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "2", "true"], "--node_rank 2"),
        (["--nproc_per_node", "1", "--nnodes", "0", "true"], "--nnodes 0"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "1", "--master_port", "0",
          "true"], "single node"),
        (["--nproc_per_node", "1", "--master_port", "70000", "true"], "70000"),
        (["--nproc_per_node", "1", "--hostfile", str(hf), "--include", "a", "--exclude", "b",
          "true"], "mutually exclusive"),
        (["--nproc_per_node", "1", "--hostfile", str(hf), "--include", "c", "true"],
         "host 'c' is not in the hostfile"),
        (["--nproc_per_node", "1", "--include", "a", "true"], "--hostfile"),
        (["--nproc_per_node", "1", "--hostfile", str(hf), "--host", "a", "true"],
         "mutually exclusive"),
        (["--nproc_per_node", "1", "--hostfile", str(hf), "--nnodes", "3", "true"],
         "more than the 2 hosts"),
        (["--nproc_per_node", "1", "--hostfile", str(hf), "--node_rank", "1", "true"],
         "--node_rank"),
        (["--nproc_per_node", "1", "--bogus", "true"], "unknown option '--bogus'"),
    ]
    for args, needle in cases:
        expect_input_error(args, needle)


# ---- multi-node ---------------------------------------------------------------------------------

ALLREDUCE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    r, w = dist.get_rank(), dist.get_world_size()
    assert r == int(os.environ["RANK"]) and w == int(os.environ["WORLD_SIZE"])
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    print("rank=%d world=%d local=%s node=%s sum=%g extra=%s" % (
        r, w, os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"], t.item(),
        os.environ.get("LAUNCHER_TEST_VAR")), flush=True)
    dist.destroy_process_group()
    # Skip the Gloo teardown at interpreter exit, which now and then aborts in PyTorch (see
    # REFERENCE in tests/booster/test_train.py); this test is about the launcher, not that.
    sys.stderr.flush()
    os._exit(0)
""")


def parse_allreduce(out):
    got = {}
    for line in out.splitlines():
        tag, payload = line.split("] ", 1)
        payload, extra = payload.split(" extra=", 1)
        fields = dict(kv.split("=") for kv in payload.split())
        fields["extra"] = extra
        assert tag == "[rank " + fields["rank"], line
        got[int(fields["rank"])] = fields
    return got


def test_two_launchers_form_one_job(tmp_path):
    prog = tmp_path / "allreduce.py"
    prog.write_text(ALLREDUCE)
    port = free_port()
    common = ["--nnodes", "2", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
              "--master_port", str(port)]
    nodes = [subprocess.Popen([BIN, "run", *common, "--node_rank", str(n), PY, str(prog)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=120) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err
    got0, got1 = parse_allreduce(outs[0][0]), parse_allreduce(outs[1][0])
    assert sorted(got0) == [0, 1] and sorted(got1) == [2, 3]
    for rank, f in {**got0, **got1}.items():
        assert f["world"] == "4" and f["sum"] == "10"  # 1 + 2 + 3 + 4
        assert f["local"] == str(rank % 2) and f["node"] == str(rank // 2)


def test_ssh_fan_out_from_hostfile(tmp_path):
    prog = tmp_path / "allreduce.py"
    prog.write_text(ALLREDUCE)
    hf = tmp_path / "hostfile"
    hf.write_text("# two 'hosts' that are this machine\n127.0.0.1\nlocalhost  # comment\n")
    log = tmp_path / "ssh.log"
    env = dict(os.environ, COLOSSAL_SSH=FAKE_SSH, FAKE_SSH_LOG=str(log),
               LAUNCHER_TEST_VAR="forwarded 'quoted' $value")
    r = run(["--hostfile", str(hf), "--ssh_port", "2222", "--nproc_per_node", "2",
             "--master_port", str(free_port()), PY, str(prog)], env=env, timeout=120,
            cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = parse_allreduce(r.stdout)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, f in got.items():
        assert f["world"] == "4" and f["sum"] == "10"
        assert f["node"] == str(rank // 2)
    # the environment reached the ranks through the empty-environment fake ssh, quoting intact
    assert all(f["extra"] == "forwarded 'quoted' $value" for f in got.values())
    assert sorted(log.read_text().split("\n")[:-1]) == ["127.0.0.1 2222", "localhost 2222"]


def test_ssh_fan_out_with_include_and_failure(tmp_path, rank_prog):
    prog, d = rank_prog
    hf = tmp_path / "hostfile"
    hf.write_text("127.0.0.1\nlocalhost\nunused-host\n")
    log = tmp_path / "ssh.log"
    env = dict(os.environ, COLOSSAL_SSH=FAKE_SSH, FAKE_SSH_LOG=str(log))
    t0 = time.time()
    # rank 3 (node 1) fails; node 0's ranks must be stopped through the closed ssh channel
    r = run(["--hostfile", str(hf), "--include", "127.0.0.1,localhost", "--nproc_per_node", "2",
             "--master_port", str(free_port()), PY, prog, d, "3", "exit3", "4"], env=env)
    assert r.returncode != 0
    assert time.time() - t0 < 15
    assert "rank 3" in r.stderr and "exited with code 3" in r.stderr, r.stderr
    assert "node 1 (localhost)" in r.stderr, r.stderr
    assert "unused-host" not in log.read_text()
    pids = read_pids(d)
    assert len(pids) == 8
    assert_all_gone(pids)


def test_ssh_fan_out_sigterm(tmp_path, rank_prog):
    prog, d = rank_prog
    env = dict(os.environ, COLOSSAL_SSH=FAKE_SSH)
    p = subprocess.Popen([BIN, "run", "--host", "127.0.0.1,localhost", "--nproc_per_node", "1",
                          "--master_port", str(free_port()), PY, prog, d, "-1", "none", "2"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_files([f"{d}/{k}{r}.pid" for k in ("rank", "child") for r in range(2)], proc=p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=15)
    assert p.returncode != 0, err
    assert_all_gone(read_pids(d))


def test_output_is_relayed_as_it_happens(tmp_path):
    # A rank's line must reach the launcher's stdout while the rank still runs (Python ranks
    # write into a pipe; the launcher makes them line-buffered as at a terminal).
    prog = tmp_path / "live.py"
    prog.write_text("import time\nprint('ready', flush=False)\ntime.sleep(60)\n")
    p = subprocess.Popen([BIN, "run", "--nproc_per_node", "1", "--master_port", "0", PY,
                          str(prog)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=20), "no output while the rank runs"
        assert p.stdout.readline() == "[rank 0] ready\n"
    finally:
        p.terminate()
        p.wait(timeout=10)


# ---- limits, rendezvous and failure reports -----------------------------------------------------

def launcher_rank():
    p = Path(os.environ.get("COLOSSAL_BUILD_DIR", "")) / "tests" / "launcher" / "launcher_rank"
    if not p.exists():
        pytest.fail(f"{p} is not built (cmake --build build --target launcher_rank)")
    return str(p)


def test_nproc_per_node_bounded_before_forking():
    # 100000 ranks used to fork until the OOM killer acted; refused before any fork, naming the
    # limit and the override.
    t0 = time.time()
    r = expect_input_error(["--nproc_per_node", "100000", "true"], "--nproc_per_node 100000",
                           "--allow_oversubscribe", "4 x max(CPU cores, GPUs)")
    assert time.time() - t0 < 5
    expect_input_error(["--nproc_per_node", "2147483647", "--master_port", "0", "true"],
                       "--nproc_per_node 2147483647")
    # The product with --nnodes must not wrap WORLD_SIZE.
    expect_input_error(["--nproc_per_node", "2", "--nnodes", "2147483647", "--node_rank", "1",
                        "true"], "2 x --nnodes 2147483647", "more than a job can have")
    expect_input_error(["--nproc_per_node", "4294967297", "true"], "--nproc_per_node")
    # The override starts them (a small overshoot, so the test stays cheap anywhere).
    limit = int(r.stderr.split("this node can run (")[1].split(" ")[0])
    if limit <= 16:
        r = run(["--allow_oversubscribe", "--nproc_per_node", str(limit + 1), "--master_port", "0",
                 "true"])
        assert r.returncode == 0, r.stderr


def test_timeout_flags_reach_the_ranks(tmp_path):
    prog = tmp_path / "t.py"
    prog.write_text("import os\nprint(os.environ.get('COLOSSAL_RDZV_TIMEOUT_S'),"
                    " os.environ.get('COLOSSAL_DIST_TIMEOUT_S'))\n")
    env = dict(os.environ, COLOSSAL_RDZV_TIMEOUT_S="99", COLOSSAL_DIST_TIMEOUT_S="98")
    r = run(["--nproc_per_node", "1", "--master_port", "0", "--rdzv_timeout", "7.5",
             "--dist_timeout", "120", PY, str(prog)], env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[rank 0] 7.5 120"
    r = run(["--nproc_per_node", "1", "--master_port", "0", PY, str(prog)], env=env)
    assert r.stdout.strip() == "[rank 0] 99 98"  # not given: the environment's values
    for flag in ("--rdzv_timeout", "--dist_timeout"):
        for bad in ("0", "inf"):
            expect_input_error(["--nproc_per_node", "1", flag, bad, "true"], flag)
    r = run(["--help"])
    assert "--rdzv_timeout" in r.stdout + r.stderr and "--dist_timeout" in r.stdout + r.stderr


def test_unresolvable_master_addr_fails_at_once():
    t0 = time.time()
    expect_input_error(["--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "1",
                        "--master_addr", "no-such-host.invalid", "--master_port", "29999", "true"],
                       "--master_addr 'no-such-host.invalid' cannot be resolved")
    # A rank started another way says the same about MASTER_ADDR, instead of waiting.
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29999")
    r = subprocess.run([launcher_rank()], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "MASTER_ADDR 'no-such-host.invalid'" in r.stderr and "cannot be resolved" in r.stderr
    assert time.time() - t0 < 20


def test_rendezvous_that_cannot_succeed_times_out():
    # Rank 0 missing (only node 1 of 2 runs), then half the ranks missing (only node 0): each
    # ends after --rdzv_timeout with a named error instead of the 30-minute collective timeout,
    # and without a warning every 0.7 s.
    port = free_port()
    for node_rank, needle in ((1, "found no store at 127.0.0.1:%d" % port),
                              (0, "only 2 of 4 ranks reached the store")):
        t0 = time.time()
        r = run(["--nnodes", "2", "--node_rank", str(node_rank), "--nproc_per_node", "2",
                 "--master_port", str(port), "--rdzv_timeout", "1", launcher_rank()], timeout=60)
        took = time.time() - t0
        assert r.returncode != 0
        assert "rendezvous timed out" in r.stderr and needle in r.stderr, r.stderr
        assert "--rdzv_timeout" in r.stderr
        assert took < 20, took
        assert "failed to connect" not in r.stderr, r.stderr  # c10d's retry warnings


def test_two_jobs_on_one_port_never_collide():
    # Both launchers find the port free at the same moment; the old check released it before
    # rank 0's store bound it, so the jobs mixed ranks and both died or hung. Now the launcher
    # keeps listening until rank 0 takes the socket over: one job runs, the other is refused.
    port = free_port()
    jobs = [subprocess.Popen([BIN, "run", "--nproc_per_node", "2", "--master_port", str(port),
                              launcher_rank(), "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [j.communicate(timeout=60) for j in jobs]
    codes = sorted(j.returncode for j in jobs)
    assert codes == [0, 2], (codes, outs)
    for j, (out, err) in zip(jobs, outs):
        if j.returncode == 0:
            assert sorted(l for l in out.splitlines() if l.endswith(" ok")) == [
                "[rank 0] rank 0 of 2 ok", "[rank 1] rank 1 of 2 ok"], (out, err)
        else:
            assert f"--master_port {port} is already in use" in err, err
            assert out == ""


def test_store_socket_held_for_the_life_of_the_job():
    # While a job runs, its port stays taken: a later job on the same port is refused by the
    # launcher, with the port number.
    port = free_port()
    job = subprocess.Popen([BIN, "run", "--nproc_per_node", "2", "--master_port", str(port),
                            launcher_rank(), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        time.sleep(0.5)
        expect_input_error(["--nproc_per_node", "2", "--master_port", str(port), launcher_rank()],
                           f"--master_port {port} is already in use")
    finally:
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err


FIRST_FAILURE = textwrap.dedent("""
    import os, signal, sys, time
    d = sys.argv[1]
    r = int(os.environ["RANK"])
    if r == 0:  # rank 0 fails on its own, never from the launcher's stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(d, "%d.tmp" % r), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, "%d.tmp" % r), os.path.join(d, "%d.pid" % r))
    while not all(os.path.exists(os.path.join(d, "%d.pid" % k)) for k in (0, 1)):
        time.sleep(0.01)
    if r == 1:
        print("ValueError: the real cause (shard 17 is corrupt)", file=sys.stderr, flush=True)
        sys.exit(1)
    # Rank 0 is a peer in a barrier: it notices rank 1's death at once and fails too.
    peer = int(open(os.path.join(d, "1.pid")).read())
    def gone():
        try:
            with open("/proc/%d/stat" % peer) as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # reaped already (ENOENT, or ESRCH in the middle of the read)
            return True
    while not gone():
        pass
    print("RuntimeError: Connection closed by peer [127.0.0.1]:4321", file=sys.stderr, flush=True)
    sys.exit(1)
""")


def test_summary_names_the_first_failure_and_every_cause(tmp_path):
    prog = tmp_path / "first.py"
    prog.write_text(FIRST_FAILURE)
    for _ in range(3):
        d = tmp_path / ("d%d" % _)
        d.mkdir()
        r = run(["--nproc_per_node", "2", "--master_port", "0", PY, str(prog), str(d)])
        assert r.returncode == 1, r.stderr
        summary = r.stderr[r.stderr.index("job failed"):]
        first = summary.splitlines()[0]
        assert "rank 1" in first and "the real cause (shard 17 is corrupt)" in first, summary
        # Every rank's cause, the first one first.
        i1 = summary.find("rank 1 (pid")
        i0 = summary.find("rank 0 (pid")
        assert 0 <= i1 and "Connection closed by peer" in summary, summary
        if i0 >= 0:
            assert i1 < i0, summary


def test_rank_of_another_job_is_refused_by_the_store():
    # Ranks started by hand (or by another launcher) with job A's MASTER_PORT reach A's store:
    # they fail at once, naming the shared port, and job A runs on undisturbed. With a job id
    # (as `colossal run` gives) the intruder leaves before it counts itself in; without one it
    # is the rank too many.
    port = free_port()
    job = subprocess.Popen([BIN, "run", "--nproc_per_node", "2", "--master_port", str(port),
                            launcher_rank(), "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        met = [job.stdout.readline() for _ in range(2)]
        assert all(" met" in l for l in met), (met, job.stderr.read() if job.poll() else "")
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COLOSSAL_RDZV_TIMEOUT_S="20")
        env.pop("COLOSSAL_JOB_ID", None)
        for job_id, needle in (("job-b", "reached the store of another job"),
                               (None, "is rank number 3 to join a world of 2")):
            e = dict(env, COLOSSAL_JOB_ID=job_id) if job_id else env
            r = subprocess.run([launcher_rank()], capture_output=True, text=True, timeout=60,
                               env=e)
            assert r.returncode == 1, r.stderr
            assert needle in r.stderr and f"127.0.0.1:{port}" in r.stderr, r.stderr
    finally:
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert sorted(l for l in (met[0] + met[1] + out).splitlines() if l.endswith(" ok")) == [
        "[rank 0] rank 0 of 2 ok", "[rank 1] rank 1 of 2 ok"]
