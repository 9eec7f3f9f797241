// load_tokenizer: tokenizer.json or SentencePiece .model behind one face.
#include "colossal/data/text_tokenizer.h"

#include <filesystem>
#include <memory>

#include "colossal/core/error.h"
#include "colossal/data/sentencepiece.h"
#include "colossal/data/tokenizer.h"

namespace fs = std::filesystem;

namespace colossal::data {

bool has_tokenizer(const std::string& folder) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(folder) / "tokenizer.json", ec) ||
         fs::is_regular_file(fs::path(folder) / "tokenizer.model", ec);
}

TextTokenizer load_tokenizer(const std::string& arg) {
  std::string path = arg;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path json = fs::path(path) / "tokenizer.json";
    const fs::path model = fs::path(path) / "tokenizer.model";
    COLOSSAL_CHECK_INPUT(has_tokenizer(path), "tokenizer: folder ", path,
                         " holds neither tokenizer.json nor tokenizer.model");
    path = (fs::is_regular_file(json, ec) ? json : model).string();
  }
  TextTokenizer t;
  t.path = path;
  if (fs::path(path).extension() == ".json") {
    auto hf = std::make_shared<Tokenizer>(Tokenizer::from_file(path));
    t.encode = [hf](std::string_view text, bool special) { return hf->encode(text, special); };
    t.decode = [hf](const std::vector<int32_t>& ids, bool skip) { return hf->decode(ids, skip); };
    t.vocab_size = hf->vocab_size();
    t.bos_id = hf->bos_id();
    t.eos_id = hf->eos_id();
    return t;
  }
  COLOSSAL_CHECK_INPUT(fs::path(path).extension() == ".model", "tokenizer: ", path,
                       " is neither a tokenizer.json nor a SentencePiece .model file (nor a "
                       "folder holding one)");
  auto sp = std::make_shared<SentencePieceTokenizer>(SentencePieceTokenizer::from_file(path));
  t.encode = [sp](std::string_view text, bool special) {
    return sp->encode(text, special && sp->bos_id().has_value());
  };
  // SentencePiece's decoding drops control pieces (BOS/EOS) in either case.
  t.decode = [sp](const std::vector<int32_t>& ids, bool) { return sp->decode(ids); };
  t.vocab_size = sp->vocab_size();
  t.bos_id = sp->bos_id();
  t.eos_id = sp->eos_id();
  return t;
}

}  // namespace colossal::data
