// `colossal prepare`: documents -> token file + document index (see colossal/app/prepare.h).
#include "colossal/app/prepare.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/core/logging.h"
#include "colossal/data/documents.h"
#include "colossal/data/utf8.h"

namespace fs = std::filesystem;

namespace colossal::app {
namespace {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; this writer copies host integers");

// Files of the inputs: a file as given, a folder walked recursively in path order (names that
// start with '.' skipped, as hidden files and version-control folders are not corpus text).
std::vector<std::string> collect_files(const std::vector<std::string>& inputs) {
  COLOSSAL_CHECK_INPUT(!inputs.empty(), "no input files or folders given");
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    std::error_code ec;
    auto st = fs::status(in, ec);
    COLOSSAL_CHECK_INPUT(!ec && fs::exists(st), "input ", in, " does not exist");
    if (fs::is_regular_file(st)) {
      files.push_back(in);
      continue;
    }
    COLOSSAL_CHECK_INPUT(fs::is_directory(st), "input ", in, " is neither a file nor a folder");
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(in, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!name.empty() && name[0] == '.') {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file()) found.push_back(it->path().string());
    }
    COLOSSAL_CHECK_INPUT(!ec, "cannot walk folder ", in, ": ", ec.message());
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  COLOSSAL_CHECK_INPUT(!files.empty(), "the inputs hold no files");
  return files;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  COLOSSAL_CHECK_INPUT(f.good(), "cannot read ", path);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  COLOSSAL_CHECK_INPUT(!f.bad(), "error while reading ", path);
  return s;
}

struct Doc {
  std::string text;
  std::string where;  // "file" or "file:line", for messages
  // SFT records: a prompt/response pair (text, response) or a conversation (role, content).
  std::string response;
  std::vector<std::pair<std::string, std::string>> messages;
  bool chat = false;
};

Doc make_doc(std::string text, std::string where) {
  Doc d;
  d.text = std::move(text);
  d.where = std::move(where);
  return d;
}

std::string known_templates();  // "chatml, llama3"

void check_utf8(const Doc& d, size_t offset_base = 0) {
  size_t bad = data::first_invalid_utf8(d.text);
  COLOSSAL_CHECK_INPUT(bad == std::string_view::npos, "", d.where, ": invalid UTF-8 at byte ",
                       offset_base + bad,
                       " (convert the file to UTF-8 first, e.g. iconv -f latin1 -t utf-8)");
}

// The documents of the inputs, in order, a window at a time: a plain-text file whole, a JSONL
// file line by line (so a corpus of one 50 GB JSONL file is never held whole).
class DocStream {
 public:
  DocStream(const std::vector<std::string>& files, std::string field, const SftOptions& sft)
      : files_(files), field_(std::move(field)), sft_(sft) {}

