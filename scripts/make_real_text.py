#!/usr/bin/env python3
"""Real text for the FP8-vs-bf16 loss comparison (issue 20): the Python standard library's source
(/usr/lib/python3.11 of this Debian machine, the *.py files that are valid UTF-8, in sorted order,
up to --max_mb), a byte-level BPE tokenizer trained on it with the
`tokenizers` package (vocabulary --vocab, deterministic), and the token file written by
`colossal prepare` with an EOS after each file. Output under .carry/fp8text/ (git-ignored; carried
to the device in `carry`): text/, tokenizer.json, stdlib.bin (+ .docs), model.json (a ~100M-parameter
Llama with this vocabulary).

usage: scripts/make_real_text.py [--src /usr/lib/python3.11] [--max_mb 24] [--vocab 16384]
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--src", default="/usr/lib/python3.11")
ap.add_argument("--out", default=".carry/fp8text")
ap.add_argument("--max_mb", type=float, default=24)
ap.add_argument("--vocab", type=int, default=16384)
ap.add_argument("--colossal", default="build/colossal")
a = ap.parse_args()

out = pathlib.Path(a.out)
if out.exists():
    shutil.rmtree(out)
(out / "text").mkdir(parents=True)
total, files = 0, []
for p in sorted(pathlib.Path(a.src).rglob("*.py")):
    rel = p.relative_to(a.src)
    if any(part in ("site-packages", "dist-packages") for part in rel.parts):
        continue
    try:
        text = p.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        continue
    if not text.strip():
        continue
    name = out / "text" / (str(rel).replace(os.sep, "__"))
    name.write_text(text, encoding="utf-8")
    files.append(str(name))
    total += len(text.encode("utf-8"))
    if total >= a.max_mb * 2**20:
        break
print(f"{len(files)} files, {total / 2**20:.1f} MiB of text", file=sys.stderr)

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train(files, trainer)
# EOS as the post-processor's template names it (how `colossal prepare --eos` finds it).
tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
tok.save(str(out / "tokenizer.json"))
subprocess.run([a.colossal, "prepare", "--tokenizer", str(out), "--out", str(out / "stdlib.bin"),
                "--no_bos", "--eos", str(out / "text")], check=True)
shutil.rmtree(out / "text")
(out / "model.json").write_text(json.dumps({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": tok.get_vocab_size(),
    "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_key_value_heads": 12, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "initializer_range": 0.02, "tie_word_embeddings": False, "hidden_act": "silu"}, indent=1))
print(f"wrote {out}/stdlib.bin, tokenizer.json, model.json", file=sys.stderr)
