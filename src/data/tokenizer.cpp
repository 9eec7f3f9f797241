// Hugging Face tokenizer.json (BPE) with the `tokenizers` package's exact pipeline; see
// include/colossal/data/tokenizer.h. Each component below follows the package's Rust code
// (tokenizers/src/...) closely, including its corner cases, because the goal is identical ids.
#include "colossal/data/tokenizer.h"
#include "colossal/data/utf8.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "colossal/core/error.h"
#include "colossal/core/json.h"

#if COLOSSAL_WITH_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace colossal::data {
namespace {

using json::Value;

// ---- UTF-8 -----------------------------------------------------------------------------------

// utf8_len / utf8_decode of validated text: data/utf8.h.

bool utf8_valid(std::string_view s, size_t* where) {
  *where = first_invalid_utf8(s);
  return *where == std::string_view::npos;
}

void append_cp(std::string& out, uint32_t cp) {
  json::append_utf8(out, cp);
}

// Rust's char::is_whitespace: the White_Space property (a closed list in Unicode).
inline bool is_ws(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

std::string utf16_to_utf8(const std::u16string& u) {
  std::string out;
  for (size_t i = 0; i < u.size(); ++i) {
    uint32_t c = u[i];
    if (c >= 0xD800 && c <= 0xDBFF && i + 1 < u.size()) {
      c = 0x10000 + ((c - 0xD800) << 10) + (u[i + 1] - 0xDC00);
      ++i;
    }
    append_cp(out, c);
  }
  return out;
}

std::u16string utf8_to_utf16(std::string_view s);

// ICU, loaded when a file first needs it (its normalization forms and lowercasing). Loaded at
// run time rather than linked: ICU's soname and symbol names carry its major version (72 on
// Debian 12, 74 on Ubuntu 24.04), so a binary linked against one could not start where only the
// other is installed, and the tokenizers of most files never need it. Missing ICU is an error
// naming what needs it, never a skipped normalizer.
struct Icu {
  using GetInstance = const void* (*)(int*);
  using Normalize = int32_t (*)(const void*, const char16_t*, int32_t, char16_t*, int32_t, int*);
  using ToLower = int32_t (*)(char16_t*, int32_t, const char16_t*, int32_t, const char*, int*);
  GetInstance instance[4] = {};  // NFC, NFD, NFKC, NFKD
  Normalize normalize = nullptr;
  ToLower to_lower = nullptr;
  std::string error;

  Icu() {
    void* h = nullptr;
    std::string suffix;
    for (int v = 90; v >= 50 && !h; --v) {
      h = dlopen(str("libicuuc.so.", v).c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h) suffix = str("_", v);
    }
    if (!h) {
      error = "ICU's libicuuc.so.<version> could not be loaded (install libicu, e.g. libicu72)";
      return;
    }
    auto sym = [&](const char* name) {
      void* f = dlsym(h, (std::string(name) + suffix).c_str());
      return f ? f : dlsym(h, name);  // an ICU built without versioned symbol names
    };
    const char* names[4] = {"unorm2_getNFCInstance", "unorm2_getNFDInstance",
                            "unorm2_getNFKCInstance", "unorm2_getNFKDInstance"};
    for (int k = 0; k < 4; ++k) instance[k] = reinterpret_cast<GetInstance>(sym(names[k]));
    normalize = reinterpret_cast<Normalize>(sym("unorm2_normalize"));
    to_lower = reinterpret_cast<ToLower>(sym("u_strToLower"));
    for (auto f : instance)
      if (!f) error = "libicuuc lacks unorm2_get*Instance";
    if (!normalize || !to_lower) error = "libicuuc lacks unorm2_normalize or u_strToLower";
  }
};

const Icu& icu(const std::string& needed_by) {
  static const Icu i;
  if (!i.error.empty()) throw InputError(str(needed_by, " needs ICU: ", i.error));
  return i;
}

constexpr int kIcuBufferOverflow = 15;  // U_BUFFER_OVERFLOW_ERROR

// ---- Hashing with string_view lookups ------------------------------------------------------

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, SvHash, std::equal_to<>>;

// ---- Regex (PCRE2) ---------------------------------------------------------------------------

// A JIT stack per thread: long whitespace runs against `\s+(?!\S)` need more than PCRE2's
// default 32 KiB machine-stack JIT area.
pcre2_jit_stack* thread_jit_stack(void*) {
  struct Holder {
    pcre2_jit_stack* s = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
    ~Holder() { pcre2_jit_stack_free(s); }
  };
  thread_local Holder h;
  return h.s;
}

pcre2_match_data* thread_match_data() {
  struct Holder {
    pcre2_match_data* md = pcre2_match_data_create(64, nullptr);
    ~Holder() { pcre2_match_data_free(md); }
  };
  thread_local Holder h;
  return h.md;
}

// The White_Space property as a class body: Oniguruma's `\s` (what the package's patterns
// mean). PCRE2 10.42's UCP `\s` also takes U+180E, which Unicode 6.3 moved out of White_Space.
constexpr const char* kWhiteSpaceClass =
    "\\t-\\r "
    "\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

// Letters and numbers Unicode 15 and 16 added, which the package's Oniguruma has and PCRE2
// 10.42 (Unicode 14) lacks: measured by classifying every code point with both engines
// (`tokenizers` 0.23.2 against PCRE2 10.42; the differences are additions only). Adding them to
// `\p{L}` / `\p{N}` is harmless on a newer PCRE2 that has them already.
constexpr const char* kExtraLetters =
    "\\x{1c89}-\\x{1c8a}\\x{a7cb}-\\x{a7cd}\\x{a7da}-\\x{a7dc}\\x{105c0}-\\x{105f3}\\x{10d4a}-"
    "\\x{10d65}\\x{10d6f}-\\x{10d85}\\x{10ec2}-\\x{10ec4}\\x{1123f}-\\x{11240}\\x{11380}-\\x{11389}"
    "\\x{1138b}\\x{1138e}\\x{11390}-\\x{113b5}\\x{113b7}\\x{113d1}\\x{113d3}\\x{11bc0}-\\x{11be0}"
    "\\x{11f02}\\x{11f04}-\\x{11f10}\\x{11f12}-\\x{11f33}\\x{1342f}\\x{13441}-\\x{13446}\\x{13460}-"
    "\\x{143fa}\\x{16100}-\\x{1611d}\\x{16d40}-\\x{16d6c}\\x{18cff}\\x{1b132}\\x{1b155}\\x{1df25}-"
    "\\x{1df2a}\\x{1e030}-\\x{1e06d}\\x{1e4d0}-\\x{1e4eb}\\x{1e5d0}-\\x{1e5ed}\\x{1e5f0}\\x{2b739}"
    "\\x{2ebf0}-\\x{2ee5d}\\x{31350}-\\x{323af}";
constexpr const char* kExtraNumbers =
    "\\x{10d40}-\\x{10d49}\\x{116d0}-\\x{116e3}\\x{11bf0}-\\x{11bf9}\\x{11f50}-\\x{11f59}\\x{16130}"
    "-"
    "\\x{16139}\\x{16d70}-\\x{16d79}\\x{1ccf0}-\\x{1ccf9}\\x{1d2c0}-\\x{1d2d3}\\x{1e4f0}-\\x{1e4f9}"
    "\\x{1e5f1}-\\x{1e5fa}";

// Rewrites `\s` / `\S` to the White_Space class (inside a class `\s` becomes its body; `\S`
// inside a class has no such rewrite and is left to PCRE2, which differs only on U+180E).
std::string onig_compatible(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 4 < p.size() && (p[i + 1] == 'p' || p[i + 1] == 'P') && p[i + 2] == '{' &&
        (p[i + 3] == 'L' || p[i + 3] == 'N') && p[i + 4] == '}') {
      const bool negated = p[i + 1] == 'P';
      const std::string as_written = p.substr(i, 5);
      const std::string positive = str("\\p{", p[i + 3], "}");
      const char* extra = p[i + 3] == 'L' ? kExtraLetters : kExtraNumbers;
      i += 4;
      if (in_class)
        out += negated ? as_written : positive + extra;  // `\P{..}` in a class: left to PCRE2
      else
        out += str(negated ? "[^" : "[", positive, extra, "]");
      continue;
    }
    if (c == '\\' && i + 1 < p.size()) {
      char n = p[++i];
      if (n == 's')
        out += in_class ? str(kWhiteSpaceClass) : str("[", kWhiteSpaceClass, "]");
      else if (n == 'S' && !in_class)
        out += str("[^", kWhiteSpaceClass, "]");
      else
        out += {c, n};
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

class Regex {
 public:
  Regex(const std::string& original, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    const std::string pattern = onig_compatible(original);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw InputError(str(where, ": regex '", original, "' does not compile (as '", pattern,
                           "') at offset ", off, ": ", reinterpret_cast<const char*>(msg)));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
    mctx_ = pcre2_match_context_create(nullptr);
    if (jit_) pcre2_jit_stack_assign(mctx_, thread_jit_stack, nullptr);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() {
    pcre2_match_context_free(mctx_);
    pcre2_code_free(code_);
  }

  // Non-overlapping matches left to right (an empty match moves on by one character, as the
  // package's onig find_iter does).
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    out.clear();
    pcre2_match_data* md = thread_match_data();
    size_t off = 0;
    while (off <= s.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), off,
                           PCRE2_NO_UTF_CHECK, md, mctx_);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        throw Error(str("tokenizer: regex match failed: ", reinterpret_cast<const char*>(msg)));
      }
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t a = ov[0], b = ov[1];
      out.emplace_back(a, b);
      if (b == a) {
        if (b >= s.size()) break;
        off = b + utf8_len(static_cast<unsigned char>(s[b]));
      } else {
        off = b;
      }
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_context* mctx_ = nullptr;
  bool jit_ = false;
};

// The package's word test for single_word added tokens (Rust regex's Unicode `\w`: Alphabetic,
// marks, decimal digits, connector punctuation, joiners) and Digits' char::is_numeric, through
// PCRE2's Unicode tables plus the letters it lacks.
bool char_matches(uint32_t cp, bool word) {
  static const Regex w(str("^[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200c}\\x{200d}", kExtraLetters,
                           kExtraNumbers, "]"),
                       "tokenizer");
  static const Regex num(str("^[\\p{N}", kExtraNumbers, "]"), "tokenizer");
  std::string one;
  append_cp(one, cp);
  std::vector<std::pair<size_t, size_t>> m;
  (word ? w : num).find_all(one, m);
  return !m.empty();
}
inline bool is_word_char(uint32_t cp) {
  if (cp < 0x80)
    return (cp >= '0' && cp <= '9') || ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') || cp == '_';
  return char_matches(cp, true);
}
inline bool is_numeric(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return char_matches(cp, false);
}

// A Split / Replace pattern: {"Regex": "..."} or {"String": "..."} (a literal).
class Pattern {
 public:
  Pattern(const Value& v, const std::string& where) {
    const auto& o = v.as_object(where);
    if (const Value* r = v.find("Regex")) {
      regex_ = std::make_unique<Regex>(r->as_string(where + ".Regex"), where + ".Regex");
    } else if (const Value* s = v.find("String")) {
      literal_ = s->as_string(where + ".String");
    } else {
      throw InputError(str(where, ": a pattern must be {\"Regex\": ...} or {\"String\": ...}, got ",
                           o.empty() ? std::string("{}") : "key '" + o.front().first + "'"));
    }
  }
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    if (regex_) return regex_->find_all(s, out);
    out.clear();
    if (literal_.empty()) return;
    size_t pos = 0;
    while ((pos = s.find(literal_, pos)) != std::string_view::npos) {
      out.emplace_back(pos, pos + literal_.size());
      pos += literal_.size();
    }
  }

 private:
  std::unique_ptr<Regex> regex_;
  std::string literal_;
};

// ---- Pieces ------------------------------------------------------------------------------

// A stretch of text on its way to the model. `at_start`: it begins at offset 0 of the original
// input (Metaspace's prepend_scheme "first" asks).
struct Piece {
  std::string text;
  bool at_start = false;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

SplitBehavior split_behavior(const std::string& s, const std::string& where) {
  if (s == "Removed") return SplitBehavior::Removed;
  if (s == "Isolated") return SplitBehavior::Isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (s == "Contiguous") return SplitBehavior::Contiguous;
  throw InputError(str(where, ": unknown split behavior '", s,
                       "' (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)"));
}

// NormalizedString::split: `matches` are the pattern's matches in `text`; appends the pieces
// (empty ones dropped, as PreTokenizedString::split does).
void split_pieces(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches,
                  SplitBehavior behavior, bool invert, std::vector<Piece>& out) {
  const std::string& s = p.text;
  struct Span {
    size_t a, b;
    bool m;
  };
  std::vector<Span> spans;
  if (s.empty()) {
    spans.push_back({0, 0, false});
  } else {
    size_t prev = 0;
    for (auto [a, b] : matches) {
      if (prev != a) spans.push_back({prev, a, false});
      spans.push_back({a, b, true});
      prev = b;
    }
    if (prev != s.size()) spans.push_back({prev, s.size(), false});
  }
  if (invert)
    for (auto& sp : spans) sp.m = !sp.m;
  std::vector<Span> res;
  switch (behavior) {
    case SplitBehavior::Isolated:
      res = spans;
      break;
    case SplitBehavior::Removed:
      for (auto& sp : spans)
        if (!sp.m) res.push_back(sp);
      break;
    case SplitBehavior::MergedWithPrevious: {
      bool prev_match = false;
      for (auto& sp : spans) {
        if (sp.m && !prev_match && !res.empty())
          res.back().b = sp.b;
        else
          res.push_back(sp);
        prev_match = sp.m;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool prev_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->m && !prev_match && !res.empty())
          res.back().a = it->a;
        else
          res.push_back(*it);
        prev_match = it->m;
      }
      std::reverse(res.begin(), res.end());
      break;
    }
    case SplitBehavior::Contiguous: {
      bool prev_match = false;
      for (auto& sp : spans) {
        if (sp.m == prev_match && !res.empty())
          res.back().b = sp.b;
        else
          res.push_back(sp);
        prev_match = sp.m;
      }
      break;
    }
  }
  for (auto& sp : res) {
    if (sp.b <= sp.a) continue;
    out.push_back({s.substr(sp.a, sp.b - sp.a), p.at_start && sp.a == 0});
  }
}

// ---- Normalizers ---------------------------------------------------------------------------

struct Normalizer {
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& s) const = 0;
};

