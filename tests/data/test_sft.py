"""`colossal prepare --sft` against the reference in Python: chat templates (chatml, llama3)
give exactly the tokens and the assistant mask of transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` with the official template plus `{% generation %}`; plain
prompt/response records the ids of `tokenizers` with BOS and EOS; packing puts every record
inside one bin of exactly --pack tokens, padded with EOS (mask 0) that joins the record before
it. Bad input is a non-zero exit naming the file:line or value, with nothing written.
"""
import json
import os
import re
import subprocess

import numpy as np
import pytest

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
BIN = os.environ.get("COLOSSAL_BIN", os.path.join(BUILD, "colossal"))

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen2's template without the default system message; Llama 3's; both with {% generation %}
# around each assistant message's content and its end-of-turn token.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}")
LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Japan?"},
     {"role": "assistant", "content": "Tokyo (東京) is the capital."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Say hi."},
     {"role": "assistant", "content": "hi"},
     {"role": "user", "content": "Again, in French: café?"},
     {"role": "assistant", "content": "  salut, un café ☕  "}],
    [{"role": "user", "content": "\n\nleading newlines"},
     {"role": "assistant", "content": "\n\n\n😀 emoji after newlines\n"},
     {"role": "user", "content": "trailing spaces   "},
     {"role": "assistant", "content": " \t mixed whitespace \n "}],
    [{"role": "system", "content": "Größe und Übermut"},
     {"role": "user", "content": "empty answer next"},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "ok"}],
    [{"role": "assistant", "content": "The assistant speaks first."},
     {"role": "user", "content": "numbers 12345 and\ttabs"},
     {"role": "assistant", "content": "Ça va 12345!\n\n"}],
]
PAIRS = [{"prompt": "Translate: cat", "response": " chat"},
         {"prompt": "東京 is", "response": "the capital\n"},
         {"prompt": "", "response": "an answer without a prompt"}]


def corpus_lines():
    lines = []
    for conv in CONVERSATIONS:
        lines += [m["content"] for m in conv]
    lines += [p["prompt"] + p["response"] for p in PAIRS]
    lines += ["system user assistant", "the quick brown fox jumps over the lazy dog"]
    return lines * 20


def train(path, specials, nfc=False):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>"] + specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train(p, CHATML_TOKENS + LLAMA3_TOKENS)
    return p


