#!/usr/bin/env python3
"""`colossal prepare` against Hugging Face `tokenizers`' encode_batch, side by side in one run.

The corpus is this Python's standard library source (every .py file is one document, as a JSONL
record), up to --mb megabytes; the tokenizer is a byte-level BPE with Llama-3's split regex and
--vocab ids, trained here by `tokenizers` on the first part of the corpus. For each thread count:
our whole `prepare` (reading the JSONL, encoding, writing the token file and index) against
`encode_batch` alone (RAYON_NUM_THREADS threads, the texts already in memory), median of
--repeat runs; the ids must be identical.

  python bench/prepare.py --colossal build/colossal --threads 1,2 [--mb 32] [--json out.json]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

PY_SIDE = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
t0 = time.perf_counter()
enc = tok.encode_batch(texts, add_special_tokens=False)
dt = time.perf_counter() - t0
ids = [i for e in enc for i in e.ids]
with open(sys.argv[3], "wb") as f:
    f.write(bytes(json.dumps({"seconds": dt, "tokens": len(ids)}), "utf-8"))
import numpy as np
np.asarray(ids, dtype=np.uint32).tofile(sys.argv[3] + ".ids")
"""


def corpus(path, mb):
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    total = 0
    n = 0
    with open(path, "w", encoding="utf-8") as out:
        for f in files:
            try:
                text = open(f, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            total += len(text.encode("utf-8"))
            n += 1
            if total >= mb * 1e6:
                break
    return n, total


def train_tokenizer(jsonl, path, vocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(l)["text"] for _, l in zip(range(400), open(jsonl, encoding="utf-8"))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--colossal", default="build/colossal")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--mb", type=float, default=32)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_prepare_")
    jsonl = os.path.join(work, "corpus.jsonl")
    ndocs, nbytes = corpus(jsonl, a.mb)
    tok = os.path.join(work, "tokenizer.json")
    train_tokenizer(jsonl, tok, a.vocab)
    print(f"corpus: {ndocs} documents, {nbytes / 1e6:.1f} MB (Python {sys.version.split()[0]} standard library); "
          f"tokenizer: byte-level BPE, Llama-3 split, {a.vocab} ids", flush=True)
    rows = []
    for threads in [int(t) for t in a.threads.split(",")]:
        ours, theirs = [], []
        for _ in range(a.repeat):
            out = os.path.join(work, "out.bin")
            t0 = time.perf_counter()
            r = subprocess.run([a.colossal, "prepare", "--tokenizer", tok, "--out", out, "--threads",
                                str(threads), jsonl], capture_output=True, text=True)
            ours.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
            res = os.path.join(work, "py.json")
            env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
            p = subprocess.run([sys.executable, "-c", PY_SIDE, tok, jsonl, res], env=env,
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stderr
            theirs.append(json.load(open(res))["seconds"])
        mine = np.fromfile(out, dtype=np.uint16 if a.vocab <= 65536 else np.uint32, offset=1024)
        ref = np.fromfile(res + ".ids", dtype=np.uint32)
        assert np.array_equal(mine.astype(np.uint32), ref), "token ids differ from tokenizers'"
        n = len(ref)
        row = {"threads": threads, "tokens": n, "ours_s": statistics.median(ours),
               "tokenizers_s": statistics.median(theirs)}
        row["ours_tok_s"] = n / row["ours_s"]
        row["tokenizers_tok_s"] = n / row["tokenizers_s"]
        row["ratio"] = row["ours_tok_s"] / row["tokenizers_tok_s"]
        rows.append(row)
        print(f"threads {threads:3d}: {n} tokens (identical); colossal prepare {row['ours_tok_s']:,.0f} tok/s "
              f"(whole command, {row['ours_s']:.2f} s) vs tokenizers encode_batch {row['tokenizers_tok_s']:,.0f} "
              f"tok/s (encoding only, {row['tokenizers_s']:.2f} s): {row['ratio']:.2f}x", flush=True)
    if a.json:
        json.dump({"documents": ndocs, "bytes": nbytes, "vocab": a.vocab, "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
