"""A checkpoint saved by TensorParallelCheckpointIO from two pipeline stages (2 ranks, each
writing its own shards, rank 0 the index) reads with Python safetensors and loads with
transformers' from_pretrained: every tensor once, the index covering exactly the shard files."""
import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "")
BIN = os.environ.get("COLOSSAL_BIN", "")
TEST = os.path.join(BUILD, "tests", "booster", "test_pp_checkpoint_io")


def test_pp_saved_checkpoint_reads_in_python(tmp_path):
    if not os.path.exists(TEST):
        pytest.fail(f"{TEST} not built (build the test_pp_checkpoint_io target)")
    out = tmp_path / "pp_model"
    env = dict(os.environ, COLOSSAL_PP_CKPT_OUT=str(out))
    r = subprocess.run(
        [BIN, "run", "--nproc_per_node", "2", "--master_port", "0", TEST,
         "--gtest_filter=*StageSavesEqualTheSingleProcessSave*"],
        capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    on_disk = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors"))
    assert files == on_disk and len(files) > 2
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    tensors = {}
    for f in files:
        with safe_open(str(out / f), framework="pt") as st:
            assert st.metadata()["format"] == "pt"
            for k in st.keys():
                assert k not in tensors, f"{k} written twice"
                assert index["weight_map"][k] == f
                tensors[k] = st.get_tensor(k)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    cfg = json.loads((out / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    # Both stages' tensors: the first stage's embedding, the last stage's norm and head.
    assert tuple(tensors["model.embed_tokens.weight"].shape) == (cfg["vocab_size"], cfg["hidden_size"])
    assert f"model.layers.{L - 1}.mlp.down_proj.weight" in tensors
    assert "model.norm.weight" in tensors and "lm_head.weight" in tensors
    assert index["weight_map"]["model.embed_tokens.weight"] != index["weight_map"]["lm_head.weight"]

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sd = model.state_dict()
    for k, t in tensors.items():
        assert torch.equal(sd[k], t), k
