// `colossal tokenize`: a Hugging Face tokenizer.json on stdin/stdout, one line in, one line out.
// Plain lines: text -> space-separated ids (or, with --decode, ids -> text). --jsonl: each line
// is a JSON string (text with newlines in it) -> a JSON array of ids, or with --decode a JSON
// array of ids -> a JSON string, or an object naming its own request (below): one process can
// answer a whole batch of mixed requests, which the tests use to compare with `tokenizers`.
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
  Args args("tokenize", "encode stdin lines with a tokenizer.json (or decode ids with --decode)");
  args.option("tokenizer", "path of a Hugging Face tokenizer.json", "", true)
      .flag("decode", "read ids, write text")
      .flag("no_special", "encode: add no special tokens; decode: skip special tokens")
      .flag("jsonl",
            "lines are JSON: strings for text, arrays for ids, or requests {\"text\": s, "
            "\"special\": b} / {\"ids\": [..], \"skip_special\": b}");
  args.parse(argc, argv);
  const auto tok = data::Tokenizer::from_file(args.str("tokenizer"));
  const bool decode = args.on("decode"), no_special = args.on("no_special"),
             jsonl = args.on("jsonl");
  auto ids_of = [](const json::Value& v, const std::string& where) {
    std::vector<int32_t> ids;
    for (const auto& x : v.as_array(where)) {
      int64_t id = x.as_int(where);
      COLOSSAL_CHECK_INPUT(id >= 0 && id <= INT32_MAX, where, ": id ", id, " is out of range");
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  };
  std::string line, out;
  int64_t lineno = 0;
  while (std::getline(std::cin, line)) {
    ++lineno;
    out.clear();
    const std::string where = str("stdin line ", lineno);
    auto encode = [&](const std::string& text, bool special) {
      try {
        return tok.encode(text, special);
      } catch (const InputError& e) {
        throw InputError(str(where, ": ", e.what()));
      }
    };
    if (jsonl) {
      // A string (encode) or an array (decode) as the flags say, or an object naming its own
      // request: {"text": ..., "special": bool} or {"ids": [...], "skip_special": bool}.
      const json::Value v = json::parse(line, where);
      bool enc = !decode, special = !no_special;
      const json::Value* arg = &v;
      if (v.is_object()) {
        arg = v.find("text");
        enc = arg != nullptr;
        if (!enc) arg = v.find("ids");
        COLOSSAL_CHECK_INPUT(arg, where, ": an object line needs \"text\" or \"ids\"");
        const json::Value* sp = v.find(enc ? "special" : "skip_special");
        if (sp) special = enc ? sp->as_bool(where) : !sp->as_bool(where);
      }
      if (enc) {
        json::Value a = json::Value::array();
        for (int32_t id : encode(arg->as_string(where), special)) a.push_back(id);
        out = a.dump();
      } else {
        out = json::Value(tok.decode(ids_of(*arg, where), !special)).dump();
      }
    } else if (!decode) {
      auto ids = encode(line, !no_special);
      for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
    } else {
      std::vector<int32_t> ids;
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
      out = tok.decode(ids, no_special);
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
