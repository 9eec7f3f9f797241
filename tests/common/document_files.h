// Writers of the document index (<data>.docs) and loss mask (<data>.mask) files in the layout
// data/documents.h reads (a 256 x int32 header: magic, version 1, the count as two halves, the
// packed seq_len; then the body), for tests that need such files, well formed or not.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "colossal/data/documents.h"

namespace colossal::tests {

inline std::vector<int32_t> document_file_header(int32_t magic, uint64_t count,
                                                 int32_t packed_seq_len = 0) {
  std::vector<int32_t> h(256, 0);
  h[0] = magic;
  h[1] = 1;
  h[2] = static_cast<int32_t>(count & 0xFFFFFFFFu);
  h[3] = static_cast<int32_t>(count >> 32);
  h[4] = packed_seq_len;
  return h;
}

// `header` (any length: short ones make truncated files) then `bytes` of `body`.
inline void write_document_file(const std::string& path, const std::vector<int32_t>& header,
                                const void* body, size_t bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(header.data()),
          static_cast<std::streamsize>(header.size() * 4));
  if (bytes > 0) f.write(static_cast<const char*>(body), static_cast<std::streamsize>(bytes));
}

inline void write_doc_index(const std::string& path, const std::vector<uint64_t>& offsets) {
  write_document_file(path, document_file_header(data::kDocIndexMagic, offsets.size() - 1),
                      offsets.data(), offsets.size() * 8);
}

inline void write_loss_mask(const std::string& path, const std::vector<uint8_t>& mask,
                            int32_t packed_seq_len = 0) {
  write_document_file(path, document_file_header(data::kLossMaskMagic, mask.size(), packed_seq_len),
                      mask.data(), mask.size());
}

}  // namespace colossal::tests
