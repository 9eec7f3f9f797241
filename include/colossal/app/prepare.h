// `colossal prepare`: text in, token file out. Documents (each plain-text file whole, each JSONL
// record's field) are encoded on every core and written in input order as one llm.c token file
// (uint16 when the vocabulary fits, else uint32; TokenFile reads it) plus a document index
// (where each document's tokens start), both written atomically. The index format and its
// reader are data's (colossal/data/documents.h).
//
// Supervised fine-tuning data (PrepareOptions::sft): each JSONL record is a prompt/response pair
// or a conversation ("messages"), optionally rendered with a chat template (chatml, llama3); the
// loss mask "<out>.mask" (data::LossMaskFile) marks the tokens training predicts (responses,
// assistant turns and their closing token), and records may be packed into bins of a sequence
// length (docs/design.md, "SFT data: templates, masks, packing").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "colossal/data/token_file.h"

namespace colossal::app {

// What prepare needs of a tokenizer: thread-safe encoding of one document's text (no special
// tokens), the vocabulary size, and the ids framing each document.
struct TextEncoder {
  std::string name;  // for messages: the tokenizer file
  std::function<std::vector<int32_t>(std::string_view)> encode;
  int64_t vocab_size = 0;
  std::optional<int32_t> bos_id, eos_id;
  // For chat templates (a tokenizer.json; unset for a SentencePiece model): encode() with each
  // id's byte span in the text (data::Tokenizer::encode_with_offsets), and a token's id.
  std::function<std::vector<int32_t>(std::string_view, std::vector<std::pair<size_t, size_t>>&)>
      encode_with_offsets;
  std::function<std::optional<int32_t>(std::string_view)> token_to_id;
};

// Supervised fine-tuning records (JSONL only), see the header comment.
struct SftOptions {
  bool enabled = false;
  std::string prompt_field = "prompt", response_field = "response", messages_field = "messages";
  std::string chat_template;      // "" (prompt/response only), or a name of chat_template_names()
  int64_t pack = 0;               // sequence length to pack records into bins of; 0: concatenate
  std::optional<int32_t> pad_id;  // padding of packed bins (default: EOS, else the end-of-turn)
  bool truncate = false;          // cut records longer than `pack` (default: an InputError)
};

// The chat templates --chat_template knows.
std::vector<std::string> chat_template_names();

// A conversation rendered with a chat template: the text and the byte spans [first, second) that
// Hugging Face's `{% generation %}` blocks cover (each assistant message's content and its
// closing token). InputError for an unknown template name or role.
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};
RenderedChat render_chat(const std::string& template_name,
                         const std::vector<std::pair<std::string, std::string>>& messages);

struct PrepareOptions {
  std::vector<std::string> inputs;   // files or folders (walked recursively, in name order)
  std::string output;                // the token file; the index is output + ".docs"
  std::string jsonl_field = "text";  // files named *.jsonl: one document per line, this field
  std::string dtype = "auto";        // auto | u16 | u32
  int threads = 0;                   // 0: every core
  bool add_bos = true;               // the tokenizer's BOS before each document
  bool add_eos = false;              // and its EOS after
  bool progress = false;             // a progress line on stderr
  SftOptions sft;                    // add_bos applies to prompt/response records without template
};

struct PrepareResult {
  int64_t files = 0, documents = 0, tokens = 0, bytes = 0;
  data::TokenFormat format = data::TokenFormat::Auto;
  double seconds = 0;
  // SFT: tokens with mask 1, packed bins, padding tokens (the trailing one included),
  // records cut by --truncate, the padding id used (-1: none).
  int64_t masked = 0, bins = 0, padding = 0, truncated = 0;
  int32_t pad_id = -1;
};

// InputError naming the file (and line, for JSONL) for: no input files, unreadable files,
// invalid UTF-8 (with its byte offset), JSONL lines that are not JSON objects or lack the
// field, a vocabulary that cannot be stored in the requested dtype, more tokens than the
// format's 32-bit count holds. Nothing is written unless everything succeeds.
// SFT adds: a non-JSONL input, a record without the fields, a message that is not an object
// with string role and content, an unknown role, a "messages" record without a template, a
// template token the tokenizer lacks, a tokenizer without EOS for prompt/response records, a
// record longer than the packing length without truncate.
PrepareResult prepare(const TextEncoder& encoder, const PrepareOptions& options);

}  // namespace colossal::app
