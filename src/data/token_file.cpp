// Memory-mapped token files (raw uint16/uint32 and llm.c headered) and their writer.
#include "colossal/data/token_file.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <tuple>

#include "colossal/core/error.h"
#include "colossal/data/documents.h"

namespace colossal::data {

const char* to_string(TokenFormat f) {
  switch (f) {
    case TokenFormat::Auto:
      return "auto";
    case TokenFormat::RawU16:
      return "u16";
    case TokenFormat::RawU32:
      return "u32";
    case TokenFormat::LlmcGpt2:
      return "llmc";
    case TokenFormat::LlmcLlama3:
      return "llmc-llama3";
  }
  return "?";
}

TokenFormat token_format_from_string(const std::string& s) {
  for (auto f : {TokenFormat::Auto, TokenFormat::RawU16, TokenFormat::RawU32, TokenFormat::LlmcGpt2,
                 TokenFormat::LlmcLlama3})
    if (s == to_string(f)) return f;
  throw InputError(
      str("unknown token file format '", s, "'; use auto, u16, u32, llmc or llmc-llama3"));
}

namespace {
int32_t read_i32(const unsigned char* p) {
  uint32_t v = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
               (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  return static_cast<int32_t>(v);
}
bool suffix_says_u32(const std::string& path) {
  auto slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  for (const char* tag : {".u32", ".uint32"}) {
    auto pos = base.find(tag);
    if (pos == std::string::npos) continue;
    size_t end = pos + std::strlen(tag);
    if (end == base.size() || base[end] == '.') return true;
  }
  return false;
}
}  // namespace

TokenFile::TokenFile(const std::string& path, TokenFormat format) : path_(path), format_(format) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(str("cannot open token file ", path, ": ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw InputError(str("cannot stat token file ", path, ": ", std::strerror(e)));
  }
  size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes > 0) {
    map_ = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (map_ == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      map_ = nullptr;
      throw InputError(str("cannot memory-map token file ", path, ": ", std::strerror(e)));
    }
    map_bytes_ = bytes;
  }
  ::close(fd);
  const auto* base = static_cast<const unsigned char*>(map_);
  try {
    if (format_ == TokenFormat::Auto) {
      int32_t magic = bytes >= 4 ? read_i32(base) : 0;
      if (magic == kLlmcMagicGpt2)
        format_ = TokenFormat::LlmcGpt2;
      else if (magic == kLlmcMagicLlama3)
        format_ = TokenFormat::LlmcLlama3;
      else
        format_ = suffix_says_u32(path) ? TokenFormat::RawU32 : TokenFormat::RawU16;
    }
    if (format_ == TokenFormat::LlmcGpt2 || format_ == TokenFormat::LlmcLlama3) {
      bool gpt2 = format_ == TokenFormat::LlmcGpt2;
      COLOSSAL_CHECK_INPUT(static_cast<int64_t>(bytes) >= kLlmcHeaderBytes, "token file ", path,
                           ": ", bytes, " bytes is shorter than the llm.c header (",
                           kLlmcHeaderBytes, " bytes)");
      int32_t magic = read_i32(base), version = read_i32(base + 4), count = read_i32(base + 8);
      int32_t want_magic = gpt2 ? kLlmcMagicGpt2 : kLlmcMagicLlama3, want_version = gpt2 ? 1 : 7;
      COLOSSAL_CHECK_INPUT(magic == want_magic, "token file ", path, ": bad llm.c magic ", magic,
                           " (expected ", want_magic, ")");
      COLOSSAL_CHECK_INPUT(version == want_version, "token file ", path,
                           ": unsupported llm.c version ", version, " for magic ", magic,
                           " (expected ", want_version, ")");
      COLOSSAL_CHECK_INPUT(count >= 0, "token file ", path, ": negative token count ", count,
                           " in the header");
      width_ = gpt2 ? 2 : 4;
      int64_t want = kLlmcHeaderBytes + static_cast<int64_t>(count) * width_;
      COLOSSAL_CHECK_INPUT(static_cast<int64_t>(bytes) == want, "token file ", path,
                           ": header says ", count, " tokens (", want,
                           " bytes with the header) but the file has ", bytes,
                           " bytes; it is truncated or corrupt");
      ntokens_ = count;
      data_ = base + kLlmcHeaderBytes;
    } else {
      width_ = format_ == TokenFormat::RawU32 ? 4 : 2;
      COLOSSAL_CHECK_INPUT(bytes % width_ == 0, "token file ", path, ": ", bytes,
                           " bytes is not a multiple of the token width ", width_, " (",
                           to_string(format_), "); truncated, or the wrong --data-format");
      ntokens_ = static_cast<int64_t>(bytes) / width_;
      data_ = base;
    }
  } catch (...) {
    if (map_) ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

TokenFile::~TokenFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

int64_t TokenFile::token(int64_t i) const {
  COLOSSAL_CHECK(i >= 0 && i < ntokens_, "token file ", path_, ": index ", i, " out of range [0, ",
                 ntokens_, ")");
  const unsigned char* p = data_ + i * width_;
  if (width_ == 2) return static_cast<int64_t>(p[0] | (p[1] << 8));
  return static_cast<int64_t>(static_cast<uint32_t>(read_i32(p)));
}

namespace {
// First index in [0, n) of a token >= limit, or -1. Chunks are reduced to their maximum first
// (a loop the compiler vectorises); only a chunk holding a bad id is searched element-wise.
template <class T>
int64_t first_at_or_above_impl(const unsigned char* data, int64_t n, T limit) {
  constexpr int64_t kChunk = 1 << 16;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    const unsigned char* p = data + start * static_cast<int64_t>(sizeof(T));
    T hi = 0;
    for (int64_t i = 0; i < len; ++i) {
      T v;
      std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
      hi = v > hi ? v : hi;
    }
    if (hi < limit) continue;
    for (int64_t i = 0; i < len; ++i) {
      T v;
      std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
      if (v >= limit) return start + i;
    }
  }
  return -1;
}
}  // namespace

int64_t TokenFile::first_at_or_above(int64_t limit) const {
  if (limit <= 0) return ntokens_ > 0 ? 0 : -1;
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian");
  if (width_ == 2) {
    if (limit > 0xFFFF) return -1;  // no uint16 reaches it
    return first_at_or_above_impl<uint16_t>(data_, ntokens_, static_cast<uint16_t>(limit));
  }
  if (limit > 0xFFFFFFFFLL) return -1;
  return first_at_or_above_impl<uint32_t>(data_, ntokens_, static_cast<uint32_t>(limit));
}

at::Tensor TokenFile::slice(int64_t start, int64_t len) const {
  COLOSSAL_CHECK(start >= 0 && len >= 0 && start + len <= ntokens_, "token file ", path_,
                 ": slice [", start, ", ", start + len, ") out of range [0, ", ntokens_, ")");
  at::Tensor out = at::empty({len}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const unsigned char* p = data_ + start * width_;
  // Little-endian host assumed for the bulk copy (checked at compile time below).
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian");
  if (width_ == 2) {
    for (int64_t i = 0; i < len; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      o[i] = v;
    }
  } else {
    for (int64_t i = 0; i < len; ++i) {
      uint32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      o[i] = v;
    }
  }
  return out;
}

void write_token_file(const std::string& path, const std::vector<int64_t>& tokens,
                      TokenFormat format) {
  COLOSSAL_CHECK_INPUT(format != TokenFormat::Auto,
                       "write_token_file: choose a concrete format for ", path);
  int width = (format == TokenFormat::RawU16 || format == TokenFormat::LlmcGpt2) ? 2 : 4;
  int64_t max_tok = width == 2 ? 0xFFFF : 0xFFFFFFFFLL;
  std::vector<unsigned char> buf;
  bool llmc = format == TokenFormat::LlmcGpt2 || format == TokenFormat::LlmcLlama3;
  if (llmc) {
    COLOSSAL_CHECK_INPUT(tokens.size() < (1ULL << 31), "write_token_file: ", tokens.size(),
                         " tokens exceed llm.c's int32 count");
    std::vector<int32_t> header(256, 0);
    header[0] = format == TokenFormat::LlmcGpt2 ? kLlmcMagicGpt2 : kLlmcMagicLlama3;
    header[1] = format == TokenFormat::LlmcGpt2 ? 1 : 7;
    header[2] = static_cast<int32_t>(tokens.size());
    buf.resize(kLlmcHeaderBytes);
    std::memcpy(buf.data(), header.data(), kLlmcHeaderBytes);
  }
  size_t off = buf.size();
  buf.resize(off + tokens.size() * width);
  for (size_t i = 0; i < tokens.size(); ++i) {
    int64_t t = tokens[i];
    COLOSSAL_CHECK_INPUT(t >= 0 && t <= max_tok, "write_token_file: token ", t, " at index ", i,
                         " does not fit format ", to_string(format), " (max ", max_tok, ")");
    if (width == 2) {
      uint16_t v = static_cast<uint16_t>(t);
      std::memcpy(buf.data() + off + 2 * i, &v, 2);
    } else {
      uint32_t v = static_cast<uint32_t>(t);
      std::memcpy(buf.data() + off + 4 * i, &v, 4);
    }
  }
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    COLOSSAL_CHECK_INPUT(f.good(), "cannot write token file ", tmp, ": ", std::strerror(errno));
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
    COLOSSAL_CHECK_INPUT(f.good(), "error writing token file ", tmp);
  }
  COLOSSAL_CHECK_INPUT(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ",
                       path, ": ", std::strerror(errno));
}

TokenDataset::TokenDataset(std::shared_ptr<TokenFile> file, int64_t seq_len)
    : file_(std::move(file)), seq_len_(seq_len) {
  COLOSSAL_CHECK_INPUT(seq_len_ >= 1, "sequence length must be >= 1, got ", seq_len_);
  num_samples_ = file_->size() > 0 ? (file_->size() - 1) / seq_len_ : 0;
  COLOSSAL_CHECK_INPUT(num_samples_ >= 1, "token file ", file_->path(), " has ", file_->size(),
                       " tokens, fewer than one sample of sequence length ", seq_len_, " needs (",
                       seq_len_ + 1, ")");
}

std::pair<at::Tensor, at::Tensor> TokenDataset::sample(int64_t k) const {
  COLOSSAL_CHECK(k >= 0 && k < num_samples_, "sample ", k, " out of range [0, ", num_samples_, ")");
  at::Tensor t = file_->slice(k * seq_len_, seq_len_ + 1);
  return {t.slice(0, 0, seq_len_), t.slice(0, 1, seq_len_ + 1)};
}

std::pair<at::Tensor, at::Tensor> TokenDataset::batch(const std::vector<int64_t>& indices) const {
  at::Tensor in = at::empty({static_cast<int64_t>(indices.size()), seq_len_}, at::kLong);
  at::Tensor tg = at::empty_like(in);
  for (size_t i = 0; i < indices.size(); ++i) {
    auto [x, y] = sample(indices[i]);
    in[static_cast<int64_t>(i)].copy_(x);
    tg[static_cast<int64_t>(i)].copy_(y);
  }
  return {in, tg};
}

void TokenDataset::set_loss_mask(std::shared_ptr<LossMaskFile> mask) {
  if (mask) {
    COLOSSAL_CHECK_INPUT(mask->size() == file_->size(), "loss mask ", mask->path(), " covers ",
                         mask->size(), " tokens but ", file_->path(), " holds ", file_->size(),
                         " (were they prepared together?)");
    COLOSSAL_CHECK_INPUT(mask->packed_seq_len() == 0 || mask->packed_seq_len() == seq_len_,
                         mask->path(), ": the records were packed for seq_len ",
                         mask->packed_seq_len(), " but training uses seq_len ", seq_len_,
                         " (prepare again with --pack ", seq_len_, ")");
  }
  mask_ = std::move(mask);
}

void TokenDataset::set_documents(std::vector<uint64_t> offsets, std::string source) {
  COLOSSAL_CHECK_INPUT(!offsets.empty() && offsets.back() == static_cast<uint64_t>(file_->size()),
                       "document index ", source, " ends at token ",
                       offsets.empty() ? 0 : offsets.back(), " but ", file_->path(), " holds ",
                       file_->size(), " tokens (were they prepared together?)");
  docs_ = std::move(offsets);
}

void TokenDataset::set_document_mask(bool on) {
  COLOSSAL_CHECK_INPUT(!on || !docs_.empty(),
                       "the document mask needs the document index of the token file");
  doc_mask_ = on;
}

namespace {

// The distinct document starts t with lo < t <= hi, in order.
std::vector<int64_t> starts_in(const std::vector<uint64_t>& docs, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  auto it = std::upper_bound(docs.begin(), docs.end(), static_cast<uint64_t>(lo));
  for (; it != docs.end() && *it <= static_cast<uint64_t>(hi); ++it) {
    if (out.empty() || out.back() != static_cast<int64_t>(*it))
      out.push_back(static_cast<int64_t>(*it));
  }
  return out;
}

}  // namespace

int64_t TokenDataset::counted_targets(int64_t k) const {
  COLOSSAL_CHECK(k >= 0 && k < num_samples_, "sample ", k, " out of range [0, ", num_samples_, ")");
  const int64_t base = k * seq_len_;
  // Targets are tokens base+1 .. base+S.
  if (!mask_ && !doc_mask_) return seq_len_;
  int64_t n = seq_len_;
  if (mask_) {
    const uint8_t* m = mask_->data() + base + 1;
    n = 0;
    for (int64_t j = 0; j < seq_len_; ++j) n += m[j];
  }
  if (doc_mask_) {
    for (int64_t t : starts_in(docs_, base, base + seq_len_)) {
      if (!mask_ || mask_->data()[t]) --n;  // counted by the mask, dropped as a document start
    }
  }
  return n;
}

Batch TokenDataset::make_batch(const std::vector<int64_t>& indices) const {
  Batch b;
  std::tie(b.inputs, b.targets) = batch(indices);
  const int64_t n = static_cast<int64_t>(indices.size()), S = seq_len_;
  if (mask_) {
    int64_t* tg = b.targets.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* m = mask_->data() + indices[static_cast<size_t>(i)] * S + 1;
      for (int64_t j = 0; j < S; ++j) {
        if (!m[j]) tg[i * S + j] = kIgnore;
      }
    }
  }
  if (!doc_mask_) return b;
  b.position_ids = at::empty({n, S}, at::kLong);
  b.document_ids = at::empty({n, S}, at::kLong);
  int64_t* tg = b.targets.data_ptr<int64_t>();
  int64_t* pos = b.position_ids.data_ptr<int64_t>();
  int64_t* doc = b.document_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t base = indices[static_cast<size_t>(i)] * S;
    const std::vector<int64_t> starts = starts_in(docs_, base, base + S);
    size_t next = 0;
    int64_t p = 0, d = 0;
    for (int64_t j = 0; j < S; ++j) {
      if (next < starts.size() && starts[next] == base + j) {
        ++next;
        p = 0;
        ++d;
      }
      pos[i * S + j] = p++;
      doc[i * S + j] = d;
    }
    // Target j is token base+j+1: a document's first token is not predicted across documents.
    for (int64_t t : starts) tg[i * S + (t - base - 1)] = kIgnore;
  }
  return b;
}

}  // namespace colossal::data