  // Appends documents until at least `budget` bytes were read or the inputs end; returns the
  // bytes read.
  int64_t fill(std::vector<Doc>& docs, int64_t budget) {
    int64_t got = 0;
    while (got < budget) {
      if (!jsonl_.is_open()) {
        if (next_ == files_.size()) break;
        path_ = files_[next_++];
        ++opened_;
        const bool jsonl = path_.size() >= 6 && path_.compare(path_.size() - 6, 6, ".jsonl") == 0;
        if (!jsonl) {
          Doc d = make_doc(read_file(path_), path_);
          check_utf8(d);
          got += static_cast<int64_t>(d.text.size());
          docs.push_back(std::move(d));
          continue;
        }
        jsonl_.open(path_, std::ios::binary);
        COLOSSAL_CHECK_INPUT(jsonl_.good(), "cannot read ", path_);
        line_no_ = 0;
      }
      std::string line;
      if (!std::getline(jsonl_, line)) {
        COLOSSAL_CHECK_INPUT(!jsonl_.bad(), "error while reading ", path_);
        jsonl_.close();
        continue;
      }
      ++line_no_;
      got += static_cast<int64_t>(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
      docs.push_back(parse_record(line));
    }
    return got;
  }
  int64_t files_opened() const { return opened_; }

 private:
  Doc parse_record(std::string_view line) const {
    const std::string where = str(path_, ":", line_no_);
    size_t bad = data::first_invalid_utf8(line);
    COLOSSAL_CHECK_INPUT(bad == std::string_view::npos, where, ": invalid UTF-8 at byte ", bad,
                         " of the line");
    json::Value v;
    try {
      v = json::parse(line, where);
    } catch (const std::exception& e) {
      throw InputError(str(where, " is not valid JSON: ", e.what()));
    }
    COLOSSAL_CHECK_INPUT(v.is_object(), where, " is not a JSON object");
    if (sft_.enabled) return parse_sft(v, where);
    const json::Value* f = v.find(field_);
    COLOSSAL_CHECK_INPUT(f, where, " has no field \"", field_,
                         "\" (choose the field with --jsonl_field)");
    COLOSSAL_CHECK_INPUT(f->is_string(), where, ": field \"", field_, "\" is not a string");
    Doc d = make_doc(f->as_string(), where);
    check_utf8(d);  // \u escapes can still encode lone surrogates
    return d;
  }

  // A string field of an SFT record, checked like a document.
  std::string sft_string(const json::Value& v, const std::string& field, const char* option,
                         const std::string& where) const {
    const json::Value* f = v.find(field);
    COLOSSAL_CHECK_INPUT(f, where, " has no field \"", field, "\"",
                         option ? str(" (choose the field with --", option, ")") : std::string());
    COLOSSAL_CHECK_INPUT(f->is_string(), where, ": field \"", field, "\" is not a string");
    Doc d = make_doc(f->as_string(), where);
    check_utf8(d);
    return d.text;
  }

  Doc parse_sft(const json::Value& v, const std::string& where) const {
    Doc d;
    d.where = where;
    if (const json::Value* m = v.find(sft_.messages_field)) {
      COLOSSAL_CHECK_INPUT(!sft_.chat_template.empty(), where, ": a \"", sft_.messages_field,
                           "\" record needs a chat template (--chat_template ", known_templates(),
                           ")");
      COLOSSAL_CHECK_INPUT(m->is_array() && m->size() > 0, where, ": field \"", sft_.messages_field,
                           "\" is not a non-empty array of messages");
      d.chat = true;
      for (size_t i = 0; i < m->as_array().size(); ++i) {
        const json::Value& msg = m->as_array()[i];
        const std::string mw = str(where, ": ", sft_.messages_field, "[", i, "]");
        COLOSSAL_CHECK_INPUT(msg.is_object(), mw, " is not a JSON object");
        std::string role = sft_string(msg, "role", nullptr, mw);
        COLOSSAL_CHECK_INPUT(role == "system" || role == "user" || role == "assistant", mw,
                             " has role \"", role, "\"; the roles are system, user, assistant");
        d.messages.emplace_back(std::move(role), sft_string(msg, "content", nullptr, mw));
      }
      return d;
    }
    COLOSSAL_CHECK_INPUT(
        v.find(sft_.prompt_field) || v.find(sft_.response_field), where, " has neither a \"",
        sft_.messages_field, "\" field nor \"", sft_.prompt_field, "\" and \"", sft_.response_field,
        "\" (choose them with --messages_field, --prompt_field, --response_field)");
    d.text = sft_string(v, sft_.prompt_field, "prompt_field", where);
    d.response = sft_string(v, sft_.response_field, "response_field", where);
    if (!sft_.chat_template.empty()) {
      d.chat = true;
      d.messages = {{"user", std::move(d.text)}, {"assistant", std::move(d.response)}};
      d.text.clear();
      d.response.clear();
    }
    return d;
  }

  const std::vector<std::string>& files_;
  std::string field_;
  const SftOptions& sft_;
  size_t next_ = 0;
  int64_t opened_ = 0;
  std::ifstream jsonl_;
  std::string path_;
  int64_t line_no_ = 0;
};

// ---- Chat templates ----------------------------------------------------------------------

// A template in the shape both known ones have: a text once before the conversation, then per
// message `header_open role header_close content end_token separator`, where the content may be
// trimmed (Jinja's `trim`, Python's str.strip()). The generation span of an assistant message is
// its content plus the end token, as `{% generation %}` wraps them.
struct ChatTemplate {
  const char* name;
  const char* begin;  // before the first message
  const char* header_open;
  const char* header_close;
  const char* end;        // closes each message (the end-of-turn special token)
  const char* separator;  // after the end token
  bool trim;
  std::vector<std::string> special;  // the special tokens the template writes
};

const std::vector<ChatTemplate>& templates() {
  static const std::vector<ChatTemplate> t = {
      // Qwen2's ChatML, without the default system message.
      {"chatml",
       "",
       "<|im_start|>",
       "\n",
       "<|im_end|>",
       "\n",
       false,
       {"<|im_start|>", "<|im_end|>"}},
      // Llama 3's (and 3.1's without tools and dates): content | trim.
      {"llama3",
       "<|begin_of_text|>",
       "<|start_header_id|>",
       "<|end_header_id|>\n\n",
       "<|eot_id|>",
       "",
       true,
       {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}},
  };
  return t;
}

std::string known_templates() {
  std::string out;
  for (const auto& t : templates()) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

const ChatTemplate& find_template(const std::string& name) {
  for (const auto& t : templates())
    if (name == t.name) return t;
  throw InputError(str("unknown chat template '", name, "'; known: ", known_templates()));
}

// Python's str.isspace() for one code point (what Jinja's trim strips).
bool py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// str.strip() on valid UTF-8.
std::string_view py_strip(std::string_view s) {
  auto decode_at = [&](size_t i, size_t& len) {
    len = data::utf8_len(static_cast<unsigned char>(s[i]));
    return data::utf8_decode(s, i);
  };
  size_t a = 0;
  while (a < s.size()) {
    size_t len = 0;
    if (!py_space(decode_at(a, len))) break;
    a += len;
  }
  size_t b = s.size();
  while (b > a) {
    size_t k = b - 1;
    while (k > a && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    size_t len = 0;
    if (!py_space(decode_at(k, len))) break;
    b = k;
  }
  return s.substr(a, b - a);
}

// The ids of a template's special tokens, each of which the tokenizer must split out of text as
// one token (an added token), as Hugging Face's tokenization of the rendered text does.
void check_template_tokens(const TextEncoder& enc, const ChatTemplate& t) {
  COLOSSAL_CHECK_INPUT(enc.encode_with_offsets && enc.token_to_id, "--chat_template ", t.name,
                       " needs a tokenizer.json; ", enc.name,
                       " is a SentencePiece model (not supported with chat templates)");
  for (const auto& tok : t.special) {
    const auto id = enc.token_to_id(tok);
    COLOSSAL_CHECK_INPUT(id && enc.encode(tok) == std::vector<int32_t>{*id}, "chat template ",
                         t.name, " needs the special token ", tok, ", which tokenizer ", enc.name,
                         id ? " does not split out as one added token" : " does not have");
  }
}

struct Encoded {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;  // SFT only
};

// A record's tokens and loss mask (see prepare.h and docs/design.md).
Encoded encode_sft(const TextEncoder& enc, const PrepareOptions& o, const Doc& d) {
  Encoded e;
  if (!d.chat) {
    if (o.add_bos) e.ids.push_back(*enc.bos_id);
    auto p = enc.encode(d.text);
    e.ids.insert(e.ids.end(), p.begin(), p.end());
    e.mask.assign(e.ids.size(), 0);
    auto r = enc.encode(d.response);
    e.ids.insert(e.ids.end(), r.begin(), r.end());
    e.ids.push_back(*enc.eos_id);
    e.mask.resize(e.ids.size(), 1);
  } else {
    const RenderedChat chat = render_chat(o.sft.chat_template, d.messages);
    std::vector<std::pair<size_t, size_t>> off;
    e.ids = enc.encode_with_offsets(chat.text, off);
    COLOSSAL_CHECK(off.size() == e.ids.size(), "tokenizer ", enc.name, " gave ", off.size(),
                   " offsets for ", e.ids.size(), " ids");
    e.mask.assign(e.ids.size(), 0);
    // transformers' apply_chat_template(return_assistant_tokens_mask=True): the tokens from
    // char_to_token(start) to char_to_token(end - 1); no token at the start stops the marking,
    // none at the end marks to the end.
    // Spans start and end in non-decreasing order, so the first token ending after `byte` is
    // the only candidate.
    auto token_at = [&](size_t byte) -> std::optional<size_t> {
      auto it = std::partition_point(off.begin(), off.end(),
                                     [&](const auto& sp) { return sp.second <= byte; });
      if (it == off.end() || it->first > byte) return std::nullopt;
      return static_cast<size_t>(it - off.begin());
    };
    for (auto [a, b] : chat.generation) {
      const auto first = token_at(a);
      if (!first) break;
      const auto last = b > a ? token_at(b - 1) : std::nullopt;
      const size_t stop = last && *last > 0 ? *last + 1 : e.ids.size();
      for (size_t i = *first; i < stop; ++i) e.mask[i] = 1;
    }
  }
  if (!e.mask.empty()) e.mask[0] = 0;  // a record's first token is never predicted from it
  return e;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  }
  return buf;
}

}  // namespace

std::vector<std::string> chat_template_names() {
  std::vector<std::string> out;
  for (const auto& t : templates()) out.emplace_back(t.name);
  return out;
}

RenderedChat render_chat(const std::string& template_name,
                         const std::vector<std::pair<std::string, std::string>>& messages) {
  const ChatTemplate& t = find_template(template_name);
  RenderedChat r;
  r.text = t.begin;
  for (const auto& [role, content] : messages) {
    COLOSSAL_CHECK_INPUT(role == "system" || role == "user" || role == "assistant", "role \"", role,
                         "\" is none of system, user, assistant");
    r.text += t.header_open;
    r.text += role;
    r.text += t.header_close;
    const size_t start = r.text.size();
    r.text += t.trim ? py_strip(content) : std::string_view(content);
    r.text += t.end;
    if (role == "assistant") r.generation.emplace_back(start, r.text.size());
    r.text += t.separator;
  }
  return r;
}

PrepareResult prepare(const TextEncoder& enc, const PrepareOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  COLOSSAL_CHECK_INPUT(!o.output.empty(), "--out is required");
  COLOSSAL_CHECK_INPUT(enc.vocab_size > 0, "tokenizer ", enc.name, " has an empty vocabulary");
  COLOSSAL_CHECK_INPUT(!o.add_bos || enc.bos_id, "tokenizer ", enc.name,
                       " defines no BOS token; run without BOS (--no_bos)");
  COLOSSAL_CHECK_INPUT(!o.add_eos || enc.eos_id, "tokenizer ", enc.name,
                       " defines no EOS token; run without --eos");
  COLOSSAL_CHECK_INPUT(o.dtype == "auto" || o.dtype == "u16" || o.dtype == "u32",
                       "--dtype must be auto, u16 or u32, got '", o.dtype, "'");
  const bool u16 = o.dtype == "u16" || (o.dtype == "auto" && enc.vocab_size <= 65536);
  COLOSSAL_CHECK_INPUT(!u16 || enc.vocab_size <= 65536, "--dtype u16 cannot hold the ",
                       enc.vocab_size, " ids of tokenizer ", enc.name, " (at most 65536); use u32");
  PrepareResult res;
  res.format = u16 ? data::TokenFormat::LlmcGpt2 : data::TokenFormat::LlmcLlama3;

  const SftOptions& sft = o.sft;
  const ChatTemplate* tmpl = nullptr;
  int32_t pad = -1;
  if (sft.enabled) {
    if (!sft.chat_template.empty()) {
      tmpl = &find_template(sft.chat_template);
      check_template_tokens(enc, *tmpl);
    } else {
      COLOSSAL_CHECK_INPUT(enc.eos_id, "tokenizer ", enc.name,
                           " defines no EOS token, which ends each prompt/response record; use a "
                           "tokenizer with one or a --chat_template");
    }
    COLOSSAL_CHECK_INPUT(sft.pack >= 0 && sft.pack <= std::numeric_limits<int32_t>::max(),
                         "--pack must be a sequence length >= 1 (0: no packing), got ", sft.pack);
    COLOSSAL_CHECK_INPUT(!sft.truncate || sft.pack > 0, "--truncate needs --pack");
    if (sft.pack > 0) {
      if (sft.pad_id) {
        pad = *sft.pad_id;
      } else if (enc.eos_id) {
        pad = *enc.eos_id;
      } else if (tmpl) {
        pad = *enc.token_to_id(tmpl->end);
      }
      COLOSSAL_CHECK_INPUT(pad >= 0, "tokenizer ", enc.name,
                           " defines no EOS token to pad packed bins with; give --pad_id");
      COLOSSAL_CHECK_INPUT(pad < enc.vocab_size, "--pad_id ", pad, " is outside the vocabulary of ",
                           enc.vocab_size, " ids of tokenizer ", enc.name);
      res.pad_id = pad;
    }
  } else {
    COLOSSAL_CHECK_INPUT(sft.chat_template.empty() && sft.pack == 0 && !sft.truncate && !sft.pad_id,
                         "--chat_template, --pack, --pad_id and --truncate are for SFT records "
                         "(--sft)");
  }

  const std::vector<std::string> files = collect_files(o.inputs);
  if (sft.enabled) {
    for (const auto& f : files) {
      COLOSSAL_CHECK_INPUT(f.size() >= 6 && f.compare(f.size() - 6, 6, ".jsonl") == 0,
                           "--sft reads JSONL records (*.jsonl) only; ", f, " is not one");
    }
  }
  int64_t total_bytes = 0;
  for (const auto& f : files) total_bytes += static_cast<int64_t>(fs::file_size(f));
  const int threads = o.threads > 0
                          ? o.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));

