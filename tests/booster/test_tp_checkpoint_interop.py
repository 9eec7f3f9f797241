"""A checkpoint saved by TensorParallelCheckpointIO from tensor-parallel shards (2 ranks) reads
with Python safetensors and loads with transformers' from_pretrained: every tensor in its full
shape, the index covering every shard file."""
import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "")
BIN = os.environ.get("COLOSSAL_BIN", "")
TEST = os.path.join(BUILD, "tests", "booster", "test_tp_checkpoint_io")


def test_tp_saved_checkpoint_reads_in_python(tmp_path):
    if not os.path.exists(TEST):
        pytest.fail(f"{TEST} not built (build the test_tp_checkpoint_io target)")
    out = tmp_path / "tp_model"
    env = dict(os.environ, COLOSSAL_TP_CKPT_OUT=str(out))
    r = subprocess.run(
        [BIN, "run", "--nproc_per_node", "2", "--master_port", "0", TEST,
         "--gtest_filter=*SaveWritesTheSingleProcessFiles*"],
        capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    tensors = {}
    for f in files:
        with safe_open(str(out / f), framework="pt") as st:
            assert st.metadata()["format"] == "pt"
            for k in st.keys():
                assert index["weight_map"][k] == f
                tensors[k] = st.get_tensor(k)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    cfg = json.loads((out / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    # Full shapes, not a rank's shard.
    assert tuple(tensors["model.embed_tokens.weight"].shape) == (v, h)
    assert tuple(tensors["model.layers.0.mlp.down_proj.weight"].shape) == (h, cfg["intermediate_size"])
    assert tuple(tensors["model.layers.0.self_attn.q_proj.bias"].shape) == (cfg["num_attention_heads"] * cfg["head_dim"],)

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sd = model.state_dict()
    for k, t in tensors.items():
        assert torch.equal(sd[k], t), k
