// What `colossal prepare` writes next to a token file besides the tokens, and what training
// reads of it: the document index (where each document starts) and the loss mask (which
// targets count).
//
// Document index "<tokens>.docs": 256 little-endian int32 (magic 20241204, version 1, then the
// document count as two int32 halves, low first), then count + 1 little-endian uint64 token
// offsets: document d is tokens [offset[d], offset[d+1]); the last offset is the token count.
//
// Loss mask "<tokens>.mask": 256 little-endian int32 (magic 20241205, version 1, the token
// count as two int32 halves, low first, then the sequence length the records were packed for,
// 0 when they were not packed), then one byte per token: 1 when the token counts as a target
// (its prediction from the tokens before it is trained), 0 when it does not (a prompt, a
// template's header, padding). A sample's target j is token k*S + j + 1, so its mask byte is
// that token's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace colossal::data {

constexpr int32_t kDocIndexMagic = 20241204;
constexpr int32_t kLossMaskMagic = 20241205;

// The offsets of a document index file (`path` is the index itself). InputError naming the
// path for a bad magic or version, a size that does not match the count, offsets that decrease
// or do not start at 0.
std::vector<uint64_t> read_doc_index(const std::string& path);

// A loss mask file, memory-mapped. InputError naming the path for a bad header, a size that
// does not match the count, or a byte other than 0 and 1 (checked in one pass at open).
class LossMaskFile {
 public:
  explicit LossMaskFile(const std::string& path);
  ~LossMaskFile();
  LossMaskFile(const LossMaskFile&) = delete;
  LossMaskFile& operator=(const LossMaskFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }
  int64_t packed_seq_len() const { return packed_seq_len_; }  // 0: not packed
  int64_t trained() const { return ones_; }  // tokens whose byte is 1 (counted at open)
  const uint8_t* data() const { return data_; }

 private:
  std::string path_;
  int64_t count_ = 0, packed_seq_len_ = 0, ones_ = 0;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* data_ = nullptr;
};

}  // namespace colossal::data