  if (fs::path(o.output).has_parent_path())
    fs::create_directories(fs::path(o.output).parent_path());
  checkpoint::AtomicFile out(o.output);
  std::vector<char> header(static_cast<size_t>(data::kLlmcHeaderBytes), 0);
  out.write(header.data(), header.size());  // the real one once the count is known
  std::optional<checkpoint::AtomicFile> mask_out;
  if (sft.enabled) {
    mask_out.emplace(o.output + ".mask");
    mask_out->write(header.data(), header.size());
  }
  // Document starts; the end of the last one is appended at the end, so padding after a record
  // belongs to it.
  std::vector<uint64_t> offsets;

  // Windows of about 64 MB of text: read in order, encoded by every thread, written in order.
  constexpr int64_t kWindowBytes = int64_t{64} << 20;
  DocStream stream(files, o.jsonl_field, sft);
  int64_t read_bytes = 0, bin_fill = 0;
  int last_pct = -1;
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  std::vector<char> buf;
  std::vector<uint8_t> mbuf;
  auto put = [&](int32_t id, uint8_t m) {
    if (u16) {
      uint16_t v = static_cast<uint16_t>(id);
      buf.insert(buf.end(), reinterpret_cast<char*>(&v), reinterpret_cast<char*>(&v) + 2);
    } else {
      uint32_t v = static_cast<uint32_t>(id);
      buf.insert(buf.end(), reinterpret_cast<char*>(&v), reinterpret_cast<char*>(&v) + 4);
    }
    if (sft.enabled) {
      mbuf.push_back(m);
      res.masked += m;
    }
    ++res.tokens;
  };
  auto pad_to = [&](int64_t n) {  // n padding tokens (mask 0) after the last record
    for (int64_t i = 0; i < n; ++i) put(pad, 0);
    res.padding += n;
  };
  while (true) {
    std::vector<Doc> docs;
    const int64_t window = stream.fill(docs, kWindowBytes);
    if (window == 0 && docs.empty()) break;
    read_bytes += window;
    std::vector<Encoded> enc_docs(docs.size());
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    std::mutex error_mu;
    auto work = [&] {
      for (size_t i = next++; i < docs.size(); i = next++) {
        try {
          if (sft.enabled) {
            enc_docs[i] = encode_sft(enc, o, docs[i]);
          } else {
            auto ids = enc.encode(docs[i].text);
            auto& d = enc_docs[i].ids;
            d.reserve(ids.size() + 2);
            if (o.add_bos) d.push_back(*enc.bos_id);
            d.insert(d.end(), ids.begin(), ids.end());
            if (o.add_eos) d.push_back(*enc.eos_id);
          }
        } catch (...) {
          std::lock_guard<std::mutex> g(error_mu);
          if (!error) error = std::current_exception();
          next = docs.size();
        }
      }
    };
    {
      std::vector<std::thread> pool;
      const int n = std::min<int>(threads, static_cast<int>(docs.size()));
      for (int t = 1; t < n; ++t) pool.emplace_back(work);
      work();
      for (auto& t : pool) t.join();
    }
    if (error) std::rethrow_exception(error);
    buf.clear();
    mbuf.clear();
    for (size_t i = 0; i < docs.size(); ++i) {
      Encoded& d = enc_docs[i];
      for (int32_t id : d.ids) {
        COLOSSAL_CHECK(id >= 0 && id < enc.vocab_size, "tokenizer ", enc.name, " produced id ", id,
                       " outside its vocabulary of ", enc.vocab_size, " (", docs[i].where, ")");
      }
      if (sft.pack > 0) {
        auto len = static_cast<int64_t>(d.ids.size());
        if (len > sft.pack) {
          COLOSSAL_CHECK_INPUT(sft.truncate, docs[i].where, ": the record has ", len,
                               " tokens, more than --pack ", sft.pack,
                               " holds (cut such records with --truncate, or pack longer bins)");
          d.ids.resize(static_cast<size_t>(sft.pack));
          d.mask.resize(static_cast<size_t>(sft.pack));
          len = sft.pack;
          ++res.truncated;
        }
        if (bin_fill + len > sft.pack) {  // does not fit: pad the bin, start the next
          pad_to(sft.pack - bin_fill);
          bin_fill = 0;
          ++res.bins;
        }
        bin_fill += len;
        if (bin_fill == sft.pack) {
          bin_fill = 0;
          ++res.bins;
        }
      }
      offsets.push_back(static_cast<uint64_t>(res.tokens));
      for (size_t k = 0; k < d.ids.size(); ++k) put(d.ids[k], sft.enabled ? d.mask[k] : 0);
      ++res.documents;
    }
    COLOSSAL_CHECK_INPUT(
        res.tokens + (sft.pack > 0 ? sft.pack + 1 : 0) <= std::numeric_limits<int32_t>::max(),
        "more than ", std::numeric_limits<int32_t>::max(),
        " tokens, the most an llm.c token file counts; prepare the inputs in "
        "several parts");
    out.write(buf.data(), buf.size());
    if (mask_out) mask_out->write(mbuf.data(), mbuf.size());
    if (o.progress) {
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int pct = total_bytes > 0
                          ? static_cast<int>(std::min<int64_t>(100, 100 * read_bytes / total_bytes))
                          : 100;
      if (tty || pct / 10 != last_pct / 10) {
        std::fprintf(stderr,
                     "%sprepare: %3d%% (%s of %s, %lld documents, %lld tokens, %.0f tok/s)%s",
                     tty ? "\r" : "", pct, human_bytes(static_cast<double>(read_bytes)).c_str(),
                     human_bytes(static_cast<double>(total_bytes)).c_str(),
                     static_cast<long long>(res.documents), static_cast<long long>(res.tokens),
                     static_cast<double>(res.tokens) / std::max(secs, 1e-9), tty ? "" : "\n");
        std::fflush(stderr);
        last_pct = pct;
      }
    }
  }
  if (o.progress && tty) std::fprintf(stderr, "\n");
  if (sft.enabled) COLOSSAL_CHECK_INPUT(res.documents > 0, "the inputs hold no records");
  if (sft.pack > 0 && res.tokens > 0) {
    // The last bin is padded to full length, and one more padding token follows it: sample k
    // reads tokens [kS, kS + S + 1), so the last bin needs a target after it to be a sample.
    buf.clear();
    mbuf.clear();
    if (bin_fill > 0) {
      pad_to(sft.pack - bin_fill);
      ++res.bins;
    }
    pad_to(1);
    out.write(buf.data(), buf.size());
    mask_out->write(mbuf.data(), mbuf.size());
  }
  offsets.push_back(static_cast<uint64_t>(res.tokens));

