"""`colossal tokenize` against the Python `tokenizers` package (the oracle, pinned in
scripts/requirements.txt): encode with and without special tokens and decode with and without
skipping them must be identical, on tokenizer.json files shaped like the real ones.

No model files can be downloaded, so each fixture is trained here on an embedded multilingual
text with the components the real files use:
  gpt2    ByteLevel pre-tokenizer with its regex, ByteLevel decoder / post-processor
  llama3  Split(Llama-3 regex, Isolated) + ByteLevel(use_regex=false), ignore_merges,
          <|begin_of_text|> template, added tokens with single_word / lstrip / rstrip
  qwen2   NFC normalizer, Split(Qwen2 regex) + ByteLevel(use_regex=false), ChatML specials
  llama2  byte_fallback BPE with <0x00>..<0xFF> in the model vocabulary, Prepend/Replace
          normalizer, Replace/ByteFallback/Fuse/Strip decoder, <s> template, fuse_unk
  mistral the same model with the Metaspace pre-tokenizer/decoder (prepend_scheme first),
          <s> $A </s>
"""

import json
import os
import random
import subprocess

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

BIN = os.environ.get("COLOSSAL_BIN", "colossal")

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it?",
    "Hello world! HELLO WORLD! hello, world... I'M SURE YOU'LL SEE; we're fine.",
    "Café, naïve, résumé, Ångström, façade, São Paulo, Zürich, Kraków, Đà Nẵng.",
    "Combining marks: e\u0301 a\u0308 o\u0302 n\u0303 (decomposed) vs é ä ô ñ (composed).",
    "日本語のテキストです。東京は大きな都市です。中文文本：北京欢迎你！한국어 문장도 있습니다.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇩🇪 ❤️ 🚀✨ and more 🎉🎉🎉.",
    "Digits 0123456789 1234567 3.14159 2,718,281 1e-9 ٣٤٥ ४५६ numbers: 42, 1000000.",
    "def main(argc, argv):\n    for i in range(10):\n        print(f\"{i:>4}\")\n    return 0\n",
    "int main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 2 ? 0 : 1;\n}\n",
    "Whitespace    runs     and\t\ttabs\t and  \n\n\n newlines \r\n windows line ends.",
    "Русский текст: съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ελληνικά: Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιὰ στὸ χρυσαφὶ ξέφωτο.",
    "עברית ועוד טקסט, العربية نص قصير، हिन्दी में कुछ पाठ, ภาษาไทย ข้อความ.",
    "URLs http://example.com/path?q=1&r=2 and emails someone@example.org #hashtag @user",
    "The the the THE tHe. A a A. word word word, word-word word_word.",
    "    leading spaces and trailing spaces    ",
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"s\": \"v\"} // comment /* block */",
    "Mathematics: ∀x ∈ ℝ, x² ≥ 0; ∑_{i=1}^n i = n(n+1)/2; √2 ≈ 1.414; ∞ ≠ ½.",
    "Full-width: ＡＢＣ１２３ ｶﾀｶﾅ; ligature ﬁ ﬂ; superscript ⁵; circled ①②.",
    "Non-breaking\u00a0space, ideographic\u3000space, en\u2002space, NEL\u0085char, zwsp\u200bhere.",
]

