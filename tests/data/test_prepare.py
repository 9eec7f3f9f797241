"""`colossal prepare` against the reference tokenization in Python: text files, folders and JSONL
records become documents, in input order (folders in path order, hidden names skipped), each
encoded by the `sentencepiece` package with BOS before it; the token file (read back by numpy and
by our own TokenFile) and the document index must hold exactly those ids and offsets, for one
thread and for several. Bad input is a named error with nothing written.
"""
import json
import os
import subprocess

import numpy as np
import pytest
import sentencepiece as spm

BUILD = os.environ.get("COLOSSAL_BUILD_DIR", "build")
BIN = os.environ.get("COLOSSAL_BIN", os.path.join(BUILD, "colossal"))
DATA_TOOL = os.path.join(BUILD, "tests", "data", "data_tool")

DOCS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nSecond line, café au lait.\n",
    "sub/b.txt": "東京は日本の首都です。 Emoji 😀 and numbers 12345.",
    "sub/deeper/c.txt": "  leading spaces and a tab\there  ",
    "sub/.hidden.txt": "never read",
    ".git/config": "never read either",
    "d.txt": "",
}
RECORDS = [{"text": "first record", "id": 1}, {"text": "second record: Größe"},
           {"text": "third\nwith a newline"}]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    lines = [l for text in list(DOCS.values()) * 20 for l in text.splitlines()] + [
        "a corpus line number %d with some words in it" % i for i in range(2000)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(d / "m"),
                                   vocab_size=600, model_type="bpe", byte_fallback=True,
                                   minloglevel=2, num_threads=1)
    return str(d / "m.model")


@pytest.fixture()
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    recs = tmp_path / "recs.jsonl"
    recs.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS) + "\n\n",
                    encoding="utf-8")
    return root, recs


