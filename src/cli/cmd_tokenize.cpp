// `colossal tokenize`: a Hugging Face tokenizer.json on stdin/stdout, one line in, one line out.
// Plain lines: text -> space-separated ids (or, with --decode, ids -> text). --jsonl: each line
// is a JSON string (text with newlines in it) -> a JSON array of ids, or with --decode a JSON
// array of ids -> a JSON string; what the tests use to compare with the `tokenizers` package.
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/data/tokenizer.h"

namespace colossal::cli {
namespace {

int run_tokenize(int argc, char** argv) {
  Args args("colossal tokenize",
            "encode stdin lines with a tokenizer.json (or decode ids with --decode)");
  args.option("tokenizer", "path of a Hugging Face tokenizer.json", "", true)
      .flag("decode", "read ids, write text")
      .flag("no_special", "encode: add no special tokens; decode: skip special tokens")
      .flag("jsonl", "lines are JSON: strings for text, arrays for ids");
  args.parse(argc, argv);
  const auto tok = data::Tokenizer::from_file(args.str("tokenizer"));
  const bool decode = args.on("decode"), no_special = args.on("no_special"),
             jsonl = args.on("jsonl");
  std::string line, out;
  int64_t lineno = 0;
  while (std::getline(std::cin, line)) {
    ++lineno;
    out.clear();
    const std::string where = str("stdin line ", lineno);
    if (!decode) {
      std::string text = jsonl ? json::parse(line, where).as_string(where) : line;
      auto ids = tok.encode(text, !no_special);
      if (jsonl) {
        json::Value a = json::Value::array();
        for (int32_t id : ids) a.push_back(id);
        out = a.dump();
      } else {
        for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
      }
    } else {
      std::vector<int32_t> ids;
      if (jsonl) {
        const json::Value parsed = json::parse(line, where);
        for (const auto& v : parsed.as_array(where)) {
          int64_t id = v.as_int(where);
          COLOSSAL_CHECK_INPUT(id >= 0 && id <= INT32_MAX, where, ": id ", id, " is out of range");
          ids.push_back(static_cast<int32_t>(id));
        }
      } else {
        std::istringstream is(line);
        std::string w;
        while (is >> w) {
          size_t used = 0;
          long long id = -1;
          try {
            id = std::stoll(w, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          COLOSSAL_CHECK_INPUT(used == w.size() && id >= 0 && id <= INT32_MAX, where, ": '", w,
                               "' is not a token id");
          ids.push_back(static_cast<int32_t>(id));
        }
      }
      std::string text = tok.decode(ids, no_special);
      out = jsonl ? json::Value(text).dump() : text;
    }
    out += '\n';
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("tokenize", "encode / decode text with a Hugging Face tokenizer.json",
                 run_tokenize);

}  // namespace colossal::cli
