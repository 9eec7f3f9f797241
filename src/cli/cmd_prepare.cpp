// `colossal prepare`: text files, folders and JSONL into a token file plus document index for
// `colossal train` (see colossal/app/prepare.h).
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/app/prepare.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/data/text_tokenizer.h"
#include "colossal/data/tokenizer.h"

namespace {

// The tokenizer named by --tokenizer (a file or a folder holding one); documents are encoded
// without special tokens, prepare frames them.
// A tokenizer.json also gives byte offsets and token ids, which chat templates need.
colossal::app::TextEncoder load_encoder(const std::string& arg) {
  auto t = std::make_shared<colossal::data::TextTokenizer>(colossal::data::load_tokenizer(arg));
  colossal::app::TextEncoder e;
  e.name = t->path;
  e.encode = [t](std::string_view text) { return t->encode(text, /*add_special=*/false); };
  e.vocab_size = t->vocab_size;
  e.bos_id = t->bos_id;
  e.eos_id = t->eos_id;
  if (t->path.size() >= 5 && t->path.compare(t->path.size() - 5, 5, ".json") == 0) {
    auto hf =
        std::make_shared<colossal::data::Tokenizer>(colossal::data::Tokenizer::from_file(t->path));
    e.encode_with_offsets = [hf](std::string_view text,
                                 std::vector<std::pair<size_t, size_t>>& offsets) {
      return hf->encode_with_offsets(text, offsets);
    };
    e.token_to_id = [hf](std::string_view token) { return hf->token_to_id(token); };
  }
  return e;
}

int run_prepare(int argc, char** argv) {
  colossal::cli::Args args("prepare", "tokenize text into a token file for colossal train");
  args.option("tokenizer", "tokenizer.json, SentencePiece .model, or a folder holding one", "",
              true)
      .option("out", "output token file (llm.c format); the document index goes to <out>.docs", "",
              true)
      .option("jsonl_field", "the field holding each record's text in *.jsonl files", "text")
      .option("dtype", "auto | u16 | u32 (auto: u16 when the vocabulary fits)", "auto")
      .option("threads", "encoding threads (0: every core)", "0")
      .flag("no_bos", "no BOS before each document (default: the tokenizer's BOS, if it has one)")
      .flag("eos", "put the tokenizer's EOS after each document")
      .flag("sft",
            "supervised fine-tuning records (JSONL: prompt/response or messages) with a loss "
            "mask <out>.mask")
      .option("prompt_field", "--sft: the prompt field of a record", "prompt")
      .option("response_field", "--sft: the response field of a record", "response")
      .option("messages_field", "--sft: the conversation field of a record", "messages")
      .option("chat_template",
              "--sft: render records with this template (chatml | llama3); needed for messages", "")
      .option("pack", "--sft: pack records into bins of this sequence length (0: concatenate)", "0")
      .option("pad_id", "--pack: the padding id (default: the tokenizer's EOS)", "")
      .flag("truncate", "--pack: cut records longer than the bin instead of failing")
      .rest("inputs", "text files, folders (read recursively) and .jsonl files, options first");
  args.parse(argc, argv);
  colossal::app::PrepareOptions o;
  o.inputs = args.rest_args();
  o.output = args.str("out");
  o.jsonl_field = args.str("jsonl_field");
  o.dtype = args.str("dtype");
  const int64_t threads = args.i64("threads");
  COLOSSAL_CHECK_INPUT(threads >= 0 && threads <= 4096, "--threads must be in [0, 4096], got ",
                       threads);
  o.threads = static_cast<int>(threads);
  o.add_eos = args.on("eos");
  o.progress = true;
  o.sft.enabled = args.on("sft");
  o.sft.prompt_field = args.str("prompt_field");
  o.sft.response_field = args.str("response_field");
  o.sft.messages_field = args.str("messages_field");
  if (args.has("chat_template")) o.sft.chat_template = args.str("chat_template");
  o.sft.pack = args.i64("pack");
  if (args.has("pad_id")) {
    const int64_t pad = args.i64("pad_id");
    COLOSSAL_CHECK_INPUT(pad >= 0 && pad <= std::numeric_limits<int32_t>::max(),
                         "--pad_id must be a token id, got ", pad);
    o.sft.pad_id = static_cast<int32_t>(pad);
  }
  o.sft.truncate = args.on("truncate");
  const auto enc = load_encoder(args.str("tokenizer"));
  // BOS before each document is the default where the tokenizer has one (Llama, Mistral);
  // byte-level BPEs without a template (GPT-2) have none: the index alone marks documents.
  o.add_bos = !args.on("no_bos") && enc.bos_id.has_value();
  if (!o.sft.chat_template.empty()) {
    colossal::log_info("tokenizer ", enc.name, ": ", enc.vocab_size,
                       " ids; records rendered with chat template ", o.sft.chat_template);
  } else {
    colossal::log_info(
        "tokenizer ", enc.name, ": ", enc.vocab_size, " ids; each document ",
        o.add_bos ? colossal::str("starts with BOS ", *enc.bos_id) : std::string("has no BOS"),
        o.add_eos && enc.eos_id ? colossal::str(" and ends with EOS ", *enc.eos_id)
                                : std::string(""));
  }
  const auto r = colossal::app::prepare(enc, o);
  if (!o.sft.enabled) {
    colossal::log_info("prepared ", r.documents, " documents from ", r.files, " files: ", r.tokens,
                       " tokens (", colossal::data::to_string(r.format), ") from ",
                       static_cast<double>(r.bytes) / 1e6, " MB of text in ", r.seconds, " s (",
                       static_cast<double>(r.tokens) / std::max(r.seconds, 1e-9), " tokens/s) -> ",
                       o.output, " and ", o.output, ".docs");
    return 0;
  }
  char frac[32];
  std::snprintf(frac, sizeof frac, "%.4f",
                r.tokens > 0 ? static_cast<double>(r.masked) / static_cast<double>(r.tokens) : 0.0);
  colossal::log_info(
      "prepared ", r.documents, " SFT records from ", r.files, " files",
      o.sft.chat_template.empty() ? std::string(" (prompt/response)")
                                  : colossal::str(" (template ", o.sft.chat_template, ")"),
      ": ", r.tokens, " tokens (", colossal::data::to_string(r.format), "), ", r.masked,
      " trained (mask 1, fraction ", frac, ")",
      o.sft.pack > 0 ? colossal::str(", ", r.bins, " bins of ", o.sft.pack, " tokens, ", r.padding,
                                     " padding tokens (id ", r.pad_id, "), ", r.truncated,
                                     " records truncated")
                     : std::string(", not packed"),
      " in ", r.seconds, " s -> ", o.output, ", ", o.output, ".docs and ", o.output, ".mask");
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("prepare", "tokenize text into a token file for colossal train", run_prepare);