def prepare(*args):
    return subprocess.run([BIN, "prepare", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def read_tokens(path):
    raw = np.fromfile(path, dtype=np.int32, count=256)
    assert raw[0] in (20240520, 20240801), raw[:3]
    dtype = np.uint16 if raw[0] == 20240520 else np.uint32
    toks = np.fromfile(path, dtype=dtype, offset=1024)
    assert len(toks) == raw[2]
    return toks.tolist()


def read_index(path):
    h = np.fromfile(path, dtype=np.int32, count=256)
    assert h[0] == 20241204 and h[1] == 1
    n = int(h[2]) | (int(h[3]) << 32)
    off = np.fromfile(path, dtype=np.uint64, offset=1024)
    assert len(off) == n + 1
    return off.tolist()


def expected_docs(root, recs):
    order = ["a.txt", "d.txt", "sub/b.txt", "sub/deeper/c.txt"]  # path order, hidden skipped
    return [DOCS[n] for n in order] + [r["text"] for r in RECORDS]


@pytest.mark.parametrize("threads", [1, 3])
def test_prepare_equals_python(sp_model, corpus, tmp_path, threads):
    root, recs = corpus
    out = tmp_path / "out" / "train.bin"
    r = prepare("--tokenizer", sp_model, "--out", out, "--threads", threads, root, recs)
    assert r.returncode == 0, r.stderr
    assert "7 documents from 5 files" in r.stderr, r.stderr
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    docs = [[sp.bos_id()] + sp.encode(t) for t in expected_docs(root, recs)]
    toks = read_tokens(out)
    assert toks == [t for d in docs for t in d]
    offs = read_index(str(out) + ".docs")
    assert offs == list(np.cumsum([0] + [len(d) for d in docs]))
    # Our own reader takes it (the same class `colossal train` uses).
    dump = subprocess.run([DATA_TOOL, "dump", str(out)], capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr
    assert json.loads(dump.stdout)["tokens"] == toks


def test_prepare_eos_no_bos_and_field(sp_model, tmp_path):
    recs = tmp_path / "r.jsonl"
    recs.write_text('{"content": "alpha beta"}\n{"content": "gamma"}\n')
    out = tmp_path / "o.bin"
    r = prepare("--tokenizer", sp_model, "--out", out, "--no_bos", "--eos", "--jsonl_field",
                "content", recs)
    assert r.returncode == 0, r.stderr
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    assert read_tokens(out) == sp.encode("alpha beta") + [sp.eos_id()] + sp.encode("gamma") + [sp.eos_id()]


def test_prepare_bad_input(sp_model, tmp_path):
    out = tmp_path / "o.bin"
    out.write_bytes(b"previous output")  # an error never touches it

    def fails(needle, *args):
        r = prepare("--tokenizer", sp_model, "--out", out, *args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
        assert out.read_bytes() == b"previous output"
        assert not os.path.exists(str(out) + ".docs")
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    fails(f"{bad}:2 is not valid JSON", bad)
    bad.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    fails(f'{bad}:3 has no field "text"', bad)
    bad.write_text('["not", "an object"]\n')
    fails(f"{bad}:1 is not a JSON object", bad)
    bad.write_text('{"text": 42}\n')
    fails('field "text" is not a string', bad)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    fails(f"{latin}: invalid UTF-8 at byte 3", latin)
    fails("does not exist", tmp_path / "missing.txt")
    empty = tmp_path / "emptydir"
    empty.mkdir()
    fails("hold no files", empty)
    fails("--dtype must be auto, u16 or u32", "--dtype", "u8", latin)
    r = prepare("--tokenizer", tmp_path / "tok.json", "--out", out, latin)
    assert r.returncode == 2 and "tok.json" in r.stderr


def test_prepare_tokenizer_json(corpus, tmp_path):
    """A Hugging Face tokenizer.json (byte-level BPE with a BOS template, trained here): each
    document is what `tokenizers` encodes with its special tokens; a folder holding the file
    works too. Without a BOS in the template, documents get none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    root, recs = corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(DOCS.values()) * 10 + [r["text"] for r in RECORDS], trainer)
    plain = tmp_path / "plain.json"
    tok.save(str(plain))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    docs = expected_docs(root, recs)
    out = tmp_path / "hf.bin"
    r = prepare("--tokenizer", folder, "--out", out, root, recs)
    assert r.returncode == 0, r.stderr
    assert read_tokens(out) == [t for d in docs for t in tok.encode(d).ids]
    r = prepare("--tokenizer", plain, "--out", out, root, recs)
    assert r.returncode == 0 and "has no BOS" in r.stderr, r.stderr
    assert read_tokens(out) == [t for d in docs for t in Tokenizer.from_file(str(plain)).encode(d).ids]
    assert read_index(str(out) + ".docs")[-1] == len(read_tokens(out))


def test_prepare_u16_overflow(tmp_path):
    # A vocabulary past 65536 ids: auto picks uint32, u16 is refused before anything is written.
    d = tmp_path / "big"
    syms = ["sym%05d" % i for i in range(66000)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["hello world %d" % i for i in range(500)]),
                                   model_prefix=str(d), vocab_size=66100, model_type="bpe",
                                   user_defined_symbols=syms, minloglevel=2, num_threads=1,
                                   hard_vocab_limit=False)
    txt = tmp_path / "t.txt"
    txt.write_text("sym65999 hello world")
    out = tmp_path / "o.bin"
    r = prepare("--tokenizer", f"{d}.model", "--out", out, "--dtype", "u16", txt)
    assert r.returncode == 2 and "u16 cannot hold the 66100 ids" in r.stderr and not out.exists()
    r = prepare("--tokenizer", f"{d}.model", "--out", out, txt)
    assert r.returncode == 0, r.stderr
    sp = spm.SentencePieceProcessor(model_file=f"{d}.model")
    assert np.fromfile(out, dtype=np.int32, count=1)[0] == 20240801
    assert read_tokens(out) == [sp.bos_id()] + sp.encode("sym65999 hello world")