EDGE = [
    "", " ", "  ", "   ", "\n", "\n\n\n", "\t", " \n ", "a", " a", "a ", " a ", "  a  b  ",
    "'s", "'S", "don't", "DON'T", "I'm", "x'll", "ſ's", "'ſ",
    "1", "12", "123", "1234", "12345678901", "a1b2c3", "٣٤٥٦",
    "😀", " 😀", "😀😀", "\U0010ffff", "\u0000", "\x01\x02\x7f", "\u00ad", "\ufeffbom",
    "<|begin_of_text|>", "<|begin_of_text|>hello", "hello<|begin_of_text|>", " <|begin_of_text|> ",
    "<|end_of_text|><|begin_of_text|>", "<|begin_of_text|<|begin_of_text|>|>", "<|begin_of_",
    "<|endoftext|>", "a<|endoftext|>b", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>", "</s>", "<s>hello</s>", " <s> ", "<unk>", "a <s> b </s> c", "<s><s></s>",
    "hello_world", "say hello_world!", "xhello_world", "hello_worldx", "_hello_world",
    "<mask>", "a <mask> b", "a   <mask>   b", "<mask><mask>", "[ROLE]", " [ROLE]  x", "[ROLE]\n",
    "<0x41>", "<0xFF>", "▁", "▁▁", " ▁ ", "▁hello", "Ω≈ç√∫", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ᄀᄁᄂ", "\u1100\u1161",
    "Ǆǅǆ İstanbul", "ΣΑΣ σας", "ﬃ", "Å", "Å",
    # Where the regex engines' \s and case folding could part ways (PCRE2 here, Oniguruma there).
    "a\u2028b", "a \u2029 b", "x\x1c\x1d\x1e\x1fy", "a\u180eb", "a \u200b b", "\u0085\u0085x",
    "a\x0bb\x0cc", " \u00a0 x", "a  \u3000\u3000b", "1\u00b2\u00bd", "K\u212a's", "\u0130's",
    "x'\u017f", "\u01c4'LL", "a'\u0131d", "\u2066x", "\u0600", "\U000e0041", "\u0345'",
    # Letters and digits of Unicode 15/16 (CJK ext. H, Kawi, Nag Mundari, Egyptian ext. A, ...),
    # which the package's Oniguruma knows and PCRE2 10.42 does not.
    "a\U00031350b", "(\U00013c0d\U000c33be", "\U0001e4d0\U0001e4f0x", "x\U00011f04 y",
    " \U00010d40\U00010d41 1", "\ua7cbab\u1c89", "1\U0001e5f1\U0001e5f2", "\U0002ebf0's",
    # Long whitespace runs (the regex JIT's stack) and words past the word cache's limit.
    "a" + " " * 20000 + "b", "\n" * 5000 + "x", "x" * 3000, "日本" * 1000, " \t" * 3000 + "!",
    "hello_world\u0308", "hello_world\u00b2", "hello_world\u203f", "\u0301hello_world", "hello_world\u200d",
    "é<mask>", "日本hello_world語", "hello_world\u00e9", "\u00a0<mask>\u3000", "[ROLE]\u3000\u00a0x",
]