  // The header now that the count is known (llm.c: magic, version, token count).
  std::vector<int32_t> h(256, 0);
  h[0] = u16 ? data::kLlmcMagicGpt2 : data::kLlmcMagicLlama3;
  h[1] = u16 ? 1 : 7;
  h[2] = static_cast<int32_t>(res.tokens);
  COLOSSAL_CHECK(::pwrite(out.fd(), h.data(), data::kLlmcHeaderBytes, 0) == data::kLlmcHeaderBytes,
                 "cannot write the header of ", o.output, ": ", std::strerror(errno));
  if (mask_out) {
    std::vector<int32_t> mh(256, 0);
    mh[0] = data::kLossMaskMagic;
    mh[1] = 1;
    mh[2] = static_cast<int32_t>(static_cast<uint64_t>(res.tokens) & 0xFFFFFFFFu);
    mh[3] = static_cast<int32_t>(static_cast<uint64_t>(res.tokens) >> 32);
    mh[4] = static_cast<int32_t>(sft.pack);
    COLOSSAL_CHECK(
        ::pwrite(mask_out->fd(), mh.data(), data::kLlmcHeaderBytes, 0) == data::kLlmcHeaderBytes,
        "cannot write the header of ", o.output, ".mask: ", std::strerror(errno));
  }

  checkpoint::AtomicFile index(o.output + ".docs");
  std::vector<int32_t> ih(256, 0);
  ih[0] = data::kDocIndexMagic;
  ih[1] = 1;
  ih[2] = static_cast<int32_t>(static_cast<uint64_t>(res.documents) & 0xFFFFFFFFu);
  ih[3] = static_cast<int32_t>(static_cast<uint64_t>(res.documents) >> 32);
  index.write(ih.data(), ih.size() * sizeof(int32_t));
  index.write(offsets.data(), offsets.size() * sizeof(uint64_t));
  out.commit();
  index.commit();
  if (mask_out) {
    mask_out->commit();
  } else {
    // A loss mask left by an earlier SFT run of the same output would no longer match it.
    ::unlink((o.output + ".mask").c_str());
  }
  res.bytes = read_bytes;
  res.files = stream.files_opened();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace colossal::app
