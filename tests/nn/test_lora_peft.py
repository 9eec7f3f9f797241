"""LoRA layers (nn/lora.h) and PEFT adapter folders (checkpoint/lora.h) against Python's `peft`.

A tiny HF Llama gets a PEFT LoRA adapter on every projection (q/k/v/o, gate/up/down) with random
A and B (PEFT's B starts at zero, which would hide B's path), saved by PEFT. Ours loads the HF
model and the adapter (tests/nn/lora_tool): logits, loss and the gradients of every A and B equal
PEFT's, and no base parameter takes a gradient. Our saved adapter loads in PEFT with the same
logits; our own initialisation (B = 0, A kaiming-uniform) loads in PEFT and leaves the base's
logits. Bad adapters and configs are named errors (exit 2).

Tolerances: fp32 on the CPU; the two sides compute the same products in different orders (our
fused q/k/v path is off for LoRA layers, as for PEFT): 1e-5 relative to the largest magnitude,
as tests/nn/test_hf_parity.py.
"""
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "")
TOOL = os.path.join(BUILD, "tests", "nn", "lora_tool")
torch.set_num_threads(1)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tool(*args, ok=True):
    r = subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(str(d / "base"))
    model = get_peft_model(LlamaForCausalLM.from_pretrained(str(d / "base")),
                           LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, target_modules=TARGETS,
                                      task_type="CAUSAL_LM", use_rslora=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(d / "adapter"))
    ids = torch.randint(0, 97, (2, 12))
    labels = ids.clone()
    labels[0, :3] = -100
    save_file({"input_ids": ids, "labels": labels}, str(d / "in.safetensors"))
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return d, out.logits.detach(), out.loss.detach(), grads


def test_logits_and_adapter_gradients_equal_peft(work):
    d, logits, loss, grads = work
    tool("run", d / "base", d / "adapter", d / "in.safetensors", d / "ours.safetensors")
    ours = load_file(str(d / "ours.safetensors"))
    assert rel(ours["logits"], logits) <= 1e-5
    assert abs(ours["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    assert ours["frozen_with_grad"].item() == 0
    assert len(grads) == 2 * 7 * 2
    for n, g in grads.items():
        assert rel(ours["grad." + n], g) <= 1e-5, n


def test_our_adapter_files_load_in_peft(work, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    d, logits, _, _ = work
    tool("resave", d / "base", d / "adapter", tmp_path / "resaved")
    cfg = json.loads((tmp_path / "resaved" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["use_rslora"] is True
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(d / "base")), str(tmp_path / "resaved"))
    ids = load_file(str(d / "in.safetensors"))["input_ids"]
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, logits) <= 1e-6
    # Our initialisation: B = 0 (the base's function), A uniform within 1/sqrt(in_features).
    tool("init", d / "base", tmp_path / "fresh", 8, 16, "q_proj,down_proj", 5)
    fresh = load_file(str(tmp_path / "fresh" / "adapter_model.safetensors"))
    assert len(fresh) == 2 * 2 * 2
    for n, t in fresh.items():
        if "lora_B" in n:
            assert t.abs().max().item() == 0, n
        else:
            bound = 1 / t.shape[1] ** 0.5
            assert t.abs().max().item() <= bound and t.std().item() > 0.3 * bound, n
    base = LlamaForCausalLM.from_pretrained(str(d / "base"))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        got = PeftModel.from_pretrained(base, str(tmp_path / "fresh"))(input_ids=ids).logits
    assert rel(got, want) <= 1e-6


def test_bad_adapters_are_named(work, tmp_path):
    d = work[0]
    r = tool("init", d / "base", tmp_path / "x", 8, 16, "q_proj,qkv_proj", 1, ok=False)
    assert r.returncode == 2 and "target module 'qkv_proj' matches no linear layer" in r.stderr, r.stderr
    r = tool("init", d / "base", tmp_path / "x", 0, 16, "q_proj", 1, ok=False)
    assert r.returncode == 2 and "r must be > 0" in r.stderr, r.stderr

    def bad_config(name, **change):
        a = tmp_path / name
        a.mkdir()
        cfg = json.loads((d / "adapter" / "adapter_config.json").read_text())
        cfg.update(change)
        (a / "adapter_config.json").write_text(json.dumps(cfg))
        (a / "adapter_model.safetensors").write_bytes((d / "adapter" / "adapter_model.safetensors").read_bytes())
        return a

    for name, change, needle in [
            ("dora", {"use_dora": True}, "DoRA is not supported"),
            ("regex", {"target_modules": ".*proj"}, "regular expression"),
            ("rank", {"r": 8}, "has shape"),
            ("pattern", {"rank_pattern": {"q_proj": 2}}, "per-layer rank"),
            ("type", {"peft_type": "IA3"}, "only LORA"),
            ("fewer", {"target_modules": ["q_proj"]}, "has no LoRA parameter")]:
        a = bad_config(name, **change)
        r = tool("resave", d / "base", a, tmp_path / "out", ok=False)
        assert r.returncode == 2 and needle in r.stderr, (name, r.stderr)
        assert "Exception raised from" not in r.stderr
    # A tensor missing from the file.
    a = bad_config("missing")
    t = load_file(str(a / "adapter_model.safetensors"))
    t.pop(sorted(t)[0])
    save_file(t, str(a / "adapter_model.safetensors"))
    r = tool("resave", d / "base", a, tmp_path / "out", ok=False)
    assert r.returncode == 2 and "no tensor for" in r.stderr, r.stderr


BIN = os.environ.get("COLOSSAL_BIN", os.path.join(BUILD, "colossal"))


def test_merge_loads_in_transformers_with_the_adapted_logits(work, tmp_path):
    """`colossal lora merge`: the merged HF folder loads in transformers (no extra tensors) and its
    logits equal PEFT's adapted model (and PEFT's own merge_and_unload weights); an adapter of
    another model is a named error (exit 2) and writes nothing."""
    from peft import PeftModel
    from safetensors.torch import load_file as load
    from transformers import LlamaConfig, LlamaForCausalLM
    d, logits, _, _ = work
    r = subprocess.run([BIN, "lora", "merge", "--model", str(d / "base"), "--adapter", str(d / "adapter"),
                        "--out", str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    merged = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"))
    ids = load(str(d / "in.safetensors"))["input_ids"]
    # Merging rounds W + s B A once per weight instead of adding two products per output: with an
    # adapter as large as the base here (rsLoRA scaling 6, B ~ 0.2 randn) that moves the fp32
    # logits by 2.0e-5 of their scale (measured); the weights themselves equal PEFT's merge to 1e-6.
    with torch.no_grad():
        assert rel(merged(input_ids=ids).logits, logits) <= 1e-4
    ref = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(d / "base")), str(d / "adapter"))
    ref = ref.merge_and_unload().state_dict()
    ours = load(str(tmp_path / "merged" / "model.safetensors"))
    assert set(ours) == set(ref) - {"lm_head.weight"} or set(ours) == set(ref)
    for k, t in ours.items():
        assert rel(t, ref[k]) <= 1e-6, k
    # A base of another shape: the adapter does not fit.
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64)).save_pretrained(str(tmp_path / "other"))
    r = subprocess.run([BIN, "lora", "merge", "--model", str(tmp_path / "other"), "--adapter", str(d / "adapter"),
                        "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "does not fit the model" in r.stderr, r.stderr
    assert not (tmp_path / "bad").exists()