struct SequenceNormalizer : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> parts;
  void normalize(std::string& s) const override {
    for (const auto& p : parts) p->normalize(s);
  }
};

std::u16string utf8_to_utf16(std::string_view s) {
  std::u16string u;
  u.reserve(s.size());
  for (size_t i = 0; i < s.size(); i += utf8_len(static_cast<unsigned char>(s[i]))) {
    uint32_t c = utf8_decode(s, i);
    if (c >= 0x10000) {
      c -= 0x10000;
      u.push_back(static_cast<char16_t>(0xD800 + (c >> 10)));
      u.push_back(static_cast<char16_t>(0xDC00 + (c & 0x3FF)));
    } else {
      u.push_back(static_cast<char16_t>(c));
    }
  }
  return u;
}

// Runs an ICU UTF-16 transform that reports the length it needs when the buffer is short.
template <class F>
std::string icu_transform(std::string_view s, const F& f, const char* what) {
  std::u16string src = utf8_to_utf16(s), dst(src.size() * 3 + 16, u'\0');
  int err = 0;
  int32_t n = f(src, dst, &err);
  if (err == kIcuBufferOverflow) {
    dst.assign(static_cast<size_t>(n), u'\0');
    err = 0;
    n = f(src, dst, &err);
  }
  if (err > 0) throw Error(str("tokenizer: ICU ", what, " failed (UErrorCode ", err, ")"));
  dst.resize(static_cast<size_t>(n));
  return utf16_to_utf8(dst);
}

