"""colossal.cpp's Llama-family models against Hugging Face transformers (CPU, fp32).

For random tiny models of each architecture and rope scaling, made and saved by transformers:
logits, loss and every parameter gradient (tests/nn/model_tool) and 32 greedily generated tokens
(`colossal generate`, KV cache) must match HF's. Also: what save_pretrained writes (one file or
small shards, HF weights or our own init) loads in transformers with the same logits.
"""
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig,
                          Qwen2Config)

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "")
TOOL = os.path.join(BUILD, "tests", "nn", "model_tool")
BIN = os.environ.get("COLOSSAL_BIN", os.path.join(BUILD, "colossal"))
torch.set_num_threads(1)

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            initializer_range=0.02, rms_norm_eps=1e-6)

CASES = {
    "llama_gqa": (LlamaConfig, {}),
    "llama_tied_mha_bias_odd": (LlamaConfig, dict(
        vocab_size=131, hidden_size=48, intermediate_size=77, num_attention_heads=3,
        num_key_value_heads=3, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama_head_dim": (LlamaConfig, dict(head_dim=24, num_key_value_heads=1, rope_theta=500000.0)),
    "llama_linear": (LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 2.5})),
    "llama_dynamic": (LlamaConfig, dict(max_position_embeddings=16,
                                        rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama3": (LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "mistral_window": (MistralConfig, dict(sliding_window=7)),
    "qwen2_tied": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2_window": (Qwen2Config, dict(use_sliding_window=True, sliding_window=6,
                                       max_window_layers=1)),
}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def make_hf(name, tmp_path_factory):
    cls, kw = CASES[name]
    cfg = cls(**{**BASE, **kw})
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():  # decisive random weights (norms around one, non-zero biases)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    return model, d


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    model, d = make_hf(request.param, tmp_path_factory)
    return request.param, model, d


def run_tool(*args):
    r = subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def hf_logits(model_dir, ids, mask=None):
    m = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=mask).logits


