// Hugging Face `tokenizer.json` tokenizers (BPE), encoding and decoding exactly as the Python
// `tokenizers` package does: the byte-level BPE of GPT-2 / Llama-3 / Qwen2 (regex split,
// byte-to-unicode alphabet, `ignore_merges`) and the SentencePiece-style BPE of Llama-2 /
// Mistral (`▁` via normalizer or Metaspace, `byte_fallback` to `<0xNN>` tokens), with added
// and special tokens, normalizers, post-processors (BOS/EOS templates) and decoders.
//
// The pipeline is the package's: added tokens are split out first (non-normalized ones on the
// raw text, then the rest normalized and normalized added tokens split out), the pre-tokenizer
// cuts the pieces into words, the BPE model turns each word into ids, the post-processor adds
// the template's special tokens. A component type the file names that this code does not
// implement is an InputError naming the type and the file, never skipped.
//
// Input text must be valid UTF-8 (a Python `str` is; bytes that are not UTF-8 cannot reach
// `tokenizers`): encode() refuses anything else with an InputError naming the byte offset.
//
// Thread safety: every method is const and may be called concurrently; the word cache is
// sharded behind mutexes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace colossal::data {

class Tokenizer {
 public:
  // Reads a tokenizer.json; any problem (not JSON, no or unknown model, a merge naming a token
  // outside the vocabulary, ids out of range, an unknown component type) is an InputError
  // naming `path` and the field.
  static Tokenizer from_file(const std::string& path);
  // The same from the file's text; `source` names it in errors.
  static Tokenizer from_json(std::string_view json_text, const std::string& source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // tokenizers' `encode(text, add_special_tokens=...).ids`.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // encode(text, false) and where each id came from: `offsets[i]` is the byte span [first,
  // second) of `text` that id i stands for (tokenizers' offsets, in bytes). Exact wherever the
  // tokens' bytes spell the text (byte-level BPE without a normalizer, or one that leaves the text
  // as it is, e.g. NFC on NFC text; added tokens always); where a normalizer changed a stretch of
  // text, spans outside the changed bytes stay exact and a span inside them widens to all of them.
  // A prefix space the pre-tokenizer adds belongs to the first token, as in tokenizers.
  std::vector<int32_t> encode_with_offsets(std::string_view text,
                                           std::vector<std::pair<size_t, size_t>>& offsets) const;
  // tokenizers' `decode(ids, skip_special_tokens=...)`: ids the tokenizer does not know are
  // dropped, as the package does.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // One more than the largest id of the model's vocabulary and the added tokens: the size an
  // embedding table needs (tokenizers' get_vocab_size(with_added_tokens=True) where ids are
  // dense).
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Empty when the id is unknown.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // The first / last special token the single-sequence template adds, if there is a template.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace colossal::data