struct IcuNormalizer : Normalizer {
  const Icu* icu = nullptr;
  const void* form = nullptr;
  void normalize(std::string& s) const override {
    bool ascii = true;
    for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
    if (ascii) return;  // every normalization form leaves ASCII as it is
    s = icu_transform(
        s,
        [&](const std::u16string& a, std::u16string& b, int* err) {
          return icu->normalize(form, a.data(), static_cast<int32_t>(a.size()), b.data(),
                                static_cast<int32_t>(b.size()), err);
        },
        "normalization");
  }
};

// NormalizedString::lowercase: per character (char::to_lowercase, no final-sigma context).
struct LowercaseNormalizer : Normalizer {
  const Icu* icu = nullptr;
  void normalize(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
      size_t n = utf8_len(static_cast<unsigned char>(s[i]));
      if (n == 1) {
        char c = s[i];
        out.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c);
      } else {
        out += icu_transform(
            std::string_view(s).substr(i, n),
            [&](const std::u16string& a, std::u16string& b, int* err) {
              return icu->to_lower(b.data(), static_cast<int32_t>(b.size()), a.data(),
                                   static_cast<int32_t>(a.size()), "", err);
            },
            "lowercasing");
      }
      i += n;
    }
    s = std::move(out);
  }
};

struct PrependNormalizer : Normalizer {
  std::string prepend;
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, prepend);
  }
};

struct ReplaceNormalizer : Normalizer {
  std::unique_ptr<Pattern> pattern;
  std::string content;
  void normalize(std::string& s) const override {
    std::vector<std::pair<size_t, size_t>> m;
    pattern->find_all(s, m);
    if (m.empty()) return;
    std::string out;
    size_t prev = 0;
    for (auto [a, b] : m) {
      out.append(s, prev, a - prev);
      out.append(content);
      prev = b;
    }
    out.append(s, prev, std::string::npos);
    s = std::move(out);
  }
};

struct StripNormalizer : Normalizer {
  bool left = false, right = false;
  void normalize(std::string& s) const override {
    size_t a = 0, b = s.size();
    if (left)
      while (a < b) {
        uint32_t cp = utf8_decode(s, a);
        if (!is_ws(cp)) break;
        a += utf8_len(static_cast<unsigned char>(s[a]));
      }
    if (right)
      while (b > a) {
        size_t k = b - 1;
        while (k > a && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        if (!is_ws(utf8_decode(s, k))) break;
        b = k;
      }
    s = s.substr(a, b - a);
  }
};

// ---- Pre-tokenizers ------------------------------------------------------------------------

struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

struct SequencePreTokenizer : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts) p->pre_tokenize(pieces);
  }
};

// The GPT-2 split ByteLevel uses when use_regex is on.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 on.
struct ByteAlphabet {
  std::array<std::string, 256> byte_to_utf8;
  std::unordered_map<uint32_t, uint8_t> char_to_byte;
  ByteAlphabet() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::array<bool, 256> in{};
    for (int b : bs) in[b] = true;
    std::array<uint32_t, 256> cp{};
    for (int b : bs) cp[b] = static_cast<uint32_t>(b);
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b)
      if (!in[b]) cp[b] = 256 + n++;
    for (int b = 0; b < 256; ++b) {
      append_cp(byte_to_utf8[b], cp[b]);
      char_to_byte[cp[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

struct ByteLevelPreTokenizer : PreTokenizer {
  bool add_prefix_space = true;
  std::unique_ptr<Regex> regex;  // null when use_regex is off
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    const auto& alpha = byte_alphabet();
    std::vector<Piece> out;
    std::vector<std::pair<size_t, size_t>> m;
    std::vector<Piece> tmp;
    for (auto& p : pieces) {
      if (add_prefix_space && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
      tmp.clear();
      if (regex) {
        regex->find_all(p.text, m);
        split_pieces(p, m, SplitBehavior::Isolated, false, tmp);
      } else if (!p.text.empty()) {
        tmp.push_back(std::move(p));
      }
      for (auto& t : tmp) {
        std::string mapped;
        mapped.reserve(t.text.size() * 2);
        for (unsigned char c : t.text) mapped.append(alpha.byte_to_utf8[c]);
        out.push_back({std::move(mapped), t.at_start});
      }
    }
    pieces = std::move(out);
  }
};

struct SplitPreTokenizer : PreTokenizer {
  std::unique_ptr<Pattern> pattern;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    std::vector<std::pair<size_t, size_t>> m;
    for (const auto& p : pieces) {
      pattern->find_all(p.text, m);
      split_pieces(p, m, behavior, invert, out);
    }
    pieces = std::move(out);
  }
};

enum class PrependScheme { Always, First, Never };

struct MetaspacePreTokenizer : PreTokenizer {
  std::string replacement;  // one character
  PrependScheme scheme = PrependScheme::Always;
  bool split = true;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    std::vector<std::pair<size_t, size_t>> m;
    for (auto& p : pieces) {
      std::string r;
      r.reserve(p.text.size() + replacement.size());
      for (char c : p.text) {
        if (c == ' ')
          r.append(replacement);
        else
          r.push_back(c);
      }
      bool starts = r.compare(0, replacement.size(), replacement) == 0;
      if ((scheme == PrependScheme::Always && !starts) ||
          (scheme == PrependScheme::First && !starts && p.at_start))
        r.insert(0, replacement);
      Piece q{std::move(r), p.at_start};
      if (!split) {
        if (!q.text.empty()) out.push_back(std::move(q));
        continue;
      }
      m.clear();
      for (size_t pos = 0; (pos = q.text.find(replacement, pos)) != std::string::npos;
           pos += replacement.size())
        m.emplace_back(pos, pos + replacement.size());
      split_pieces(q, m, SplitBehavior::MergedWithNext, false, out);
    }
    pieces = std::move(out);
  }
};

// Digits: each digit alone (individual_digits) or runs of digits, isolated.
struct DigitsPreTokenizer : PreTokenizer {
  bool individual = false;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    std::vector<std::pair<size_t, size_t>> m;
    for (const auto& p : pieces) {
      m.clear();
      const std::string& s = p.text;
      for (size_t i = 0; i < s.size();) {
        size_t n = utf8_len(static_cast<unsigned char>(s[i]));
        bool digit = is_numeric(utf8_decode(s, i));
        if (digit) {
          if (!individual && !m.empty() && m.back().second == i)
            m.back().second = i + n;
          else
            m.emplace_back(i, i + n);
        }
        i += n;
      }
      split_pieces(p, m, individual ? SplitBehavior::Isolated : SplitBehavior::Contiguous, false,
                   out);
    }
    pieces = std::move(out);
  }
};

// ---- Decoders ------------------------------------------------------------------------------

struct Decoder {
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

struct SequenceDecoder : Decoder {
  std::vector<std::unique_ptr<Decoder>> parts;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts) p->decode_chain(tokens);
  }
};

