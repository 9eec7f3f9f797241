// Token files, memory-mapped, and the fixed-length samples cut from them.
//
// Formats:
//  - llm.c headered .bin: 256 little-endian int32 header (magic, version, token count), then
//    the tokens: magic 20240520 / version 1 = uint16 (GPT-2), magic 20240801 / version 7 =
//    uint32 (Llama 3), as llm.c's dev/data/data_common.py writes them. The token count and the
//    file size must agree exactly.
//  - raw little-endian arrays (nanoGPT's train.bin): uint16 or uint32 with no header.
// Which one: TokenFormat::Auto reads the first 4 bytes: an llm.c magic means headered;
// otherwise the suffix decides: ".u32" or ".uint32" anywhere before the extension or as the
// extension (e.g. "train.u32.bin") = raw uint32, anything else = raw uint16 (nanoGPT's
// default). Pass RawU16/RawU32 to force a raw dtype.
// Sample k = tokens[k*S, k*S+S+1): inputs the first S, targets the last S (shifted by one).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace colossal::data {

enum class TokenFormat { Auto, RawU16, RawU32, LlmcGpt2, LlmcLlama3 };
const char* to_string(TokenFormat f);
TokenFormat token_format_from_string(const std::string& s);  // auto|u16|u32|llmc|llmc-llama3

constexpr int32_t kLlmcMagicGpt2 = 20240520;
constexpr int32_t kLlmcMagicLlama3 = 20240801;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

class TokenFile {
 public:
  // Opens and validates; corrupt or inconsistent files are InputErrors naming the path.
  explicit TokenFile(const std::string& path, TokenFormat format = TokenFormat::Auto);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }  // resolved (never Auto)
  int64_t size() const { return ntokens_; }
  int bytes_per_token() const { return width_; }
  int64_t token(int64_t i) const;
  // The first position whose token is >= `limit` (a vocabulary size), or -1 when none is: one
  // pass over the mapped file (GB/s), so a bad id is named at load with its position rather
  // than when its batch comes up hours into a run.
  int64_t first_at_or_above(int64_t limit) const;
  // tokens[start, start+len) as an int64 CPU tensor (a copy).
  at::Tensor slice(int64_t start, int64_t len) const;

 private:
  std::string path_;
  TokenFormat format_;
  int width_ = 2;
  int64_t ntokens_ = 0;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* data_ = nullptr;
};

// Writes tokens in a concrete format (not Auto); values
// must fit the token width. Written to "<path>.tmp" then renamed.
void write_token_file(const std::string& path, const std::vector<int64_t>& tokens,
                      TokenFormat format);

class LossMaskFile;

// A batch of samples: inputs and targets int64 [n, S]; with documents, position_ids (restarting
// at 0 where each document starts inside the sample) and document_ids (0, 1, ... per row) too.
struct Batch {
  at::Tensor inputs, targets, position_ids, document_ids;
};

// Fixed-length samples over one token file, optionally with what `colossal prepare` writes next
// to it (documents.h): a loss mask (targets whose mask byte is 0 become ignore_index -100) and
// the document index, whose documents keep to themselves under set_document_mask(true): the
// positions restart at each document, attention stays inside it (Batch::document_ids), and the
// target that would predict a document's first token from the previous document is -100.
class TokenDataset {
 public:
  static constexpr int64_t kIgnore = -100;
  TokenDataset(std::shared_ptr<TokenFile> file, int64_t seq_len);
  int64_t seq_len() const { return seq_len_; }
  int64_t num_samples() const { return num_samples_; }  // floor((tokens - 1) / S)
  // {inputs, targets}, each int64 [S].
  std::pair<at::Tensor, at::Tensor> sample(int64_t k) const;
  // Stacked samples: {inputs, targets}, each int64 [n, S].
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices) const;
  // The same with the document fields (defined under the document mask).
  Batch make_batch(const std::vector<int64_t>& indices) const;
  const TokenFile& file() const { return *file_; }

  // The loss mask: InputError when it does not cover the token file exactly, or was packed for
  // another sequence length.
  void set_loss_mask(std::shared_ptr<LossMaskFile> mask);
  // The document offsets (read_doc_index): InputError unless they end at the token count.
  void set_documents(std::vector<uint64_t> offsets, std::string source);
  // Keep attention and positions inside documents (needs set_documents).
  void set_document_mask(bool on);
  bool masks_targets() const { return mask_ != nullptr || doc_mask_; }
  bool document_mask() const { return doc_mask_; }
  const LossMaskFile* loss_mask() const { return mask_.get(); }
  // Targets of sample k that count (not -100), without building it.
  int64_t counted_targets(int64_t k) const;

 private:
  // Whether token t (0 < t) starts a document.
  bool starts_document(int64_t t) const;
  std::shared_ptr<TokenFile> file_;
  int64_t seq_len_;
  int64_t num_samples_;
  std::shared_ptr<LossMaskFile> mask_;
  std::vector<uint64_t> docs_;
  bool doc_mask_ = false;
};

}  // namespace colossal::data
