// SentencePiece `.model` files (Llama-1/2, Mistral v0.1, T5, Gemma ship them): encoding and
// decoding through the SentencePiece library Debian packages (libsentencepiece-dev), the same
// algorithm the `sentencepiece` Python package runs, so ids equal what
// `SentencePieceProcessor.encode` gives (a test compares on locally trained BPE and unigram
// models). The library stays behind this header: users include no SentencePiece or protobuf
// header.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace colossal::data {

class SentencePieceTokenizer {
 public:
  // Loads a serialized ModelProto. A missing, unreadable or malformed file is an InputError
  // naming the path.
  static SentencePieceTokenizer from_file(const std::string& path);

  // Ids of `text` (UTF-8; invalid bytes are handled as the library does: each becomes U+FFFD
  // before normalization), with the model's BOS / EOS around them when asked for. An
  // InputError when asked for a BOS / EOS the model does not define.
  std::vector<int32_t> encode(std::string_view text, bool add_bos = false,
                              bool add_eos = false) const;
  // Text of `ids` (control pieces such as BOS/EOS produce no text, as in the library); an id
  // outside [0, vocab_size) is an InputError naming it.
  std::string decode(const std::vector<int32_t>& ids) const;

  int64_t vocab_size() const;
  std::optional<int32_t> bos_id() const;  // nullopt where the model has none (id -1)
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  int32_t unk_id() const;
  std::optional<int32_t> piece_to_id(std::string_view piece) const;  // nullopt: not a piece
  std::string id_to_piece(int32_t id) const;
  const std::string& path() const { return path_; }

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
  std::string path_;
};

}  // namespace colossal::data
