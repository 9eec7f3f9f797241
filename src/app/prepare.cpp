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
#include <thread>

#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/core/logging.h"

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

// Offset of the first byte that does not start or continue a valid UTF-8 sequence (overlong
// forms, surrogates and code points above U+10FFFF are invalid), or npos.
size_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

struct Doc {
  std::string text;
  std::string where;  // "file" or "file:line", for messages
};

void check_utf8(const Doc& d, size_t offset_base = 0) {
  size_t bad = invalid_utf8_at(d.text);
  COLOSSAL_CHECK_INPUT(bad == std::string_view::npos, "", d.where, ": invalid UTF-8 at byte ",
                       offset_base + bad,
                       " (convert the file to UTF-8 first, e.g. iconv -f latin1 -t utf-8)");
}

// The documents of the inputs, in order, a window at a time: a plain-text file whole, a JSONL
// file line by line (so a corpus of one 50 GB JSONL file is never held whole).
class DocStream {
 public:
  DocStream(const std::vector<std::string>& files, std::string field)
      : files_(files), field_(std::move(field)) {}

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
          Doc d{read_file(path_), path_};
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
    size_t bad = invalid_utf8_at(line);
    COLOSSAL_CHECK_INPUT(bad == std::string_view::npos, where, ": invalid UTF-8 at byte ", bad,
                         " of the line");
    json::Value v;
    try {
      v = json::parse(line, where);
    } catch (const std::exception& e) {
      throw InputError(str(where, " is not valid JSON: ", e.what()));
    }
    COLOSSAL_CHECK_INPUT(v.is_object(), where, " is not a JSON object");
    const json::Value* f = v.find(field_);
    COLOSSAL_CHECK_INPUT(f, where, " has no field \"", field_,
                         "\" (choose the field with --jsonl_field)");
    COLOSSAL_CHECK_INPUT(f->is_string(), where, ": field \"", field_, "\" is not a string");
    Doc d{f->as_string(), where};
    check_utf8(d);  // \u escapes can still encode lone surrogates
    return d;
  }

  const std::vector<std::string>& files_;
  std::string field_;
  size_t next_ = 0;
  int64_t opened_ = 0;
  std::ifstream jsonl_;
  std::string path_;
  int64_t line_no_ = 0;
};

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

  const std::vector<std::string> files = collect_files(o.inputs);
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
  std::vector<uint64_t> offsets{0};

  // Windows of about 64 MB of text: read in order, encoded by every thread, written in order.
  constexpr int64_t kWindowBytes = int64_t{64} << 20;
  DocStream stream(files, o.jsonl_field);
  int64_t read_bytes = 0;
  int last_pct = -1;
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  while (true) {
    std::vector<Doc> docs;
    const int64_t window = stream.fill(docs, kWindowBytes);
    if (window == 0 && docs.empty()) break;
    read_bytes += window;
    std::vector<std::vector<int32_t>> ids(docs.size());
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    std::mutex error_mu;
    auto work = [&] {
      for (size_t i = next++; i < docs.size(); i = next++) {
        try {
          ids[i] = enc.encode(docs[i].text);
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
    std::vector<char> buf;
    for (size_t i = 0; i < docs.size(); ++i) {
      std::vector<int32_t> doc;
      doc.reserve(ids[i].size() + 2);
      if (o.add_bos) doc.push_back(*enc.bos_id);
      doc.insert(doc.end(), ids[i].begin(), ids[i].end());
      if (o.add_eos) doc.push_back(*enc.eos_id);
      for (int32_t id : doc) {
        COLOSSAL_CHECK(id >= 0 && id < enc.vocab_size, "tokenizer ", enc.name, " produced id ", id,
                       " outside its vocabulary of ", enc.vocab_size, " (", docs[i].where, ")");
        if (u16) {
          uint16_t v = static_cast<uint16_t>(id);
          buf.insert(buf.end(), reinterpret_cast<char*>(&v), reinterpret_cast<char*>(&v) + 2);
        } else {
          uint32_t v = static_cast<uint32_t>(id);
          buf.insert(buf.end(), reinterpret_cast<char*>(&v), reinterpret_cast<char*>(&v) + 4);
        }
      }
      res.tokens += static_cast<int64_t>(doc.size());
      offsets.push_back(static_cast<uint64_t>(res.tokens));
      ++res.documents;
    }
    COLOSSAL_CHECK_INPUT(res.tokens <= std::numeric_limits<int32_t>::max(), "more than ",
                         std::numeric_limits<int32_t>::max(),
                         " tokens, the most an llm.c token file counts; prepare the inputs in "
                         "several parts");
    out.write(buf.data(), buf.size());
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

  // The header now that the count is known (llm.c: magic, version, token count).
  std::vector<int32_t> h(256, 0);
  h[0] = u16 ? data::kLlmcMagicGpt2 : data::kLlmcMagicLlama3;
  h[1] = u16 ? 1 : 7;
  h[2] = static_cast<int32_t>(res.tokens);
  COLOSSAL_CHECK(::pwrite(out.fd(), h.data(), data::kLlmcHeaderBytes, 0) == data::kLlmcHeaderBytes,
                 "cannot write the header of ", o.output, ": ", std::strerror(errno));

  checkpoint::AtomicFile index(o.output + ".docs");
  std::vector<int32_t> ih(256, 0);
  ih[0] = kDocIndexMagic;
  ih[1] = 1;
  ih[2] = static_cast<int32_t>(static_cast<uint64_t>(res.documents) & 0xFFFFFFFFu);
  ih[3] = static_cast<int32_t>(static_cast<uint64_t>(res.documents) >> 32);
  index.write(ih.data(), ih.size() * sizeof(int32_t));
  index.write(offsets.data(), offsets.size() * sizeof(uint64_t));
  out.commit();
  index.commit();
  res.bytes = read_bytes;
  res.files = stream.files_opened();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

std::vector<uint64_t> read_doc_index(const std::string& path) {
  std::string s = read_file(path);
  COLOSSAL_CHECK_INPUT(s.size() >= static_cast<size_t>(data::kLlmcHeaderBytes), "document index ",
                       path, " is shorter than its header");
  int32_t h[4];
  std::memcpy(h, s.data(), sizeof h);
  COLOSSAL_CHECK_INPUT(h[0] == kDocIndexMagic && h[1] == 1, "document index ", path, " has magic ",
                       h[0], " version ", h[1], "; expected ", kDocIndexMagic, " version 1");
  const uint64_t count = static_cast<uint32_t>(h[2]) | (static_cast<uint64_t>(h[3]) << 32);
  const uint64_t want = static_cast<uint64_t>(data::kLlmcHeaderBytes) + (count + 1) * 8;
  COLOSSAL_CHECK_INPUT(count < (uint64_t{1} << 40) && s.size() == want, "document index ", path,
                       " holds ", s.size(), " bytes; ", count, " documents need ", want);
  std::vector<uint64_t> off(count + 1);
  std::memcpy(off.data(), s.data() + data::kLlmcHeaderBytes, off.size() * 8);
  for (size_t i = 1; i < off.size(); ++i) {
    COLOSSAL_CHECK_INPUT(off[i] >= off[i - 1], "document index ", path,
                         ": offsets decrease at document ", i - 1);
  }
  COLOSSAL_CHECK_INPUT(off[0] == 0, "document index ", path, ": the first offset is not 0");
  return off;
}

}  // namespace colossal::app
