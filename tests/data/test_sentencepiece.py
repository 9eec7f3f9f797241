"""SentencePiece .model files (colossal::data::SentencePieceTokenizer, through libsentencepiece)
against the `sentencepiece` Python package, pinned to the GPU machine's version: models trained
here on a multilingual corpus (BPE with byte fallback, unigram with unknown characters, and a
lossless Llama-2-style BPE), ids of every string equal, with and without BOS/EOS, and decoding of
those ids and of random id lists equal. Bad models and ids are named errors.
"""
import inspect
import json
import os
import random
import subprocess

import pytest
import sentencepiece as spm

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
TOOL = os.path.join(BUILD, "tests", "data", "sp_tool")

TEXT = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
Größe, Straße, façade, naïve café, résumé, coöperate, Ångström, São Paulo, Kraków, İstanbul.
Съешь же ещё этих мягких французских булок, да выпей чаю. Καλημέρα κόσμε, τι κάνεις;
東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. 日本語のテキストを書く。
مرحبا بالعالم، كيف حالك؟ שלום עולם. नमस्ते दुनिया, आप कैसे हैं? สวัสดีชาวโลก
Emoji 😀🎉👩‍💻🚀 and flags 🇫🇷🇯🇵; combining: e\u0301 a\u0308 n\u0303; math: ∑∫√∞≠≤ ½ ¾ ①②.
Numbers 0123456789 3.14159 1,000,000 2026-12-04 12:34:56 #42 $19.99 50% 1e-6 0x1F.
def main(argv):\n    for i in range(10):\n\tprint(f"{i:>4}")  # tabs\tand  double  spaces
"""


def corpus():
    lines = TEXT.splitlines()
    # Enough text for a few hundred pieces: the standard library's own source.
    for mod in (json, random, inspect):
        lines += [l for l in inspect.getsource(mod).splitlines() if l.strip()][:1500]
    return lines


MODELS = {
    "bpe_byte_fallback": dict(model_type="bpe", vocab_size=600, byte_fallback=True),
    "unigram_unk": dict(model_type="unigram", vocab_size=600, character_coverage=0.995),
    "llama2_style": dict(model_type="bpe", vocab_size=600, byte_fallback=True,
                         normalization_rule_name="identity", remove_extra_whitespaces=False,
                         add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    prefix = str(d / "m")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_prefix=prefix,
                                   num_threads=1, minloglevel=2, **MODELS[request.param])
    return request.param, prefix + ".model"


def strings():
    fixed = ["", " ", "   ", "\n", "\n\n\n", "\t", "a", " a", "a ", "  leading and trailing  ",
             "Hello, world!", "hello world", "HELLO WORLD", "don't stop", "1234567890",
             "naïve café", "東京", "😀", "👩‍💻", "e\u0301", "\u00e9", "ﬁ ligature", "ｆｕｌｌ ｗｉｄｔｈ",
             "x" * 500, "ab " * 100, "unseen: ꙮ ᚠᛇᚻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀"] + TEXT.splitlines()
    pool = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 .,;:!?'\"-_()[]{}") +
            list("  \t\n") + list("éèêëàâäöüßçñøåæœ") + list("日本語中文한국어") +
            ["😀", "🎉", "\u0301", "\u0308", "ꙮ", "ᚠ", "𝔘"])
    rng = random.Random(1234)
    fuzz = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    return fixed + fuzz


def tool(*args, stdin=None):
    r = subprocess.run([TOOL, *map(str, args)], input=stdin, capture_output=True, text=True,
                       timeout=120)
    return r


def run_json(*args, data):
    r = tool(*args, stdin=json.dumps(data))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_encode_equals_python(model):
    name, path = model
    sp = spm.SentencePieceProcessor(model_file=path)
    ss = strings()
    assert run_json("encode", path, data=ss) == [sp.encode(s) for s in ss], name
    assert run_json("encode", path, "bos", data=ss) == [sp.encode(s, add_bos=True) for s in ss]
    assert run_json("encode", path, "bos", "eos", data=ss) == [
        sp.encode(s, add_bos=True, add_eos=True) for s in ss]
    if name == "unigram_unk":  # characters outside the coverage really are unknown here
        assert any(sp.unk_id() in ids for ids in (sp.encode(s) for s in ss))
    if name == "bpe_byte_fallback":  # and byte pieces really are used there
        assert any(sp.id_to_piece(i).startswith("<0x") for s in ss for i in sp.encode(s))


def test_decode_equals_python(model):
    name, path = model
    sp = spm.SentencePieceProcessor(model_file=path)
    ss = strings()
    ids = [sp.encode(s, add_bos=True, add_eos=True) for s in ss]
    rng = random.Random(99)
    ids += [[rng.randrange(sp.get_piece_size()) for _ in range(rng.randint(0, 40))] for _ in range(200)]
    assert run_json("decode", path, data=ids) == [sp.decode(i) for i in ids], name
    if name == "llama2_style":  # lossless: the text comes back exactly
        back = run_json("decode", path, data=[sp.encode(s) for s in ss])
        assert back == ss


def test_info(model):
    name, path = model
    sp = spm.SentencePieceProcessor(model_file=path)
    info = run_json("info", path, data=None)
    assert info["vocab_size"] == sp.get_piece_size()
    assert (info["bos"], info["eos"], info["unk"]) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    assert info["piece_0"] == sp.id_to_piece(0)
    assert info["known"] == sp.get_piece_size() - 1 and info["unknown"] == -1


def test_bad_input(model, tmp_path):
    name, path = model
    r = tool("info", tmp_path / "missing.model")
    assert r.returncode == 2 and "missing.model" in r.stderr
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    r = tool("info", bad)
    assert r.returncode == 2 and "bad.model" in r.stderr and "cannot be loaded" in r.stderr
    sp = spm.SentencePieceProcessor(model_file=path)
    n = sp.get_piece_size()
    r = tool("decode", path, stdin=json.dumps([[1, n]]))
    assert r.returncode == 2 and f"token id {n}" in r.stderr
    r = tool("decode", path, stdin=json.dumps([[-1]]))
    assert r.returncode == 2 and "token id -1" in r.stderr