def test_logits_loss_grads(hf_case, tmp_path):
    name, model, d = hf_case
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    inputs = {"input_ids": ids, "labels": labels}
    mask = None
    if name in ("llama_gqa", "qwen2_tied"):  # right padding in row 1
        mask = torch.ones_like(ids)
        mask[1, 18:] = 0
        labels[1, 18:] = -100
        inputs["attention_mask"] = mask
    save_file(inputs, tmp_path / "in.safetensors")
    run_tool("run", d, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    ours = load_file(tmp_path / "out.safetensors")

    model.zero_grad()
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    logits = out.logits.detach()
    if mask is not None:  # padding positions are not compared (their outputs are never used)
        keep = mask.bool()
        assert rel(ours["logits"][keep], logits[keep]) <= 1e-5
    else:
        assert rel(ours["logits"], logits) <= 1e-5, name
    assert abs(ours["loss"].item() - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    hf_params = dict(model.named_parameters())
    ours_grads = {k[5:]: v for k, v in ours.items() if k.startswith("grad.")}
    assert sorted(ours_grads) == sorted(hf_params)
    for n, p in hf_params.items():
        assert rel(ours_grads[n], p.grad) <= 1e-4, (name, n, rel(ours_grads[n], p.grad))


def hf_greedy(model_dir, prompt, n):
    """HF's own KV-cache decoding loop (no generation config: no eos stop, no processors)."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    m.eval()
    ids = torch.tensor([prompt])
    cache = DynamicCache(config=m.config)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = m(input_ids=ids, past_key_values=cache, use_cache=True).logits
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def test_generate_matches_hf(hf_case):
    name, model, d = hf_case
    prompt = [5, 17, 3, 42, 8, 1, 99]
    r = subprocess.run([BIN, "generate", "--model", str(d), "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-new-tokens", "32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # logs go to stderr
    ours = [int(t) for t in lines[0].split()]
    assert ours == hf_greedy(d, prompt, 32), name


SAMPLING = {  # name: (our flags, HF generate() arguments)
    "greedy_repetition": (["--repetition-penalty", "1.3"], dict(do_sample=False, repetition_penalty=1.3)),
    "temperature": (["--do-sample", "--temperature", "0.7", "--seed", "5"],
                    dict(do_sample=True, temperature=0.7, seed=5)),
    "top_k": (["--do-sample", "--top-k", "10", "--seed", "6"], dict(do_sample=True, top_k=10, seed=6)),
    "top_p": (["--do-sample", "--top-p", "0.8", "--seed", "7"], dict(do_sample=True, top_p=0.8, seed=7)),
    "all": (["--do-sample", "--temperature", "1.3", "--top-k", "40", "--top-p", "0.9",
             "--repetition-penalty", "1.2", "--seed", "8"],
            dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=8)),
}


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_generate_sampling_matches_hf(case, tmp_path_factory):
    """Repetition penalty, temperature, top-k and top-p, and the seeded draw, against HF's
    generate() on CPU: the same processors in the same order and the same torch.multinomial on a
    CPU generator seeded alike give the same tokens (fp32 logits equal to ~1e-6: a draw would
    have to land that close to a boundary to differ)."""
    flags, kw = SAMPLING[case]
    model, d = make_hf("llama_gqa", tmp_path_factory)
    prompt = [5, 17, 3, 42, 8, 1, 99, 5, 5]
    r = subprocess.run([BIN, "generate", "--model", str(d), "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-new-tokens", "32", *flags], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ours = [int(t) for t in r.stdout.split()]
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa", dtype=torch.float32).eval()
    kw = dict(kw)
    seed = kw.pop("seed", 0)
    torch.manual_seed(seed)
    # No eos anywhere: HF neither stops early nor masks eos (min_new_tokens would, and that
    # changes top-p's nucleus).
    m.generation_config.eos_token_id = None
    out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                     max_new_tokens=32, pad_token_id=0, top_k=kw.pop("top_k", 0), top_p=kw.pop("top_p", 1.0),
                     temperature=kw.pop("temperature", 1.0), **kw)
    assert ours == out[0, len(prompt):].tolist(), case
    if kw["do_sample"]:  # another seed, other tokens
        flags2 = [f if f != str(seed) else str(seed + 100) for f in flags]
        r2 = subprocess.run([BIN, "generate", "--model", str(d), "--prompt-ids", ",".join(map(str, prompt)),
                             "--max-new-tokens", "32", *flags2], capture_output=True, text=True, timeout=300)
        assert r2.returncode == 0 and [int(t) for t in r2.stdout.split()] != ours


def test_generate_sampling_errors(tmp_path_factory):
    model, d = make_hf("llama_gqa", tmp_path_factory)

    def gen(*args):
        return subprocess.run([BIN, "generate", "--model", str(d), "--prompt-ids", "1,2", *args],
                              capture_output=True, text=True, timeout=60)

    for args, needle in [(["--temperature", "0.5"], "--temperature only applies when sampling"),
                         (["--seed", "3"], "--seed only applies when sampling"),
                         (["--do-sample", "--temperature", "0"], "--temperature must be"),
                         (["--do-sample", "--temperature", "nan"], "--temperature must be"),
                         (["--do-sample", "--top-p", "0"], "--top-p must be in (0, 1]"),
                         (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
                         (["--do-sample", "--top-k", "-1"], "--top-k must be >= 0"),
                         (["--repetition-penalty", "0"], "--repetition-penalty must be"),
                         (["--do-sample", "--seed", "-4"], "--seed must be >= 0")]:
        r = gen(*args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)


def text_model(tmp_path, kind):
    """A random tiny Llama whose vocabulary is a tokenizer's, trained here: a byte-level BPE
    tokenizer.json with a BOS template, or a SentencePiece tokenizer.model."""
    corpus = ["Hello world, this is a small corpus for a tiny tokenizer %d." % i for i in range(200)] + [
        "Größe café 東京 😀 naïve", "def f(x):\n    return x * 2"] * 20
    d = tmp_path / kind
    d.mkdir()
    if kind == "json":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=320, special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tok.save(str(d / "tokenizer.json"))
        vocab = tok.get_vocab_size()
        encode = lambda t: tok.encode(t).ids
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    else:
        import sentencepiece as spm
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(d / "tokenizer"),
                                       vocab_size=400, model_type="bpe", byte_fallback=True,
                                       minloglevel=2, num_threads=1)
        sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
        vocab = sp.get_piece_size()
        encode = lambda t: sp.encode(t, add_bos=True)
        decode = lambda ids: sp.decode(ids)
    cfg = LlamaConfig(**{**BASE, "vocab_size": vocab})
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.15) if not n.endswith("norm.weight") else p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(d)
    return d, encode, decode


@pytest.mark.parametrize("kind", ["json", "model"])
def test_generate_text_prompt(kind, tmp_path):
    """--prompt TEXT through the model folder's tokenizer (tokenizer.json or tokenizer.model):
    the printed text equals the tokenizer's decoding of HF's tokens for the same prompt, greedy
    and sampled, although it was printed piece by piece as the tokens came."""
    d, encode, decode = text_model(tmp_path, kind)
    prompt = "Hello world, café"
    ids = encode(prompt)
    r = subprocess.run([BIN, "generate", "--model", str(d), "--prompt", prompt, "--max-new-tokens", "24"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == decode(hf_greedy(d, ids, 24)) + "\n"
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa", dtype=torch.float32).eval()
    torch.manual_seed(11)
    m.generation_config.eos_token_id = None  # as above: no early stop, no eos mask
    # An explicit mask: HF would take the BOS (id 0 here, as pad_token_id) for padding.
    out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                     max_new_tokens=24, pad_token_id=0, do_sample=True, top_k=0, top_p=0.95, temperature=0.9)
    r = subprocess.run([BIN, "generate", "--model", str(d), "--prompt", prompt, "--max-new-tokens", "24",
                        "--do-sample", "--top-p", "0.95", "--temperature", "0.9", "--seed", "11"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == decode(out[0, len(ids):].tolist()) + "\n"


def test_generate_text_prompt_errors(tmp_path):
    d, _, _ = text_model(tmp_path, "json")

    def gen(*args):
        return subprocess.run([BIN, "generate", "--model", str(d), *map(str, args)],
                              capture_output=True, text=True, timeout=60)

    r = gen("--prompt", "hi", "--prompt-ids", "1,2")
    assert r.returncode == 2 and "one of them" in r.stderr
    r = gen()
    assert r.returncode == 2 and "one of them" in r.stderr
    r = gen("--prompt-ids", "1,2", "--tokenizer", d)
    assert r.returncode == 2 and "--tokenizer is for --prompt" in r.stderr
    r = gen("--prompt", "hi", "--tokenizer", tmp_path / "nothing-here")
    assert r.returncode == 2 and "nothing-here" in r.stderr
    (tmp_path / "empty").mkdir()
    r = gen("--prompt", "hi", "--tokenizer", tmp_path / "empty")
    assert r.returncode == 2 and "neither tokenizer.json nor tokenizer.model" in r.stderr


def test_save_pretrained_round_trip(tmp_path_factory, tmp_path):
    # Big enough (~2.4 MB fp32) that 1 MB shards give several files.
    cfg = LlamaConfig(**{**BASE, "vocab_size": 1500, "hidden_size": 128, "intermediate_size": 200,
                         "num_attention_heads": 4, "num_key_value_heads": 2})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    src = tmp_path / "src"
    model.save_pretrained(src)
    ids = torch.randint(0, 1500, (1, 12))
    ref = hf_logits(src, ids)
    for shard_mb in (1, 1024):
        out = tmp_path / f"out{shard_mb}"
        run_tool("resave", src, out, shard_mb)
        files = sorted(p.name for p in out.iterdir())
        if shard_mb == 1:
            assert "model.safetensors.index.json" in files
            assert sum(f.endswith(".safetensors") for f in files) >= 3, files
        else:
            assert "model.safetensors" in files
        conf = json.loads((out / "config.json").read_text())
        assert conf["model_type"] == "llama" and conf["architectures"] == ["LlamaForCausalLM"]
        assert rel(hf_logits(out, ids), ref) == 0.0


@pytest.mark.parametrize("case", ["llama_tied_mha_bias_odd", "qwen2_window"])
def test_our_init_loads_in_hf(case, tmp_path):
    cls, kw = CASES[case]
    cfg = cls(**{**BASE, **kw})
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    out = tmp_path / "ours"
    run_tool("init", tmp_path / "config.json", out, 7)
    state = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in state) == (not cfg.tie_word_embeddings)
    for n, t in state.items():
        if n.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t))
        elif n.endswith(".bias"):
            assert torch.equal(t, torch.zeros_like(t))
        elif t.numel() > 4000:
            assert abs(t.std().item() - 0.02) < 0.002, n
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    hf = hf_logits(out, ids)
    save_file({"input_ids": ids, "labels": ids.clone()}, tmp_path / "in.safetensors")
    run_tool("run", out, tmp_path / "in.safetensors", tmp_path / "res.safetensors")
    assert rel(load_file(tmp_path / "res.safetensors")["logits"], hf) <= 1e-5
    # Same seed, same weights.
    run_tool("init", tmp_path / "config.json", tmp_path / "again", 7)
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(again[n], t) for n, t in state.items())


def test_generate_errors(tmp_path):
    def gen(*args):
        return subprocess.run([BIN, "generate", *map(str, args)], capture_output=True, text=True, timeout=60)

    r = gen("--model", tmp_path / "missing", "--prompt-ids", "1,2")
    assert r.returncode == 2 and "missing" in r.stderr
    r = gen("--model", tmp_path, "--prompt-ids", "1,x")
    assert r.returncode == 2 and "'x'" in r.stderr
    r = gen("--model", tmp_path, "--prompt-ids", "1", "--dtype", "fp8")
    assert r.returncode == 2 and "fp8" in r.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    r = gen("--model", tmp_path, "--prompt-ids", "1")
    assert r.returncode == 2 and "gpt2" in r.stderr
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}))
    r = gen("--model", tmp_path, "--prompt-ids", "1")
    assert r.returncode == 2 and "yarn" in r.stderr


def test_generate_bf16_runs(hf_case):
    name, model, d = hf_case
    if name != "llama_gqa":
        pytest.skip("one bf16 smoke run is enough")
    r = subprocess.run([BIN, "generate", "--model", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                        "--dtype", "bf16"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    toks = [int(t) for t in r.stdout.split()]
    assert len(toks) == 8 and all(0 <= t < model.config.vocab_size for t in toks)
