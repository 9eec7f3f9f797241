// `colossal prepare`: text in, token file out. Documents (each plain-text file whole, each JSONL
// record's field) are encoded on every core and written in input order as one llm.c token file
// (uint16 when the vocabulary fits, else uint32; TokenFile reads it) plus a document index
// (where each document's tokens start), both written atomically.
//
// Document index "<out>.docs": 256 little-endian int32 (magic 20241204, version 1, then the
// document count as two int32 halves, low first), then count + 1 little-endian uint64 token
// offsets: document d is tokens [offset[d], offset[d+1]).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "colossal/data/token_file.h"

namespace colossal::app {

constexpr int32_t kDocIndexMagic = 20241204;

// What prepare needs of a tokenizer: thread-safe encoding of one document's text (no special
// tokens), the vocabulary size, and the ids framing each document.
struct TextEncoder {
  std::string name;  // for messages: the tokenizer file
  std::function<std::vector<int32_t>(std::string_view)> encode;
  int64_t vocab_size = 0;
  std::optional<int32_t> bos_id, eos_id;
};

struct PrepareOptions {
  std::vector<std::string> inputs;   // files or folders (walked recursively, in name order)
  std::string output;                // the token file; the index is output + ".docs"
  std::string jsonl_field = "text";  // files named *.jsonl: one document per line, this field
  std::string dtype = "auto";        // auto | u16 | u32
  int threads = 0;                   // 0: every core
  bool add_bos = true;               // the tokenizer's BOS before each document
  bool add_eos = false;              // and its EOS after
  bool progress = false;             // a progress line on stderr
};

struct PrepareResult {
  int64_t files = 0, documents = 0, tokens = 0, bytes = 0;
  data::TokenFormat format = data::TokenFormat::Auto;
  double seconds = 0;
};

// InputError naming the file (and line, for JSONL) for: no input files, unreadable files,
// invalid UTF-8 (with its byte offset), JSONL lines that are not JSON objects or lack the
// field, a vocabulary that cannot be stored in the requested dtype, more tokens than the
// format's 32-bit count holds. Nothing is written unless everything succeeds.
PrepareResult prepare(const TextEncoder& encoder, const PrepareOptions& options);

// The document index written next to a token file (`path` is the index file itself).
std::vector<uint64_t> read_doc_index(const std::string& path);

}  // namespace colossal::app