def random_strings(n, seed):
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " " * 8,
        "\n\t\r", ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`", "éèêëàâäôöûüçñßøå", "日本語中文한국어",
        "😀👍🏽❤️🚀🇩🇪", "\u0301\u0308\u0302", "αβγδΣσςЖжЯя", "▁", "\u00a0\u3000\u2002",
    ]
    words = [w for line in CORPUS for w in line.split()]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.4:
                parts.append(rng.choice(words))
            elif r < 0.5:
                parts.append(rng.choice(["<|begin_of_text|>", "<s>", "</s>", "<|im_end|>",
                                         "<mask>", "hello_world", "[ROLE]", "<|endoftext|>"]))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append(rng.choice(["", " ", "\n"]).join(parts))
    # Random code points from every plane (no surrogates: a Python str with one cannot be
    # UTF-8, and the package refuses it).
    for _ in range(n // 4):
        cps = []
        for _ in range(rng.randint(1, 10)):
            c = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0x7FF),
                            rng.randint(0x800, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
            if 0xD800 <= c <= 0xDFFF:
                c = 0x20
            cps.append(chr(c))
        out.append("".join(cps))
    return out


TEXTS = CORPUS + EDGE + random_strings(300, 7)
TRAIN_TEXT = CORPUS * 3 + [" ".join(CORPUS)]


def byte_level_bpe(split_regex, ignore_merges, normalizer=None, vocab_size=700, specials=()):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    if split_regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(specials))
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    return tok


def make_gpt2():
    tok = byte_level_bpe(None, False, specials=["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_llama3():
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|eot_id|>"]
    tok = byte_level_bpe(LLAMA3_REGEX, True, specials=specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    # Non-special added tokens with the flags HF files carry.
    tok.add_tokens([AddedToken("hello_world", single_word=True),
                    AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False),
                    AddedToken("[ROLE]", rstrip=True, normalized=False)])
    return tok


def make_qwen2():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = byte_level_bpe(QWEN2_REGEX, False, normalizer=normalizers.NFC(), specials=specials)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_style(metaspace):
    """A Llama-2-shaped BPE: `▁` for spaces, byte fallback through <0xNN> tokens that live in
    the model vocabulary (not as added tokens), <unk>/<s>/</s> as special added tokens."""
    sp_norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = sp_norm
    # The alphabet is limited so that rare characters (CJK, emoji) need the byte fallback.
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, limit_alphabet=90,
                                  special_tokens=["<unk>"])
    base.train_from_iterator(TRAIN_TEXT, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
            special_tokens=[("<s>", 1), ("</s>", 2)])
    else:
        tok.normalizer = sp_norm
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])
    return tok


def misc(variant):
    """Components the five shapes above do not use, so a file that uses them is checked too:
    NFKC/NFD, Lowercase, Strip, Digits, Split behaviors (removed, merged, contiguous, inverted),
    continuing_subword_prefix / end_of_word_suffix, unk without fusing, Bert's [CLS] A [SEP]."""
    if variant == 1:
        model = models.BPE(unk_token="[UNK]", continuing_subword_prefix="##", fuse_unk=False)
        norm = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                     normalizers.Strip()])
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split("-", behavior="merged_with_previous"),
        ])
        trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, limit_alphabet=60,
                                      continuing_subword_prefix="##",
                                      special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    else:
        model = models.BPE(unk_token="[UNK]", end_of_word_suffix="</w>", fuse_unk=True)
        norm = normalizers.Sequence([normalizers.NFD(), normalizers.Replace(Regex(r"[0-9]"), "7")])
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{P}+"), behavior="merged_with_next", invert=True),
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.Split(Regex(r"[aeiou]"), behavior="contiguous"),
            # Every letter/number run its own piece, each of which Metaspace marks with a ▁:
            # makes a \p{L} / \p{N} that disagrees with the package's visible in the ids.
            pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+"), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ])
        trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, limit_alphabet=60,
                                      end_of_word_suffix="</w>",
                                      special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    tok = Tokenizer(model)
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    # (Strip with stop > 0 is left out: the package panics on an empty token there.)
    tok.decoder = (decoders.Sequence([decoders.Replace("##", ""), decoders.Fuse(),
                                      decoders.Strip("x", 1, 0)]) if variant == 1 else
                   decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True))
    return tok


FIXTURES = {
    "gpt2": make_gpt2,
    "llama3": make_llama3,
    "qwen2": make_qwen2,
    "llama2": lambda: sentencepiece_style(False),
    "mistral": lambda: sentencepiece_style(True),
    "misc1": lambda: misc(1),
    "misc2": lambda: misc(2),
}


def run_tool(path, lines, *flags):
    inp = "".join(json.dumps(x) + "\n" for x in lines)
    r = subprocess.run([BIN, "tokenize", "--tokenizer", str(path), "--jsonl", *flags],
                       input=inp.encode(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    # split("\n"), not splitlines(): decoded text may hold U+2028, U+0085 and the like.
    out = [json.loads(x) for x in r.stdout.decode().split("\n")[:-1]]
    assert len(out) == len(lines)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    out = {}
    for name, make in FIXTURES.items():
        tok = make()
        path = d / f"{name}.json"
        tok.save(str(path))
        out[name] = (Tokenizer.from_file(str(path)), path)
    return out


def test_fixture_structure(built):
    """The fixtures carry the fields and component layout of the real files."""
    j = {n: json.loads(p.read_text()) for n, (_, p) in built.items()}
    l3 = j["llama3"]
    assert l3["model"]["ignore_merges"] is True and l3["normalizer"] is None
    assert [p["type"] for p in l3["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]
    assert l3["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {"Regex": LLAMA3_REGEX}
    assert l3["pre_tokenizer"]["pretokenizers"][1]["use_regex"] is False
    assert [p["type"] for p in l3["post_processor"]["processors"]] == ["ByteLevel",
                                                                       "TemplateProcessing"]
    assert j["qwen2"]["normalizer"]["type"] == "NFC"
    assert j["gpt2"]["pre_tokenizer"]["type"] == "ByteLevel"
    l2 = j["llama2"]
    assert l2["model"]["byte_fallback"] is True and l2["model"]["fuse_unk"] is True
    assert l2["model"]["vocab"]["<0x00>"] == 3 and l2["model"]["vocab"]["<0xFF>"] == 258
    assert [n["type"] for n in l2["normalizer"]["normalizers"]] == ["Prepend", "Replace"]
    assert [d["type"] for d in l2["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse",
                                                              "Strip"]
    assert l2["pre_tokenizer"] is None
    assert j["mistral"]["pre_tokenizer"]["prepend_scheme"] == "first"
    # Merges as the package writes them now ([a, b] pairs); the "a b" form is tested below.
    assert isinstance(l3["model"]["merges"][0], list)


def decode_cases(tok, name):
    rng = random.Random(11)
    seqs = [tok.encode(t).ids for t in TEXTS]
    n = tok.get_vocab_size(with_added_tokens=True)
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    byte_ids = [i for i in byte_ids if i is not None]
    for _ in range(150):
        # Random ids, and for byte-fallback vocabularies runs of byte tokens that are rarely
        # valid UTF-8; ids past the vocabulary are dropped by the package.
        s = [rng.randrange(n + 3) for _ in range(rng.randint(0, 12))]
        if byte_ids:
            s += [rng.choice(byte_ids) for _ in range(rng.randint(0, 6))]
            rng.shuffle(s)
        seqs.append(s)
    seqs.append([])
    return seqs


@pytest.mark.parametrize("name", list(FIXTURES))
def test_identical(built, name):
    """encode with and without special tokens, decode with and without skipping them: one
    process answers the whole batch."""
    tok, path = built[name]
    seqs = decode_cases(tok, name)
    requests, want = [], []
    for special in (True, False):
        for t in TEXTS:
            requests.append({"text": t, "special": special})
            want.append(tok.encode(t, add_special_tokens=special).ids)
    for skip in (False, True):
        for ids in seqs:
            requests.append({"ids": ids, "skip_special": skip})
            want.append(tok.decode(ids, skip_special_tokens=skip))
    got = run_tool(path, requests)
    for req, g, w in zip(requests, got, want):
        assert g == w, f"{name}: {req!r}"
    if name in ("gpt2", "llama3"):
        # Byte-level tokenizers are lossless: decode(encode(s)) == s, apart from the spaces
        # that lstrip/rstrip added tokens swallow by design.
        for t in TEXTS:
            if "<mask>" not in t and "[ROLE]" not in t:
                ids = tok.encode(t, add_special_tokens=False).ids
                assert tok.decode(ids, skip_special_tokens=False) == t
    if name != "gpt2":
        return
    # The flag-driven forms of --jsonl (strings to encode, arrays to decode) on a few lines.
    assert run_tool(path, TEXTS[:20], "--no_special") == [
        tok.encode(t, add_special_tokens=False).ids for t in TEXTS[:20]]
    assert run_tool(path, seqs[:20], "--decode") == [
        tok.decode(s, skip_special_tokens=False) for s in seqs[:20]]


def test_string_merges_and_plain_lines(built, tmp_path):
    """Merges written as "a b" strings (older files) give the same ids; plain (non-JSON) lines."""
    tok, path = built["gpt2"]
    j = json.loads(path.read_text())
    j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
    p2 = tmp_path / "gpt2_str_merges.json"
    p2.write_text(json.dumps(j))
    texts = [t for t in TEXTS if "\n" not in t and "\r" not in t and "\x85" not in t
             and "\u2028" not in t and "\u2029" not in t]
    r = subprocess.run([BIN, "tokenize", "--tokenizer", str(p2)],
                       input="".join(t + "\n" for t in texts).encode(), capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    got = r.stdout.decode().split("\n")[:-1]
    assert got == [" ".join(map(str, tok.encode(t).ids)) for t in texts]


def test_bad_files(tmp_path):
    """A malformed file is a named error and a non-zero exit (the field-by-field cases are
    test_tokenizer.cpp's)."""
    p = tmp_path / "notjson.json"
    p.write_text("{not json")
    r = subprocess.run([BIN, "tokenize", "--tokenizer", str(p)], input=b"hello\n",
                       capture_output=True)
    assert r.returncode != 0 and "notjson.json" in r.stderr.decode()
    p = tmp_path / "unigram.json"
    p.write_text(json.dumps({"model": {"type": "Unigram", "vocab": []}}))
    r = subprocess.run([BIN, "tokenize", "--tokenizer", str(p)], input=b"hello\n",
                       capture_output=True)
    err = r.stderr.decode()
    assert r.returncode != 0 and "unigram.json" in err and "model.type" in err and "Unigram" in err


def test_invalid_utf8_refused(built):
    """Bytes that are not UTF-8 cannot reach `tokenizers` (a Python str is Unicode); the C++
    tokenizer refuses them with the offset rather than guessing."""
    _, path = built["gpt2"]
    r = subprocess.run([BIN, "tokenize", "--tokenizer", str(path)], input=b"ok\xff\xfe\n",
                       capture_output=True)
    err = r.stderr.decode()
    assert r.returncode != 0 and "UTF-8" in err and "stdin line 1" in err and "offset 2" in err
