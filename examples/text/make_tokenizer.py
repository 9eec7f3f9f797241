#!/usr/bin/env python3
"""examples/text, step 1: the corpus (this Python's standard library source, every .py file one
JSONL record) and a byte-level BPE tokenizer trained on it with Hugging Face `tokenizers`
(Llama-3's split regex, <s>/</s>, a "<s> $A" template), both under OUT."""
import glob
import json
import os
import sys
import sysconfig

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = sys.argv[1] if len(sys.argv) > 1 else "out/text"
VOCAB = 4096
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

os.makedirs(os.path.join(OUT, "tokenizer"), exist_ok=True)
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
texts = []
for f in files:
    try:
        texts.append(open(f, encoding="utf-8").read())
    except (UnicodeDecodeError, OSError):
        pass
with open(os.path.join(OUT, "corpus.jsonl"), "w", encoding="utf-8") as out:
    for t in texts:
        out.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
tok = Tokenizer(models.BPE(ignore_merges=True))
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(
    vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
tok.save(os.path.join(OUT, "tokenizer", "tokenizer.json"))
print(f"corpus: {len(texts)} files, {sum(len(t) for t in texts) / 1e6:.1f} M characters -> {OUT}/corpus.jsonl; "
      f"tokenizer: {tok.get_vocab_size()} ids -> {OUT}/tokenizer/tokenizer.json")
