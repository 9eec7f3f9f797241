"""colossal::toml against Python's tomllib on run-config-like documents."""
import json
import os
import subprocess
import tomllib

import pytest

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
TOOL = os.path.join(BUILD, "tests", "core", "toml_tool")

DOCS = [
    """
# a run config
model = "llama-tiny"
seed = 42
[train]
steps = 1_000
lr = 3.0e-4
warmup = 10
schedule = "cosine"
clip = 1.0
bf16 = true
[plugin]
name = 'gemini'
placement = { policy = "static", shard_param_frac = 1.0, offload_optim_frac = 0.25 }
[plugin.amp]
initial_scale = 65536
hysteresis = 2
"growth interval" = 1000
[data]
files = ["a.bin", "b.bin",
         "c.bin",]  # trailing comma
mix = [[1, 2], [0.5, -3e2]]
unicode = "caf\\u00e9 \\"q\\" \\\\ tab\\t"
a.b.c = 0x1F
neg = -0
flt = -1.5e-3
""",
    "x = []\ny = {}\n[empty]\n",
]


@pytest.mark.parametrize("doc", DOCS)
def test_matches_tomllib(tmp_path, doc):
    p = tmp_path / "run.toml"
    p.write_text(doc)
    r = subprocess.run([TOOL, str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)
    ref = tomllib.loads(doc)
    assert ours == ref
    # ints stay ints and floats stay floats
    def types(v):
        if isinstance(v, dict):
            return {k: types(x) for k, x in v.items()}
        if isinstance(v, list):
            return [types(x) for x in v]
        return type(v).__name__
    assert types(ours) == types(ref)


@pytest.mark.parametrize("doc", ["a = 1\na = 2\n", "x = \"open\n", "[t]\n[t]\n", "x = 1 2\n", "x = bare\n"])
def test_rejects_what_tomllib_rejects(tmp_path, doc):
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(doc)
    p = tmp_path / "bad.toml"
    p.write_text(doc)
    r = subprocess.run([TOOL, str(p)], capture_output=True, text=True)
    assert r.returncode == 1 and str(p) in r.stderr, r.stderr
