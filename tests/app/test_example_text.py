"""examples/text/run.sh end to end at 4 training steps (the example itself runs 300): corpus and
tokenizer, prepare, train on 2 CPU ranks with a report, generate before and after. Keeps the
example working; what it shows at full length is in the README."""
import os
import subprocess
import sys

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
BIN = os.environ.get("COLOSSAL_BIN", os.path.join(BUILD, "colossal"))
SRC = os.environ.get("COLOSSAL_SOURCE_DIR", os.getcwd())


def test_example_text_runs(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), STEPS="4", COLOSSAL=os.path.abspath(BIN),
               PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(SRC, "examples", "text", "run.sh")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for part in ("== 4/4 generate", "--- untrained", "--- run", "report:"):
        assert part in r.stdout, r.stdout
    assert (tmp_path / "data" / "train.bin").stat().st_size > 1024
    assert (tmp_path / "data" / "train.bin.docs").exists()
    assert (tmp_path / "run" / "report.html").exists()
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()
