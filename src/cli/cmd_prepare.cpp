// `colossal prepare`: text files, folders and JSONL into a token file plus document index for
// `colossal train` (see colossal/app/prepare.h).
#include <filesystem>
#include <memory>
#include <string>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/app/prepare.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/data/text_tokenizer.h"

namespace {

// The tokenizer named by --tokenizer (a file or a folder holding one); documents are encoded
// without special tokens, prepare frames them.
colossal::app::TextEncoder load_encoder(const std::string& arg) {
  auto t = std::make_shared<colossal::data::TextTokenizer>(colossal::data::load_tokenizer(arg));
  colossal::app::TextEncoder e;
  e.name = t->path;
  e.encode = [t](std::string_view text) { return t->encode(text, /*add_special=*/false); };
  e.vocab_size = t->vocab_size;
  e.bos_id = t->bos_id;
  e.eos_id = t->eos_id;
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
  const auto enc = load_encoder(args.str("tokenizer"));
  // BOS before each document is the default where the tokenizer has one (Llama, Mistral);
  // byte-level BPEs without a template (GPT-2) have none: the index alone marks documents.
  o.add_bos = !args.on("no_bos") && enc.bos_id.has_value();
  colossal::log_info(
      "tokenizer ", enc.name, ": ", enc.vocab_size, " ids; each document ",
      o.add_bos ? colossal::str("starts with BOS ", *enc.bos_id) : std::string("has no BOS"),
      o.add_eos && enc.eos_id ? colossal::str(" and ends with EOS ", *enc.eos_id)
                              : std::string(""));
  const auto r = colossal::app::prepare(enc, o);
  colossal::log_info("prepared ", r.documents, " documents from ", r.files, " files: ", r.tokens,
                     " tokens (", colossal::data::to_string(r.format), ") from ",
                     static_cast<double>(r.bytes) / 1e6, " MB of text in ", r.seconds, " s (",
                     static_cast<double>(r.tokens) / std::max(r.seconds, 1e-9), " tokens/s) -> ",
                     o.output, " and ", o.output, ".docs");
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("prepare", "tokenize text into a token file for colossal train", run_prepare);