// A token whose every character is in the byte alphabet becomes those bytes; any other token
// keeps its own UTF-8 bytes; the whole is read back with from_utf8_lossy.
struct ByteLevelDecoder : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    const auto& alpha = byte_alphabet();
    std::string bytes;
    for (const auto& t : tokens) {
      size_t mark = bytes.size();
      bool ok = true;
      for (size_t i = 0; i < t.size();) {
        auto it = alpha.char_to_byte.find(utf8_decode(t, i));
        if (it == alpha.char_to_byte.end()) {
          ok = false;
          break;
        }
        bytes.push_back(static_cast<char>(it->second));
        i += utf8_len(static_cast<unsigned char>(t[i]));
      }
      if (!ok) {
        bytes.resize(mark);
        bytes.append(t);
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

struct ReplaceDecoder : Decoder {
  std::unique_ptr<Pattern> pattern;
  std::string content;
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::pair<size_t, size_t>> m;
    for (auto& t : tokens) {
      pattern->find_all(t, m);
      if (m.empty()) continue;
      std::string out;
      size_t prev = 0;
      for (auto [a, b] : m) {
        out.append(t, prev, a - prev);
        out.append(content);
        prev = b;
      }
      out.append(t, prev, std::string::npos);
      t = std::move(out);
    }
  }
};

// `<0xNN>` tokens become bytes; a run of them that is not valid UTF-8 becomes one U+FFFD per
// byte (tokenizers' ByteFallback decoder).
struct ByteFallbackDecoder : Decoder {
  static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  // u8::from_str_radix(&token[3..5], 16), which also takes a leading '+'.
  static int byte_of(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    if (t[3] == '+') return hexval(t[4]);
    int h = hexval(t[3]), l = hexval(t[4]);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    auto flush = [&] {
      if (bytes.empty()) return;
      size_t where = 0;
      if (utf8_valid(bytes, &where)) {
        out.push_back(bytes);
      } else {
        for (size_t k = 0; k < bytes.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      bytes.clear();
    };
    for (auto& t : tokens) {
      int b = byte_of(t);
      if (b >= 0) {
        bytes.push_back(static_cast<char>(b));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

struct FuseDecoder : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Strip up to `start` leading and `stop` trailing copies of the character `content`.
struct StripDecoder : Decoder {
  std::string content;
  int64_t start = 0, stop = 0;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      size_t a = 0, b = t.size();
      for (int64_t k = 0; k < start && t.compare(a, content.size(), content) == 0 && a < b; ++k)
        a += content.size();
      for (int64_t k = 0; k < stop && b >= a + content.size() &&
                          t.compare(b - content.size(), content.size(), content) == 0;
           ++k)
        b -= content.size();
      t = t.substr(a, b - a);
    }
  }
};

struct MetaspaceDecoder : Decoder {
  std::string replacement;
  PrependScheme scheme = PrependScheme::Always;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t k = 0; k < t.size();) {
        if (t.compare(k, replacement.size(), replacement) == 0) {
          if (!(i == 0 && scheme != PrependScheme::Never)) out.push_back(' ');
          k += replacement.size();
        } else {
          out.push_back(t[k++]);
        }
      }
      tokens[i] = std::move(out);
    }
  }
};

// ---- BPE -------------------------------------------------------------------------------------

struct MergeInfo {
  int32_t rank;
  int32_t new_id;
};

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct Bpe {
  Vocab vocab;
  std::vector<std::string> id_to_token;  // "" for ids with no token
  std::unordered_map<uint64_t, MergeInfo> merges;
  std::array<int32_t, 256> byte_ids{};  // <0xNN> ids, -1 when absent
  std::optional<std::string> unk_token;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::string prefix, suffix;  // continuing_subword_prefix, end_of_word_suffix

  // The word cache: words repeat (Zipf), and merging is the costly step. Sharded so that
  // concurrent encode() calls rarely meet on one lock; a full shard stops taking words (the
  // package's cache also just stops inserting at capacity).
  static constexpr size_t kShards = 64;
  static constexpr size_t kShardCapacity = 4096;
  static constexpr size_t kMaxCachedWord = 256;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, SvHash, std::equal_to<>> map;
  };
  mutable std::array<Shard, kShards> cache;

  struct Symbol {
    int32_t c, prev, next, len;
  };

  void merge_word(std::string_view w, std::vector<int32_t>& out) const {
    std::vector<Symbol> sym;
    sym.reserve(w.size());
    auto add = [&](int32_t id, int32_t len) {
      int32_t n = static_cast<int32_t>(sym.size());
      sym.push_back({id, n - 1, -1, len});
      if (n > 0) sym[n - 1].next = n;
    };
    int32_t unk_id = -1, unk_len = 0;  // a pending unknown (unk_id >= 0): id, byte length
    std::string buf;
    for (size_t i = 0; i < w.size();) {
      size_t n = utf8_len(static_cast<unsigned char>(w[i]));
      bool first = i == 0, last = i + n >= w.size();
      std::string_view s = w.substr(i, n);
      if ((!first && !prefix.empty()) || (last && !suffix.empty())) {
        buf.clear();
        if (!first) buf += prefix;
        buf += s;
        if (last) buf += suffix;
        s = buf;
      }
      auto byte_len = static_cast<int32_t>(n);
      i += n;
      auto it = vocab.find(s);
      if (it != vocab.end()) {
        if (unk_id >= 0) {
          add(unk_id, unk_len);
          unk_id = -1;
        }
        add(it->second, byte_len);
        continue;
      }
      if (byte_fallback) {
        bool all = true;
        for (unsigned char c : s) all = all && byte_ids[c] >= 0;
        if (all) {
          // As the package does, a pending unknown stays pending across these bytes.
          for (unsigned char c : s) add(byte_ids[c], 1);
          continue;
        }
      }
      if (unk_token) {
        auto u = vocab.find(*unk_token);
        if (u == vocab.end())
          throw InputError(str("tokenizer: unk_token '", *unk_token, "' is not in the vocabulary"));
        if (unk_id >= 0 && fuse_unk) {
          unk_len += byte_len;
        } else {
          if (unk_id >= 0) add(unk_id, unk_len);
          unk_id = u->second;
          unk_len = byte_len;
        }
      }
    }
    if (unk_id >= 0) add(unk_id, unk_len);
    merge_all(sym);
    for (const auto& s : sym)
      if (s.len != 0) out.push_back(s.c);
  }

  // Word::merge_all: lowest rank first, then leftmost; stale queue entries are recognised the
  // package's way (the pair at the position no longer yields the entry's new id).
  void merge_all(std::vector<Symbol>& sym) const {
    struct Entry {
      int32_t rank, pos, new_id;
      bool operator<(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Entry> q;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = merges.find(pair_key(sym[i].c, sym[i + 1].c));
      if (it != merges.end()) q.push({it->second.rank, static_cast<int32_t>(i), it->second.new_id});
    }
    const auto n = static_cast<int32_t>(sym.size());
    while (!q.empty()) {
      Entry top = q.top();
      q.pop();
      Symbol& cur = sym[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      int32_t next_pos = cur.next;
      Symbol right = sym[next_pos];
      auto it = merges.find(pair_key(cur.c, right.c));
      if (it == merges.end() || it->second.new_id != top.new_id) continue;
      cur.c = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      sym[next_pos].len = 0;
      if (right.next > -1 && right.next < n) sym[right.next].prev = top.pos;
      if (cur.prev >= 0) {
        auto jt = merges.find(pair_key(sym[cur.prev].c, cur.c));
        if (jt != merges.end()) q.push({jt->second.rank, cur.prev, jt->second.new_id});
      }
      if (cur.next > -1 && cur.next < n) {
        auto jt = merges.find(pair_key(cur.c, sym[cur.next].c));
        if (jt != merges.end()) q.push({jt->second.rank, top.pos, jt->second.new_id});
      }
    }
  }

  void tokenize(std::string_view w, std::vector<int32_t>& out) const {
    if (w.empty()) return;
    if (ignore_merges) {
      auto it = vocab.find(w);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    const bool cacheable = w.size() <= kMaxCachedWord;
    Shard& sh = cache[SvHash{}(w) % kShards];
    if (cacheable) {
      std::lock_guard<std::mutex> lk(sh.mu);
      auto it = sh.map.find(w);
      if (it != sh.map.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t mark = out.size();
    merge_word(w, out);
    if (cacheable) {
      std::lock_guard<std::mutex> lk(sh.mu);
      if (sh.map.size() < kShardCapacity)
        sh.map.emplace(std::string(w), std::vector<int32_t>(out.begin() + mark, out.end()));
    }
  }
};

// ---- Added tokens ---------------------------------------------------------------------------

struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// A leftmost-longest multi-pattern matcher (aho-corasick's MatchKind::LeftmostLongest): at the
// leftmost position where any pattern matches, the longest one; ties go to the pattern added
// first. Patterns are few (tens to hundreds), so a first-byte index and direct comparison do.
class AddedMatcher {
 public:
  void add(std::string pattern, size_t token_index) {
    if (pattern.empty()) return;
    auto b = static_cast<unsigned char>(pattern[0]);
    by_first_[b].push_back(static_cast<int32_t>(pats_.size()));
    pats_.push_back({std::move(pattern), token_index});
  }
  bool empty() const { return pats_.empty(); }
  // Next match at or after `from`: (start, end, token index), or start == npos.
  std::tuple<size_t, size_t, size_t> next(std::string_view s, size_t from) const {
    for (size_t i = from; i < s.size(); ++i) {
      const auto& cands = by_first_[static_cast<unsigned char>(s[i])];
      size_t best_len = 0, best_tok = 0;
      for (int32_t k : cands) {
        const auto& p = pats_[k];
        if (p.text.size() > best_len && s.compare(i, p.text.size(), p.text) == 0) {
          best_len = p.text.size();
          best_tok = p.token;
        }
      }
      if (best_len) return {i, i + best_len, best_tok};
    }
    return {std::string_view::npos, 0, 0};
  }

 private:
  struct Pat {
    std::string text;
    size_t token;
  };
  std::vector<Pat> pats_;
  std::array<std::vector<int32_t>, 256> by_first_;
};

// ---- Post-processors --------------------------------------------------------------------------

struct PostProcessor {
  virtual ~PostProcessor() = default;
  // Only called when special tokens are to be added.
  virtual void process(std::vector<int32_t>& ids) const = 0;
  virtual void template_ids(std::vector<int32_t>& before, std::vector<int32_t>& after) const {}
};

struct SequenceProcessor : PostProcessor {
  std::vector<std::unique_ptr<PostProcessor>> parts;
  void process(std::vector<int32_t>& ids) const override {
    for (const auto& p : parts) p->process(ids);
  }
  void template_ids(std::vector<int32_t>& before, std::vector<int32_t>& after) const override {
    for (const auto& p : parts) p->template_ids(before, after);
  }
};

struct NoopProcessor : PostProcessor {
  void process(std::vector<int32_t>&) const override {}
};

// TemplateProcessing's "single" template (and Bert/Roberta's [CLS] A [SEP]).
struct TemplateProcessor : PostProcessor {
  std::vector<int32_t> before, after;
  void process(std::vector<int32_t>& ids) const override {
    ids.insert(ids.begin(), before.begin(), before.end());
    ids.insert(ids.end(), after.begin(), after.end());
  }
  void template_ids(std::vector<int32_t>& b, std::vector<int32_t>& a) const override {
    b.insert(b.end(), before.begin(), before.end());
    a.insert(a.end(), after.begin(), after.end());
  }
};

// ---- Loading --------------------------------------------------------------------------------

struct Loader {
  std::string source;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InputError(str(source, ": ", field, ": ", what));
  }
  bool opt_bool(const Value& o, const char* key, bool def, const std::string& where) const {
    const Value* v = o.find(key);
    if (!v || v->is_null()) return def;
    return v->as_bool(source + ": " + where + "." + key);
  }
  std::string type_of(const Value& v, const std::string& where) const {
    if (!v.is_object()) fail(where, str("must be an object, got ", v.type_name()));
    const Value* t = v.find("type");
    if (!t || !t->is_string()) fail(where, "has no string \"type\"");
    return t->as_string();
  }
  std::string str_of(const Value& o, const char* key, const std::string& where) const {
    const Value* v = o.find(key);
    if (!v) fail(where, str("missing \"", key, "\""));
    return v->as_string(source + ": " + where + "." + key);
  }
  [[noreturn]] void unknown(const std::string& where, const std::string& type,
                            const char* known) const {
    fail(where, str("unsupported type '", type, "' (this tokenizer implements ", known, ")"));
  }

  std::unique_ptr<Normalizer> normalizer(const Value& v, const std::string& where) const {
    std::string t = type_of(v, where);
    if (t == "Sequence") {
      auto s = std::make_unique<SequenceNormalizer>();
      const auto& arr = v.at("normalizers").as_array(source + ": " + where + ".normalizers");
      for (size_t i = 0; i < arr.size(); ++i)
        s->parts.push_back(normalizer(arr[i], str(where, ".normalizers[", i, "]")));
      return s;
    }
    if (t == "NFC" || t == "NFD" || t == "NFKC" || t == "NFKD") {
      auto n = std::make_unique<IcuNormalizer>();
      n->icu = &icu(str(source, ": ", where, " (", t, ")"));
      int k = t == "NFC" ? 0 : t == "NFD" ? 1 : t == "NFKC" ? 2 : 3;
      int err = 0;
      n->form = n->icu->instance[k](&err);
      if (err > 0 || !n->form) fail(where, str("ICU has no ", t, " (UErrorCode ", err, ")"));
      return n;
    }
    if (t == "Lowercase") {
      auto n = std::make_unique<LowercaseNormalizer>();
      n->icu = &icu(str(source, ": ", where, " (Lowercase)"));
      return n;
    }
    if (t == "Prepend") {
      auto p = std::make_unique<PrependNormalizer>();
      p->prepend = str_of(v, "prepend", where);
      return p;
    }
    if (t == "Replace") {
      auto r = std::make_unique<ReplaceNormalizer>();
      r->pattern = std::make_unique<Pattern>(v.at("pattern"), source + ": " + where + ".pattern");
      r->content = str_of(v, "content", where);
      return r;
    }
    if (t == "Strip") {
      auto s = std::make_unique<StripNormalizer>();
      s->left = opt_bool(v, "strip_left", true, where);
      s->right = opt_bool(v, "strip_right", true, where);
      return s;
    }
    unknown(where, t, "Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip");
  }

  PrependScheme prepend_scheme(const Value& v, const std::string& where) const {
    if (const Value* p = v.find("prepend_scheme"); p && !p->is_null()) {
      const std::string& s = p->as_string(source + ": " + where + ".prepend_scheme");
      if (s == "always") return PrependScheme::Always;
      if (s == "first") return PrependScheme::First;
      if (s == "never") return PrependScheme::Never;
      fail(where + ".prepend_scheme", str("unknown value '", s, "' (always, first, never)"));
    }
    // Files written before prepend_scheme existed say add_prefix_space.
    return opt_bool(v, "add_prefix_space", true, where) ? PrependScheme::Always
                                                        : PrependScheme::Never;
  }

  std::string one_char(const Value& v, const char* key, const std::string& where) const {
    std::string s = str_of(v, key, where);
    if (s.empty() || utf8_len(static_cast<unsigned char>(s[0])) != s.size())
      fail(where + "." + key, str("must be one character, got '", s, "'"));
    return s;
  }

  std::unique_ptr<PreTokenizer> pre_tokenizer(const Value& v, const std::string& where) const {
    std::string t = type_of(v, where);
    if (t == "Sequence") {
      auto s = std::make_unique<SequencePreTokenizer>();
      const auto& arr = v.at("pretokenizers").as_array(source + ": " + where + ".pretokenizers");
      for (size_t i = 0; i < arr.size(); ++i)
        s->parts.push_back(pre_tokenizer(arr[i], str(where, ".pretokenizers[", i, "]")));
      return s;
    }
    if (t == "ByteLevel") {
      auto b = std::make_unique<ByteLevelPreTokenizer>();
      b->add_prefix_space = opt_bool(v, "add_prefix_space", true, where);
      if (opt_bool(v, "use_regex", true, where))
        b->regex = std::make_unique<Regex>(kGpt2Pattern, source + ": ByteLevel");
      return b;
    }
    if (t == "Split") {
      auto s = std::make_unique<SplitPreTokenizer>();
      s->pattern = std::make_unique<Pattern>(v.at("pattern"), source + ": " + where + ".pattern");
      s->behavior = split_behavior(str_of(v, "behavior", where), source + ": " + where);
      s->invert = opt_bool(v, "invert", false, where);
      return s;
    }
    if (t == "Metaspace") {
      auto m = std::make_unique<MetaspacePreTokenizer>();
      m->replacement = one_char(v, "replacement", where);
      m->scheme = prepend_scheme(v, where);
      m->split = opt_bool(v, "split", true, where);
      return m;
    }
    if (t == "Digits") {
      auto d = std::make_unique<DigitsPreTokenizer>();
      d->individual = opt_bool(v, "individual_digits", false, where);
      return d;
    }
    unknown(where, t, "Sequence, ByteLevel, Split, Metaspace, Digits");
  }

  std::unique_ptr<Decoder> decoder(const Value& v, const std::string& where) const {
    std::string t = type_of(v, where);
    if (t == "Sequence") {
      auto s = std::make_unique<SequenceDecoder>();
      const auto& arr = v.at("decoders").as_array(source + ": " + where + ".decoders");
      for (size_t i = 0; i < arr.size(); ++i)
        s->parts.push_back(decoder(arr[i], str(where, ".decoders[", i, "]")));
      return s;
    }
    if (t == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
    if (t == "Replace") {
      auto r = std::make_unique<ReplaceDecoder>();
      r->pattern = std::make_unique<Pattern>(v.at("pattern"), source + ": " + where + ".pattern");
      r->content = str_of(v, "content", where);
      return r;
    }
    if (t == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
    if (t == "Fuse") return std::make_unique<FuseDecoder>();
    if (t == "Strip") {
      auto s = std::make_unique<StripDecoder>();
      s->content = one_char(v, "content", where);
      s->start = v.at("start").as_int(source + ": " + where + ".start");
      s->stop = v.at("stop").as_int(source + ": " + where + ".stop");
      return s;
    }
    if (t == "Metaspace") {
      auto m = std::make_unique<MetaspaceDecoder>();
      m->replacement = one_char(v, "replacement", where);
      m->scheme = prepend_scheme(v, where);
      return m;
    }
    unknown(where, t, "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace");
  }

  // The ids of special token `name` from TemplateProcessing's special_tokens map.
  std::vector<int32_t> special_ids(const Value& specials, const std::string& name,
                                   const std::string& where, int32_t max_id) const {
    const Value* s = specials.find(name);
    if (!s) fail(where + ".special_tokens", str("has no entry for '", name, "'"));
    std::vector<int32_t> ids;
    for (const auto& x : s->at("ids").as_array(source + ": " + where + ".special_tokens." + name)) {
      int64_t id = x.as_int(source + ": " + where + ".special_tokens." + name + ".ids");
      if (id < 0 || id > max_id)
        fail(where + ".special_tokens." + name, str("id ", id, " is outside the vocabulary"));
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  }

  std::unique_ptr<PostProcessor> post_processor(const Value& v, const std::string& where,
                                                int32_t max_id) const {
    std::string t = type_of(v, where);
    if (t == "Sequence") {
      auto s = std::make_unique<SequenceProcessor>();
      const auto& arr = v.at("processors").as_array(source + ": " + where + ".processors");
      for (size_t i = 0; i < arr.size(); ++i)
        s->parts.push_back(post_processor(arr[i], str(where, ".processors[", i, "]"), max_id));
      return s;
    }
    // ByteLevel only trims offsets; ids pass unchanged.
    if (t == "ByteLevel") return std::make_unique<NoopProcessor>();
    if (t == "TemplateProcessing") {
      auto p = std::make_unique<TemplateProcessor>();
      const Value& specials = v.at("special_tokens");
      bool seen_a = false;
      const auto& single = v.at("single").as_array(source + ": " + where + ".single");
      for (size_t i = 0; i < single.size(); ++i) {
        std::string w = str(where, ".single[", i, "]");
        if (const Value* sp = single[i].find("SpecialToken")) {
          auto ids = special_ids(specials, str_of(*sp, "id", w), where, max_id);
          auto& dst = seen_a ? p->after : p->before;
          dst.insert(dst.end(), ids.begin(), ids.end());
        } else if (const Value* sq = single[i].find("Sequence")) {
          std::string id = str_of(*sq, "id", w);
          if (id != "A" || seen_a)
            fail(w, str("the single template must hold sequence A exactly once, got '", id, "'"));
          seen_a = true;
        } else {
          fail(w, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
        }
      }
      if (!seen_a) fail(where + ".single", "has no {\"Sequence\": {\"id\": \"A\"}}");
      return p;
    }
    if (t == "BertProcessing" || t == "RobertaProcessing") {
      auto p = std::make_unique<TemplateProcessor>();
      auto id_of = [&](const char* key) {
        const auto& a = v.at(key).as_array(source + ": " + where + "." + key);
        if (a.size() != 2) fail(where + "." + key, "must be [token, id]");
        int64_t id = a[1].as_int(source + ": " + where + "." + key);
        if (id < 0 || id > max_id) fail(where + "." + key, str("id ", id, " is out of range"));
        return static_cast<int32_t>(id);
      };
      p->before.push_back(id_of("cls"));
      p->after.push_back(id_of("sep"));
      return p;
    }
    unknown(where, t, "Sequence, ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing");
  }
};

constexpr int64_t kMaxId = (int64_t{1} << 31) - 2;

}  // namespace

// ---- The tokenizer ---------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string source;
  Bpe bpe;
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  Vocab added_by_content;
  std::unordered_set<std::string> special_contents;
  AddedMatcher raw_matcher, normalized_matcher;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;
  int32_t max_id = -1;
  bool byte_level = false;  // a ByteLevel pre-tokenizer or decoder: tokens spell bytes

  // AddedVocabulary::split_with_indices over `p`: added-token matches become token pieces
  // (`out_ids` >= 0), the rest text pieces (-1).
  // `out_starts`, when given, receives each piece's byte offset in `p`.
  void split_added(const Piece& p, const AddedMatcher& m, std::vector<Piece>& out_text,
                   std::vector<int32_t>& out_ids, std::vector<size_t>* out_starts = nullptr) const {
    const std::string& s = p.text;
    if (m.empty() || s.empty()) {
      if (!s.empty()) {
        out_text.push_back(p);
        out_ids.push_back(-1);
        if (out_starts) out_starts->push_back(0);
      }
      return;
    }
    size_t start_offset = 0, from = 0;
    auto emit = [&](size_t a, size_t b, int32_t id) {
      if (b <= a) return;
      out_text.push_back({s.substr(a, b - a), p.at_start && a == 0});
      out_ids.push_back(id);
      if (out_starts) out_starts->push_back(a);
    };
    while (true) {
      auto [start, stop, tok] = m.next(s, from);
      if (start == std::string_view::npos) break;
      from = stop;
      const AddedToken& t = added[tok];
      if (t.single_word) {
        bool start_space = true, stop_space = true;
        if (start > 0) {
          size_t k = start - 1;
          while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          uint32_t c = utf8_decode(s, k);
          start_space = !is_word_char(c);
        }
        if (stop < s.size()) {
          uint32_t c = utf8_decode(s, stop);
          stop_space = !is_word_char(c);
        }
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) {
        size_t k = start;
        while (k > 0) {
          size_t j = k - 1;
          while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
          if (!is_ws(utf8_decode(s, j))) break;
          k = j;
        }
        start = std::max(k, start_offset);
      }
      if (t.rstrip) {
        while (stop < s.size()) {
          uint32_t c = utf8_decode(s, stop);
          if (!is_ws(c)) break;
          stop += utf8_len(static_cast<unsigned char>(s[stop]));
        }
      }
      if (start_offset < start) emit(start_offset, start, -1);
      emit(start, stop, t.id);
      start_offset = stop;
    }
    if (start_offset != s.size()) emit(start_offset, s.size(), -1);
  }

  void check_utf8(std::string_view text) const {
    size_t bad = 0;
    if (!utf8_valid(text, &bad))
      throw InputError(
          str("tokenizer ", source, ": the text is not valid UTF-8 (byte offset ", bad, ")"));
  }

  // Steps 2 and 3 of encoding for one text piece left by the raw added-token split: normalize
  // it, split out the normalized added tokens, pre-tokenize and run the model.
  void encode_text_piece(Piece piece, std::vector<int32_t>& ids) const {
    std::vector<Piece> pieces2;
    std::vector<int32_t> ids2;
    if (normalizer) normalizer->normalize(piece.text);
    split_added(piece, normalized_matcher, pieces2, ids2);
    std::vector<Piece> words;
    for (size_t i = 0; i < pieces2.size(); ++i) {
      if (ids2[i] >= 0) {
        ids.push_back(ids2[i]);
        continue;
      }
      words.clear();
      words.push_back(std::move(pieces2[i]));
      if (pre_tokenizer) pre_tokenizer->pre_tokenize(words);
      for (const auto& w : words) bpe.tokenize(w.text, ids);
    }
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special) const {
    check_utf8(text);
    std::vector<int32_t> ids;
    // 1. Added tokens matched on the raw text; 2. and 3. for the text between them.
    std::vector<Piece> pieces;
    std::vector<int32_t> piece_ids;
    split_added(Piece{std::string(text), true}, raw_matcher, pieces, piece_ids);
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (piece_ids[i] >= 0)
        ids.push_back(piece_ids[i]);
      else
        encode_text_piece(std::move(pieces[i]), ids);
    }
    if (add_special && post_processor) post_processor->process(ids);
    return ids;
  }

  // The bytes a token stands for: an added token's content; a byte-level token's string mapped
  // back through the byte alphabet; otherwise the string with `▁` read as a space and `<0xNN>`
  // as byte NN (SentencePiece-style vocabularies).
  void append_surface(int32_t id, std::string& out) const {
    if (auto it = added_by_id.find(id); it != added_by_id.end()) {
      out += added[it->second].content;
      return;
    }
    if (id < 0 || static_cast<size_t>(id) >= bpe.id_to_token.size()) return;
    const std::string& t = bpe.id_to_token[id];
    if (byte_level) {
      const auto& alpha = byte_alphabet();
      for (size_t i = 0; i < t.size();) {
        const size_t n = std::min(utf8_len(static_cast<unsigned char>(t[i])), t.size() - i);
        auto it = alpha.char_to_byte.find(utf8_decode(t, i));
        if (it != alpha.char_to_byte.end())
          out.push_back(static_cast<char>(it->second));
        else
          out.append(t, i, n);
        i += n;
      }
      return;
    }
    if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
        std::isxdigit(static_cast<unsigned char>(t[3])) &&
        std::isxdigit(static_cast<unsigned char>(t[4]))) {
      out.push_back(static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
      return;
    }
    static const std::string kMeta = "\xE2\x96\x81";  // U+2581
    for (size_t i = 0; i < t.size();) {
      if (t.compare(i, kMeta.size(), kMeta) == 0) {
        out.push_back(' ');
        i += kMeta.size();
      } else {
        out.push_back(t[i++]);
      }
    }
  }

  std::vector<int32_t> encode_with_offsets(std::string_view text,
                                           std::vector<std::pair<size_t, size_t>>& offsets) const {
    check_utf8(text);
    std::vector<int32_t> ids;
    offsets.clear();
    std::vector<Piece> pieces;
    std::vector<int32_t> piece_ids;
    std::vector<size_t> starts;
    split_added(Piece{std::string(text), true}, raw_matcher, pieces, piece_ids, &starts);
    std::string surface;
    std::vector<size_t> ends;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const size_t base = starts[i], len = pieces[i].text.size();
      if (piece_ids[i] >= 0) {
        ids.push_back(piece_ids[i]);
        offsets.emplace_back(base, base + len);
        continue;
      }
      const std::string orig = pieces[i].text;
      const size_t first = ids.size();
      encode_text_piece(std::move(pieces[i]), ids);
      // Where the tokens' bytes spell the piece, each token's span is exact. Where they do not
      // (a normalizer changed the text, a prefix space was added), the common prefix and suffix
      // of the two still map exactly and a span inside the changed middle widens to all of it.
      surface.clear();
      ends.clear();
      for (size_t k = first; k < ids.size(); ++k) {
        append_surface(ids[k], surface);
        ends.push_back(surface.size());
      }
      const size_t n = orig.size(), m = surface.size();
      size_t pre = 0;
      while (pre < n && pre < m && orig[pre] == surface[pre]) ++pre;
      size_t suf = 0;
      while (suf < n - pre && suf < m - pre && orig[n - 1 - suf] == surface[m - 1 - suf]) ++suf;
      auto map = [&](size_t x, bool begin) -> size_t {
        if (x <= pre) return x;
        if (x >= m - suf) return x - (m - suf) + (n - suf);
        return begin ? pre : n - suf;
      };
      size_t prev = 0;
      for (size_t k = 0; k < ends.size(); ++k) {
        size_t a = map(prev, true), b = map(ends[k], false);
        if (b < a) b = a;
        offsets.emplace_back(base + a, base + b);
        prev = ends[k];
      }
    }
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      const std::string* t = nullptr;
      auto it = added_by_id.find(id);
      if (it != added_by_id.end())
        t = &added[it->second].content;
      else if (id >= 0 && static_cast<size_t>(id) < bpe.id_to_token.size() &&
               !bpe.id_to_token[id].empty())
        t = &bpe.id_to_token[id];
      if (!t) continue;
      if (skip_special && special_contents.count(*t)) continue;
      tokens.push_back(*t);
    }
    if (!decoder) {
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i) out += ' ';
        out += tokens[i];
      }
      return out;
    }
    decoder->decode_chain(tokens);
    std::string out;
    for (const auto& t : tokens) out += t;
    return out;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(str(path, ": is a folder, not a tokenizer.json file"));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(str(path, ": cannot open the tokenizer file: ", std::strerror(errno)));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw InputError(str(path, ": cannot read the tokenizer file"));
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  Loader L{source};
  Value root = json::parse(json_text, source);
  if (!root.is_object()) L.fail("(top level)", str("must be an object, got ", root.type_name()));
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  auto nonnull = [&](const char* key) -> const Value* {
    const Value* v = root.find(key);
    return v && !v->is_null() ? v : nullptr;
  };

  // Model.
  const Value* model = nonnull("model");
  if (!model) L.fail("model", "missing: a tokenizer.json needs a model");
  std::string mtype = L.type_of(*model, "model");
  if (mtype != "BPE")
    L.fail("model.type", str("unsupported model type '", mtype,
                             "' (this tokenizer implements BPE; WordPiece, Unigram and WordLevel "
                             "files are not supported)"));
  Bpe& bpe = impl->bpe;
  if (const Value* d = model->find("dropout"); d && !d->is_null() && d->as_double() != 0.0)
    L.fail("model.dropout", "BPE dropout is random; a fixed tokenizer needs null or 0");
  {
    const Value* vocab = model->find("vocab");
    if (!vocab) L.fail("model.vocab", "missing");
    const auto& obj = vocab->as_object(source + ": model.vocab");
    bpe.vocab.reserve(obj.size());
    int64_t max_id = -1;
    for (const auto& [tok, idv] : obj) {
      int64_t id = idv.as_int(source + ": model.vocab[\"" + tok + "\"]");
      if (id < 0 || id > kMaxId)
        L.fail("model.vocab", str("id ", id, " of '", tok, "' is out of range"));
      // Tokens reach the regex engine (decoders' Replace), which is told its input is UTF-8.
      size_t bad = 0;
      if (!utf8_valid(tok, &bad)) L.fail("model.vocab", str("token ", id, " is not valid UTF-8"));
      bpe.vocab[tok] = static_cast<int32_t>(id);
      max_id = std::max(max_id, id);
    }
    bpe.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    for (const auto& [tok, id] : bpe.vocab) bpe.id_to_token[id] = tok;
    impl->max_id = static_cast<int32_t>(max_id);
  }
  auto opt_str = [&](const char* key) -> std::optional<std::string> {
    const Value* v = model->find(key);
    if (!v || v->is_null()) return std::nullopt;
    return v->as_string(source + ": model." + key);
  };
  bpe.unk_token = opt_str("unk_token");
  bpe.prefix = opt_str("continuing_subword_prefix").value_or("");
  bpe.suffix = opt_str("end_of_word_suffix").value_or("");
  bpe.fuse_unk = L.opt_bool(*model, "fuse_unk", false, "model");
  bpe.byte_fallback = L.opt_bool(*model, "byte_fallback", false, "model");
  bpe.ignore_merges = L.opt_bool(*model, "ignore_merges", false, "model");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = bpe.vocab.find(std::string_view(name));
    bpe.byte_ids[b] = it == bpe.vocab.end() ? -1 : it->second;
  }
  {
    const Value* merges = model->find("merges");
    if (!merges) L.fail("model.merges", "missing");
    const auto& arr = merges->as_array(source + ": model.merges");
    bpe.merges.reserve(arr.size());
    for (size_t i = 0; i < arr.size(); ++i) {
      std::string a, b;
      std::string where = str("model.merges[", i, "]");
      if (arr[i].is_string()) {
        const std::string& s = arr[i].as_string();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          L.fail(where, str("'", s, "' must be two tokens separated by one space"));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (arr[i].is_array() && arr[i].size() == 2) {
        a = arr[i].as_array()[0].as_string(source + ": " + where + "[0]");
        b = arr[i].as_array()[1].as_string(source + ": " + where + "[1]");
      } else {
        L.fail(where, str("must be \"a b\" or [\"a\", \"b\"], got ", arr[i].dump()));
      }
      auto ia = bpe.vocab.find(a), ib = bpe.vocab.find(b);
      if (ia == bpe.vocab.end()) L.fail(where, str("token '", a, "' is not in the vocabulary"));
      if (ib == bpe.vocab.end()) L.fail(where, str("token '", b, "' is not in the vocabulary"));
      std::string merged = a;
      if (!bpe.prefix.empty() && b.compare(0, bpe.prefix.size(), bpe.prefix) == 0)
        merged += b.substr(bpe.prefix.size());
      else
        merged += b;
      auto im = bpe.vocab.find(merged);
      if (im == bpe.vocab.end())
        L.fail(where, str("the merged token '", merged, "' is not in the vocabulary"));
      bpe.merges[pair_key(ia->second, ib->second)] = {static_cast<int32_t>(i), im->second};
    }
  }
  if (bpe.unk_token && !bpe.vocab.count(*bpe.unk_token))
    L.fail("model.unk_token", str("'", *bpe.unk_token, "' is not in the vocabulary"));

  // Normalizer first: normalized added tokens are matched in their normalized form.
  if (const Value* n = nonnull("normalizer")) impl->normalizer = L.normalizer(*n, "normalizer");
  if (const Value* p = nonnull("pre_tokenizer"))
    impl->pre_tokenizer = L.pre_tokenizer(*p, "pre_tokenizer");
  if (const Value* d = nonnull("decoder")) impl->decoder = L.decoder(*d, "decoder");
  {
    // Byte-level vocabularies: a ByteLevel step anywhere in the pre-tokenizer or decoder.
    std::function<bool(const Value&)> has_byte_level = [&](const Value& v) {
      if (v.is_array()) {
        for (const auto& e : v.as_array())
          if (has_byte_level(e)) return true;
      } else if (v.is_object()) {
        for (const auto& [k, e] : v.as_object()) {
          if (k == "type" && e.is_string() && e.as_string() == "ByteLevel") return true;
          if (has_byte_level(e)) return true;
        }
      }
      return false;
    };
    const Value* p = nonnull("pre_tokenizer");
    const Value* d = nonnull("decoder");
    impl->byte_level = (p && has_byte_level(*p)) || (d && has_byte_level(*d));
  }

  if (const Value* at = nonnull("added_tokens")) {
    const auto& arr = at->as_array(source + ": added_tokens");
    for (size_t i = 0; i < arr.size(); ++i) {
      std::string where = str("added_tokens[", i, "]");
      const Value& t = arr[i];
      if (!t.is_object()) L.fail(where, str("must be an object, got ", t.type_name()));
      AddedToken a;
      if (!t.find("id")) L.fail(where, "missing \"id\"");
      int64_t id = t.at("id").as_int(source + ": " + where + ".id");
      if (id < 0 || id > kMaxId) L.fail(where + ".id", str("id ", id, " is out of range"));
      a.id = static_cast<int32_t>(id);
      a.content = L.str_of(t, "content", where);
      if (a.content.empty()) L.fail(where + ".content", "is empty");
      size_t bad = 0;
      if (!utf8_valid(a.content, &bad)) L.fail(where + ".content", "is not valid UTF-8");
      a.special = L.opt_bool(t, "special", false, where);
      a.single_word = L.opt_bool(t, "single_word", false, where);
      a.lstrip = L.opt_bool(t, "lstrip", false, where);
      a.rstrip = L.opt_bool(t, "rstrip", false, where);
      a.normalized = L.opt_bool(t, "normalized", !a.special, where);
      impl->max_id = std::max(impl->max_id, a.id);
      impl->added_by_id[a.id] = impl->added.size();
      impl->added_by_content[a.content] = a.id;
      if (a.special) impl->special_contents.insert(a.content);
      impl->added.push_back(std::move(a));
    }
    for (size_t i = 0; i < impl->added.size(); ++i) {
      const AddedToken& a = impl->added[i];
      if (!a.normalized) {
        impl->raw_matcher.add(a.content, i);
      } else {
        std::string pat = a.content;
        if (impl->normalizer) impl->normalizer->normalize(pat);
        impl->normalized_matcher.add(pat, i);
      }
    }
  }
  if (const Value* p = nonnull("post_processor"))
    impl->post_processor = L.post_processor(*p, "post_processor", impl->max_id);
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

std::vector<int32_t> Tokenizer::encode_with_offsets(
    std::string_view text, std::vector<std::pair<size_t, size_t>>& offsets) const {
  return impl_->encode_with_offsets(text, offsets);
}

int64_t Tokenizer::vocab_size() const {
  return int64_t{impl_->max_id} + 1;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return it->second;
  if (auto it = impl_->bpe.vocab.find(token); it != impl_->bpe.vocab.end()) return it->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end())
    return impl_->added[it->second].content;
  if (id >= 0 && static_cast<size_t>(id) < impl_->bpe.id_to_token.size())
    return impl_->bpe.id_to_token[id];
  return {};
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

std::optional<int32_t> Tokenizer::bos_id() const {
  std::vector<int32_t> before, after;
  if (impl_->post_processor) impl_->post_processor->template_ids(before, after);
  if (before.empty()) return std::nullopt;
  return before.front();
}

std::optional<int32_t> Tokenizer::eos_id() const {
  std::vector<int32_t> before, after;
  if (impl_->post_processor) impl_->post_processor->template_ids(before, after);
  if (after.empty()) return std::nullopt;
  return after.back();
}

}  // namespace colossal::data

#else  // !COLOSSAL_WITH_PCRE2: the library builds, and using a tokenizer says what is missing.

namespace colossal::data {

struct Tokenizer::Impl {};

Tokenizer Tokenizer::from_file(const std::string& path) {
  return from_json("", path);
}
Tokenizer Tokenizer::from_json(std::string_view, const std::string& source) {
  throw InputError(str(source,
                       ": this build has no tokenizer support: PCRE2 was not found when it "
                       "was configured (apt-get install libpcre2-dev, or point "
                       "COLOSSAL_PCRE2_ROOT at its headers and library, and rebuild)"));
}
Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;
std::vector<int32_t> Tokenizer::encode(std::string_view, bool) const {
  return {};
}
std::vector<int32_t> Tokenizer::encode_with_offsets(std::string_view,
                                                    std::vector<std::pair<size_t, size_t>>&) const {
  return {};
}
std::string Tokenizer::decode(const std::vector<int32_t>&, bool) const {
  return {};
}
int64_t Tokenizer::vocab_size() const {
  return 0;
}
std::optional<int32_t> Tokenizer::token_to_id(std::string_view) const {
  return std::nullopt;
}
std::string Tokenizer::id_to_token(int32_t) const {
  return {};
}
bool Tokenizer::is_special(int32_t) const {
  return false;
}
std::optional<int32_t> Tokenizer::bos_id() const {
  return std::nullopt;
}
std::optional<int32_t> Tokenizer::eos_id() const {
  return std::nullopt;
}

}  // namespace colossal::data

#endif  // COLOSSAL_WITH_PCRE2
