"""`colossal bench` flags come from the same typed structs as `colossal train`: every [plugin]
option of `colossal train --help` is a bench flag too, ColossalAI's benchmark names are aliases
of the struct fields (--prefetch_num = --max_prefetch, -b = --batch_size = --micro_batch), and
--help lists every option with its default."""
import json
import os
import re
import subprocess

BIN = os.environ["COLOSSAL_BIN"]


def help_text(cmd):
    p = subprocess.run([BIN, cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def section(text, name):
    """The option lines of one [section] of an OptionSet help text."""
    m = re.search(r"^\[" + name + r"\]\n(.*?)(?:\n\[|\Z)", text, re.S | re.M)
    assert m, text
    return [l for l in m.group(1).splitlines() if l.strip()]


def test_plugin_options_are_shared_with_train():
    bench, train = help_text("bench"), help_text("train")
    train_plugin = [re.match(r"\s+(--\w+)", l).group(1) for l in section(train, "plugin")]
    assert "--precision" in train_plugin and "--max_prefetch" in train_plugin
    bench_plugin = "\n".join(section(bench, "plugin"))
    for flag in train_plugin:
        assert re.search(r"(^|\s|, )" + flag + r"\b", bench_plugin, re.M), flag
    for line in ["-p, --plugin", "--max_prefetch, --prefetch_num", "-b, --micro_batch, --batch_size",
                 "-l, --seq_len, --max_length", "-s, --steps, --num_steps", "-i, --ignore_steps",
                 "-w, --warmup_non_model_data_ratio, --warmup_ratio", "-c, --model, --config", "--tp"]:
        assert line in bench, line
    # Every option line ends with its default.
    for name in ["bench", "plugin", "3d"]:
        for line in section(bench, name):
            assert re.search(r"\[[^\]]*\]$", line), line


def run(tmp_path, name, args):
    out = tmp_path / name
    p = subprocess.run([BIN, "bench", "--device", "cpu", "-c", "tiny", "-l", "16", "-i", "1", "--json", str(out)]
                       + args, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())


def test_aliases_set_the_same_field(tmp_path):
    a = run(tmp_path, "a.json", ["-p", "gemini", "--prefetch_num", "1", "-b", "1", "-s", "2"])
    b = run(tmp_path, "b.json", ["--plugin", "gemini", "--max_prefetch", "1", "--batch_size", "1",
                                 "--num_steps", "2"])
    for r in (a, b):
        assert r["config"]["prefetch_num"] == 1 and r["config"]["batch_per_dp_rank"] == 1
        assert r["config"]["steps"] == 2
    # Same seed, same plugin, same settings: the same training.
    assert a["final_loss"] == b["final_loss"]
