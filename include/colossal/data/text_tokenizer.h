// One face over the two tokenizer file kinds: a Hugging Face tokenizer.json (data::Tokenizer) or
// a SentencePiece .model (data::SentencePieceTokenizer), found by path or in a model folder.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace colossal::data {

struct TextTokenizer {
  std::string path;  // the file loaded
  // With add_special: the file's template (tokenizer.json) or its BOS (a .model, as
  // transformers' LlamaTokenizer adds it). Thread-safe.
  std::function<std::vector<int32_t>(std::string_view text, bool add_special)> encode;
  std::function<std::string(const std::vector<int32_t>& ids, bool skip_special)> decode;
  int64_t vocab_size = 0;
  std::optional<int32_t> bos_id, eos_id;
};

// `path`: a tokenizer.json, a .model file, or a folder holding tokenizer.json (preferred, as
// transformers' fast tokenizers) or tokenizer.model. InputError naming what is missing.
TextTokenizer load_tokenizer(const std::string& path);

// Whether `folder` holds a tokenizer load_tokenizer would find.
bool has_tokenizer(const std::string& folder);

}  // namespace colossal::data