def prepare(*args):
    return subprocess.run([BIN, "prepare", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")
    return path


def read_tokens(path):
    h = np.fromfile(path, dtype=np.int32, count=256)
    dtype = np.uint16 if h[0] == 20240520 else np.uint32
    toks = np.fromfile(path, dtype=dtype, offset=1024)
    assert len(toks) == h[2]
    return toks.tolist()


def read_index(path):
    h = np.fromfile(path, dtype=np.int32, count=256)
    assert h[0] == 20241204 and h[1] == 1
    n = int(h[2]) | (int(h[3]) << 32)
    off = np.fromfile(path, dtype=np.uint64, offset=1024).tolist()
    assert len(off) == n + 1 and off[0] == 0
    return off


def read_mask(path):
    h = np.fromfile(path, dtype=np.int32, count=256)
    assert h[0] == 20241205 and h[1] == 1, h[:5]
    n = int(h[2]) | (int(h[3]) << 32)
    m = np.fromfile(path, dtype=np.uint8, offset=1024).tolist()
    assert len(m) == n and set(m) <= {0, 1}
    return m, int(h[4])


def hf_chat(tok_path, template, conv):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok_path)))
    hf.chat_template = TEMPLATES[template]
    out = hf.apply_chat_template(conv, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_templates_equal_transformers(tok_path, tmp_path, template):
    recs = [{"messages": c} for c in CONVERSATIONS] + PAIRS[:2]
    src = write_jsonl(tmp_path / "chat.jsonl", recs)
    out = tmp_path / "sft.bin"
    r = prepare("--tokenizer", tok_path, "--out", out, "--sft", "--chat_template", template,
                "--threads", 2, src)
    assert r.returncode == 0, r.stderr
    convs = CONVERSATIONS + [[{"role": "user", "content": p["prompt"]},
                              {"role": "assistant", "content": p["response"]}] for p in PAIRS[:2]]
    want_ids, want_mask, starts = [], [], [0]
    for conv in convs:
        ids, mask = hf_chat(tok_path, template, conv)
        assert mask[0] == 0 and sum(mask) > 0
        want_ids += ids
        want_mask += mask
        starts.append(len(want_ids))
    toks = read_tokens(out)
    mask, seq = read_mask(str(out) + ".mask")
    assert seq == 0
    assert toks == want_ids
    assert mask == want_mask
    assert read_index(str(out) + ".docs") == starts
    assert f"prepared {len(convs)} SFT records" in r.stderr, r.stderr
    frac = re.search(r"fraction ([0-9.]+)", r.stderr).group(1)
    assert abs(float(frac) - sum(want_mask) / len(want_mask)) < 1e-4


def test_template_with_nfc_normalizer(tmp_path):
    """A normalizer that changes the text (NFC on decomposed characters, as Qwen2's): the mask
    still equals transformers' where the changes are inside the content."""
    tok = tmp_path / "nfc.json"
    train(tok, CHATML_TOKENS, nfc=True)
    convs = [[{"role": "user", "content": "cafe\u0301?"},
              {"role": "assistant", "content": "e\u0301te\u0301 \u212b and cafe\u0301"}],
             [{"role": "system", "content": "\u212bngstro\u0308m"},
              {"role": "user", "content": "x"},
              {"role": "assistant", "content": " na\u0131\u0308ve cafe\u0301 "}]]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    out = tmp_path / "nfc.bin"
    r = prepare("--tokenizer", tok, "--out", out, "--sft", "--chat_template", "chatml", src)
    assert r.returncode == 0, r.stderr
    want = [hf_chat(tok, "chatml", c) for c in convs]
    assert read_tokens(out) == [t for ids, _ in want for t in ids]
    assert read_mask(str(out) + ".mask")[0] == [m for _, mask in want for m in mask]


def test_prompt_response(tok_path, tmp_path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
    src = write_jsonl(tmp_path / "pairs.jsonl",
                      [{"q": p["prompt"], "a": p["response"], "extra": 1} for p in PAIRS])
    out = tmp_path / "pairs.bin"
    for bos in (True, False):
        args = ["--prompt_field", "q", "--response_field", "a"] + ([] if bos else ["--no_bos"])
        r = prepare("--tokenizer", tok_path, "--out", out, "--sft", *args, src)
        assert r.returncode == 0, r.stderr
        want_ids, want_mask = [], []
        for p in PAIRS:
            pr = ([0] if bos else []) + tok.encode(p["prompt"], add_special_tokens=False).ids
            rs = tok.encode(p["response"], add_special_tokens=False).ids + [1]
            m = [0] * len(pr) + [1] * len(rs)
            m[0] = 0  # a record's first token is never a target (here: the empty prompt's)
            want_ids += pr + rs
            want_mask += m
        assert read_tokens(out) == want_ids
        assert read_mask(str(out) + ".mask") == (want_mask, 0)
    # A plain prepare of the same output drops the stale mask.
    txt = tmp_path / "plain.txt"
    txt.write_text("plain text")
    assert prepare("--tokenizer", tok_path, "--out", out, txt).returncode == 0
    assert not os.path.exists(str(out) + ".mask")


def reference_pack(records, seq, pad, truncate=False):
    """records: (ids, mask) lists. Returns tokens, mask, doc starts, bins, padding, truncated."""
    toks, mask, starts = [], [], []
    fill = bins = padding = truncated = 0
    for ids, m in records:
        if len(ids) > seq:
            assert truncate
            ids, m = ids[:seq], m[:seq]
            truncated += 1
        if fill + len(ids) > seq:
            toks += [pad] * (seq - fill)
            mask += [0] * (seq - fill)
            padding += seq - fill
            fill, bins = 0, bins + 1
        starts.append(len(toks))
        toks += ids
        mask += m
        fill += len(ids)
        if fill == seq:
            fill, bins = 0, bins + 1
    if fill:
        toks += [pad] * (seq - fill)
        mask += [0] * (seq - fill)
        padding += seq - fill
        bins += 1
    toks.append(pad)
    mask.append(0)
    padding += 1
    return toks, mask, starts + [len(toks)], bins, padding, truncated


@pytest.mark.parametrize("truncate", [False, True])
def test_packing(tok_path, tmp_path, truncate):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
    seq = 24
    words = "the quick brown fox jumps over the lazy dog".split()
    pairs = [{"prompt": " ".join(words[:1 + i % 5]), "response": " ".join(words[i % 7:])}
             for i in range(12)]
    if truncate:
        pairs.insert(3, {"prompt": "a long one", "response": " ".join(words * 6)})
    src = write_jsonl(tmp_path / "p.jsonl", pairs)
    out = tmp_path / "packed.bin"
    extra = ["--truncate"] if truncate else []
    r = prepare("--tokenizer", tok_path, "--out", out, "--sft", "--pack", seq, *extra, src)
    assert r.returncode == 0, r.stderr
    recs = []
    for p in pairs:
        pr = [0] + tok.encode(p["prompt"], add_special_tokens=False).ids
        rs = tok.encode(p["response"], add_special_tokens=False).ids + [1]
        recs.append((pr + rs, [0] * len(pr) + [1] * len(rs)))
    toks, mask, starts, bins, padding, truncated = reference_pack(recs, seq, pad=1,
                                                                  truncate=truncate)
    assert read_tokens(out) == toks
    assert read_mask(str(out) + ".mask") == (mask, seq)
    offs = read_index(str(out) + ".docs")
    assert offs == starts
    assert len(toks) == bins * seq + 1 and bins >= 3
    for d in range(len(recs)):  # no record crosses a bin; each starts with mask 0
        n = min(len(recs[d][0]), seq)
        assert offs[d] // seq == (offs[d] + n - 1) // seq
        assert mask[offs[d]] == 0
        assert all(t == 1 and m == 0 for t, m in zip(toks[offs[d] + n:offs[d + 1]],
                                                     mask[offs[d] + n:offs[d + 1]]))
    assert f"{bins} bins of {seq} tokens, {padding} padding tokens (id 1), {truncated} records " \
           "truncated" in r.stderr, r.stderr
    assert truncated == (1 if truncate else 0)
    # A template and --pad_id: the same bin invariants, padding with the id given.
    src2 = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    r = prepare("--tokenizer", tok_path, "--out", out, "--sft", "--chat_template", "chatml",
                "--pack", 128, "--pad_id", 7, src2)
    assert r.returncode == 0, r.stderr
    recs = [hf_chat(tok_path, "chatml", c) for c in CONVERSATIONS]
    toks, mask, starts, _, _, _ = reference_pack(recs, 128, pad=7)
    assert read_tokens(out) == toks
    assert read_mask(str(out) + ".mask") == (mask, 128)
    assert read_index(str(out) + ".docs") == starts


def test_bad_input(tok_path, tmp_path):
    out = tmp_path / "o.bin"
    out.write_bytes(b"previous output")  # an error never touches it

    def fails(needle, *args, tok=tok_path):
        r = prepare("--tokenizer", tok, "--out", out, "--sft", *args)
        assert r.returncode != 0 and needle in r.stderr, (args, r.stderr)
        assert out.read_bytes() == b"previous output"
        for suffix in (".docs", ".mask"):
            assert not os.path.exists(str(out) + suffix)
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]

    bad = tmp_path / "bad.jsonl"
    good = {"prompt": "p", "response": "r"}
    write_jsonl(bad, [good, {"prompt": "only a prompt"}])
    fails(f'{bad}:2 has no field "response"', bad)
    write_jsonl(bad, [{"text": "neither"}])
    fails(f'{bad}:1 has neither a "messages" field nor "prompt" and "response"', bad)
    write_jsonl(bad, [good, good, {"messages": CONVERSATIONS[0]}])
    fails(f'{bad}:3: a "messages" record needs a chat template', bad)
    fails("unknown chat template 'vicuna'; known: chatml, llama3", "--chat_template", "vicuna",
          bad)
    write_jsonl(bad, [{"messages": [{"role": "user", "content": "x"},
                                    {"role": "tool", "content": "y"}]}])
    fails(f'{bad}:1: messages[1] has role "tool"', "--chat_template", "chatml", bad)
    write_jsonl(bad, [{"messages": [{"role": "user", "content": 3}]}])
    fails(f'{bad}:1: messages[0]: field "content" is not a string', "--chat_template", "chatml",
          bad)
    write_jsonl(bad, [{"messages": [{"content": "no role"}]}])
    fails(f'{bad}:1: messages[0] has no field "role"', "--chat_template", "chatml", bad)
    write_jsonl(bad, [{"messages": []}])
    fails(f'{bad}:1: field "messages" is not a non-empty array', "--chat_template", "chatml", bad)
    write_jsonl(bad, [good, {"prompt": "long " * 40, "response": "x"}])
    r = prepare("--tokenizer", tok_path, "--out", tmp_path / "ok.bin", "--sft", "--pack", 400, bad)
    assert r.returncode == 0, r.stderr  # fits in 400
    fails(f"{bad}:2: the record has ", "--pack", 16, bad)
    fails("more than --pack 16 holds", "--pack", 16, bad)
    txt = tmp_path / "notes.txt"
    txt.write_text("plain text")
    fails(f"--sft reads JSONL records (*.jsonl) only; {txt} is not one", bad, txt)
    # A tokenizer without the Llama 3 tokens: chatml works, llama3 names the missing token.
    small = tmp_path / "small.json"
    train(small, CHATML_TOKENS)
    write_jsonl(bad, [{"messages": CONVERSATIONS[0]}])
    fails("chat template llama3 needs the special token <|begin_of_text|>, which tokenizer",
          "--chat_template", "llama3", bad, tok=small)
    r = prepare("--tokenizer", small, "--out", tmp_path / "ok.bin", "--sft", "--chat_template",
                "chatml", bad)
    assert r.returncode == 0, r.stderr


LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
OFFSET_TEXTS = [
    "<|im_start|>assistant\n\n\n😀 emoji after newlines\n<|im_end|>\n",
    "Tokyo (東京) is the capital. Größe 12345 über  \t\n  spaces  ",
    "  leading<|eot_id|>trailing  👨‍👩‍👧 🇩🇪 ",
    "caf\u00e9 and cafe\u0301 (decomposed), \u212b, e\u0301\u0301 at the end e\u0301",
]


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "qwen2_nfc", "prefix_space"])
def test_token_offsets_equal_tokenizers(tmp_path, kind):
    """data::Tokenizer::encode_with_offsets against tokenizers' offsets (characters, rounded out
    from our bytes): exact for every token where the normalizer leaves the text as it is, and
    before the first character NFC changes."""
    import unicodedata
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers
    tok = Tokenizer(models.BPE())
    if kind in ("gpt2", "prefix_space"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "prefix_space")
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if kind == "qwen2_nfc":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=CHATML_TOKENS + LLAMA3_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines() + OFFSET_TEXTS * 5, trainer)
    path = tmp_path / "tok.json"
    tok.save(str(path))
    r = subprocess.run([os.path.join(BUILD, "tests", "data", "offsets_tool"), str(path)],
                       input="".join(json.dumps(t) + "\n" for t in OFFSET_TEXTS),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for text, line in zip(OFFSET_TEXTS, r.stdout.splitlines()):
        ours = json.loads(line)
        enc = tok.encode(text, add_special_tokens=False)
        assert [t[0] for t in ours] == enc.ids
        char_of_byte = []
        for ci, ch in enumerate(text):
            char_of_byte += [ci] * len(ch.encode("utf-8"))
        exact_until = len(text)
        if kind == "qwen2_nfc":
            exact_until = next((i for i in range(len(text))
                                if unicodedata.normalize("NFC", text[:i + 1]) != text[:i + 1]
                                or unicodedata.normalize("NFC", text[i:i + 2]) != text[i:i + 2]),
                               len(text))
        checked = 0
        for (tid, b, e), (cs, ce) in zip(ours, enc.offsets):
            assert 0 <= b < e <= len(char_of_byte), (text, tid, b, e)
            if ce > exact_until:
                continue
            assert (char_of_byte[b], char_of_byte[e - 1] + 1) == (cs, ce), (kind, text, tid)
            checked += 1
        assert checked > 0


def test_prepared_sft_trains_with_doc_mask(tok_path, tmp_path):
    """End to end: `prepare --sft --pack` output trains under --doc_mask on two ranks; training
    reads the mask prepare wrote (its count of trained targets in the first log lines) and the
    loss of step 1 equals one process's (the global masked mean)."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS] * 8)
    out = tmp_path / "sft.bin"
    r = prepare("--tokenizer", tok_path, "--out", out, "--sft", "--chat_template", "chatml",
                "--pack", 64, src)
    assert r.returncode == 0, r.stderr
    mask, _ = read_mask(str(out) + ".mask")
    model = {"model_type": "llama", "vocab_size": 704, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (tmp_path / "model.json").write_text(json.dumps(model))
    losses = []
    for nproc in (0, 2):
        args = [BIN, "train", "--model", tmp_path / "model.json", "--data", out, "--seq_len", 64,
                "--micro_batch", 4 if nproc == 0 else 2, "--steps", 2, "--doc_mask", "true",
                "--shuffle", "false", "--metrics_file", tmp_path / f"m{nproc}.jsonl"]
        if nproc:
            args = [BIN, "run", "--nproc_per_node", nproc, "--master_port", 0] + args
        p = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"{sum(mask)} of {len(mask)} tokens" in p.stderr, p.stderr[-3000:]
        rows = [json.loads(l) for l in (tmp_path / f"m{nproc}.jsonl").read_text().splitlines()]
        losses.append([m["loss"] for m in rows])
    assert len(losses[0]) == 2
    # fp32 on the CPU, reordered sums (tests/booster/test_doc_mask.py): 1e-5 relative.
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(b), losses
