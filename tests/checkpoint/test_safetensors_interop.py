"""Interop with the reference: files written by Python safetensors load in C++ with the same
bytes, files written by C++ load in Python with the same values, and a sharded HF folder saved
by C++ has transformers' index format and loads with from_pretrained."""
import json
import os
import struct
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "")
TOOL = os.path.join(BUILD, "tests", "checkpoint", "st_tool")

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def tool(*args, check=True):
    if not os.path.exists(TOOL):
        pytest.fail(f"{TOOL} not built (build the st_tool target)")
    r = subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"st_tool {args} failed ({r.returncode}): {r.stderr}")
    return r


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(dtype)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def all_tensors():
    out = {}
    for i, (name, dt) in enumerate(DTYPES.items()):
        out[f"{name}.m"] = sample(dt, (5, 7), 3 * i)
        out[f"{name}.s"] = sample(dt, (), 3 * i + 1)
        out[f"{name}.e"] = torch.empty((0, 3), dtype=dt)
        out[f"{name}.odd"] = sample(dt, (3,), 3 * i + 2)  # odd byte lengths mix alignments
    return out


def parse_dump(text):
    lines = [json.loads(line) for line in text.splitlines()]
    return {d["name"]: d for d in lines[:-1]}, lines[-1]["metadata"]


def test_python_file_loads_in_cpp(tmp_path):
    tensors = all_tensors()
    meta = {"format": "pt", "who": "python"}
    p = tmp_path / "py.safetensors"
    save_file(tensors, str(p), metadata=meta)
    got, got_meta = parse_dump(tool("dump", p).stdout)
    assert got_meta == meta
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        d = got[name]
        assert d["dtype"] == name.split(".")[0], name
        assert d["shape"] == list(t.shape), name
        assert bytes.fromhex(d["hex"]) == raw(t), name


def test_cpp_file_loads_in_python(tmp_path):
    tensors = all_tensors()
    src = tmp_path / "py.safetensors"
    dst = tmp_path / "cpp.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt", "k": "v"})
    tool("copy", src, dst)
    loaded = load_file(str(dst))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, name
        assert loaded[name].shape == t.shape, name
        assert raw(loaded[name]) == raw(t), name
    with safe_open(str(dst), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
    # The header is padded with spaces to a multiple of 8, as the reference writes it.
    data = dst.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    assert data[8 : 8 + n].decode().rstrip(" ").endswith("}")


def test_corrupt_file_is_a_clean_error(tmp_path):
    p = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(16)}, str(p))
    data = p.read_bytes()
    p.write_bytes(data[:-5])
    r = tool("dump", p, check=False)
    assert r.returncode == 2, r.stderr
    assert str(p) in r.stderr and "truncated" in r.stderr


def hf_index_text(index):
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def test_sharded_folder_matches_hf_format(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.w": torch.randn(300 * 1024 // 4, generator=g) for i in range(5)}
    tensors["bias"] = torch.arange(10, dtype=torch.int64)
    src = tmp_path / "in.safetensors"
    save_file(tensors, str(src))
    out = tmp_path / "ck"
    tool("save-hf", src, out, 1)
    text = (out / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    assert text == hf_index_text(index)  # byte-identical to transformers' writer
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    for name, t in tensors.items():
        shard = load_file(str(out / index["weight_map"][name]))
        assert torch.equal(shard[name], t), name
        with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_transformers_from_pretrained_loads_cpp_shards(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    src = tmp_path / "in.safetensors"
    save_file(state, str(src))
    out = tmp_path / "hf"
    tool("save-hf", src, out, 1)
    assert (out / "model.safetensors.index.json").exists()
    cfg.save_pretrained(str(out))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k
    # And the C++ loader reads the same folder back.
    got, _ = parse_dump(tool("dump", out).stdout)
    assert set(got) == set(state)
    for k, v in state.items():
        assert bytes.fromhex(got[k]["hex"]) == raw(v), k
