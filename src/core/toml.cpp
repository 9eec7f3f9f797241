// TOML subset parser (see colossal/core/toml.h for what is accepted). A hand-written
// recursive-descent reader over one line-aware cursor; every error carries the line.
#include "colossal/core/toml.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "colossal/core/error.h"

namespace colossal::toml {
namespace {

using json::Value;

std::string join(const std::vector<std::string>& path, size_t n = std::string::npos) {
  std::string out;
  for (size_t i = 0; i < path.size() && i < n; ++i) {
    if (i) out += '.';
    out += path[i];
  }
  return out;
}

class Parser {
 public:
  Parser(std::string_view text, std::string_view source) : s_(text), source_(source) {}

  Value run() {
    Value root = Value::object();
    std::vector<std::string> table;  // current [table] path
    while (true) {
      skip_ws_comments_newlines();
      if (eof()) break;
      if (peek() == '[') {
        if (pos_ + 1 < s_.size() && s_[pos_ + 1] == '[')
          fail("arrays of tables ([[...]]) are not supported; use an array of inline tables");
        ++pos_;
        skip_ws();
        table = parse_key();
        skip_ws();
        expect(']', "to close the table header");
        std::string name = join(table);
        descend(root, table, table.size(), true);  // rejects values and inline tables first
        if (!defined_tables_.insert(name).second) fail("table [", name, "] is defined twice");
        end_of_line();
        continue;
      }
      std::vector<std::string> key = parse_key();
      std::vector<std::string> full = table;
      full.insert(full.end(), key.begin(), key.end());
      skip_ws();
      if (eof() || peek() != '=') fail("expected '=' after key '", join(full), "'");
      ++pos_;
      skip_ws();
      key_ = join(full);
      Value v = parse_value(full);
      Value* parent = descend(root, full, full.size() - 1, false);
      auto& obj = parent->as_object_mut();
      for (auto& kv : obj)
        if (kv.first == full.back()) fail("key '", join(full), "' is defined twice");
      if (v.is_object()) frozen_.insert(join(full));
      assigned_.insert(join(full));
      obj.emplace_back(full.back(), std::move(v));
      end_of_line();
    }
    return root;
  }

 private:
  template <class... A>
  [[noreturn]] void fail(A&&... a) {
    std::string where = key_.empty() ? "" : str(" (key '", key_, "')");
    throw InputError(str(source_, ":", line_, ": ", std::forward<A>(a)..., where));
  }

  bool eof() const { return pos_ >= s_.size(); }
  char peek() const { return s_[pos_]; }
  void expect(char c, const char* what) {
    if (eof() || peek() != c) fail("expected '", c, "' ", what);
    ++pos_;
  }
  void skip_ws() {
    while (!eof() && (peek() == ' ' || peek() == '\t')) ++pos_;
  }
  void skip_comment() {
    if (!eof() && peek() == '#')
      while (!eof() && peek() != '\n') ++pos_;
  }
  void newline() {
    if (!eof() && peek() == '\r') {
      ++pos_;
      if (eof() || peek() != '\n') fail("stray carriage return");
    }
    if (!eof() && peek() == '\n') {
      ++pos_;
      ++line_;
    }
  }
  void skip_ws_comments_newlines() {
    while (true) {
      skip_ws();
      skip_comment();
      if (!eof() && (peek() == '\n' || peek() == '\r')) {
        newline();
        continue;
      }
      break;
    }
  }
  void end_of_line() {
    skip_ws();
    skip_comment();
    if (eof()) return;
    if (peek() != '\n' && peek() != '\r')
      fail("unexpected '", peek(), "' after the value; one key = value per line");
    newline();
    key_.clear();
  }

  // Walks (and creates) nested objects along path[0..n). Inline tables and values that are
  // not tables cannot be extended.
  Value* descend(Value& root, const std::vector<std::string>& path, size_t n, bool header) {
    Value* cur = &root;
    for (size_t i = 0; i < n; ++i) {
      auto& obj = cur->as_object_mut();
      Value* next = nullptr;
      for (auto& kv : obj)
        if (kv.first == path[i]) next = &kv.second;
      std::string prefix = join(path, i + 1);
      if (!next) {
        obj.emplace_back(path[i], Value::object());
        next = &obj.back().second;
      } else if (!next->is_object()) {
        fail("'", prefix, "' is already a value of type ", next->type_name(), ", not a table");
      } else if (frozen_.count(prefix)) {
        fail("inline table '", prefix, "' cannot be extended");
      }
      cur = next;
    }
    (void)header;
    return cur;
  }

  static bool bare_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  }

  std::vector<std::string> parse_key() {
    std::vector<std::string> parts;
    while (true) {
      skip_ws();
      if (eof()) fail("expected a key");
      char c = peek();
      if (c == '"') {
        parts.push_back(parse_basic_string());
      } else if (c == '\'') {
        parts.push_back(parse_literal_string());
      } else if (bare_char(c)) {
        size_t b = pos_;
        while (!eof() && bare_char(peek())) ++pos_;
        parts.emplace_back(s_.substr(b, pos_ - b));
      } else {
        fail("unexpected '", c, "' where a key was expected");
      }
      skip_ws();
      if (!eof() && peek() == '.') {
        ++pos_;
        continue;
      }
      return parts;
    }
  }

  void append_utf8(std::string& out, uint32_t cp) {
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("invalid unicode escape");
    json::append_utf8(out, cp);
  }

  std::string parse_basic_string() {
    ++pos_;  // opening quote
    if (s_.substr(pos_, 2) == "\"\"") fail("multi-line strings (\"\"\") are not supported");
    std::string out;
    while (true) {
      if (eof() || peek() == '\n') fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (eof()) fail("unterminated string");
      char e = s_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case 'b':
          out += '\b';
          break;
        case 't':
          out += '\t';
          break;
        case 'n':
          out += '\n';
          break;
        case 'f':
          out += '\f';
          break;
        case 'r':
          out += '\r';
          break;
        case 'u':
        case 'U': {
          int n = e == 'u' ? 4 : 8;
          if (pos_ + n > s_.size()) fail("truncated \\", e, " escape");
          uint32_t cp = 0;
          for (int i = 0; i < n; ++i) {
            char h = s_[pos_++];
            cp <<= 4;
            if (h >= '0' && h <= '9')
              cp |= h - '0';
            else if (h >= 'a' && h <= 'f')
              cp |= h - 'a' + 10;
            else if (h >= 'A' && h <= 'F')
              cp |= h - 'A' + 10;
            else
              fail("bad hex digit '", h, "' in \\", e, " escape");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail("unknown escape '\\", e, "' in string");
      }
    }
  }

  std::string parse_literal_string() {
    ++pos_;
    if (s_.substr(pos_, 2) == "''") fail("multi-line strings (''') are not supported");
    size_t b = pos_;
    while (!eof() && peek() != '\'' && peek() != '\n') ++pos_;
    if (eof() || peek() != '\'') fail("unterminated string");
    std::string out(s_.substr(b, pos_ - b));
    ++pos_;
    return out;
  }

  Value parse_value(const std::vector<std::string>& path) {
    if (eof() || peek() == '\n' || peek() == '\r' || peek() == '#') fail("missing value");
    char c = peek();
    if (c == '"') return Value(parse_basic_string());
    if (c == '\'') return Value(parse_literal_string());
    if (c == '[') return parse_array(path);
    if (c == '{') return parse_inline_table(path);
    // A scalar token: everything up to a delimiter.
    size_t b = pos_;
    while (!eof() && peek() != ',' && peek() != ']' && peek() != '}' && peek() != ' ' &&
           peek() != '\t' && peek() != '\n' && peek() != '\r' && peek() != '#')
      ++pos_;
    std::string tok(s_.substr(b, pos_ - b));
    if (tok == "true") return Value(true);
    if (tok == "false") return Value(false);
    return parse_number(tok);
  }

  Value parse_number(const std::string& tok) {
    std::string t = tok;
    bool is_float = false;
    // Underscores must sit between digits.
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i] == '_' &&
          (i == 0 || i + 1 == t.size() || !std::isxdigit(static_cast<unsigned char>(t[i - 1])) ||
           !std::isxdigit(static_cast<unsigned char>(t[i + 1]))))
        fail("invalid value '", tok, "'");
    std::string clean;
    for (char ch : t)
      if (ch != '_') clean += ch;
    std::string body = clean;
    bool neg = false;
    if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
      neg = body[0] == '-';
      body = body.substr(1);
    }
    if (body == "inf") return Value(neg ? -HUGE_VAL : HUGE_VAL);
    if (body == "nan") return Value(std::nan(""));
    if (body.empty()) fail("invalid value '", tok, "'");
    if (body.size() > 4 && std::isdigit(static_cast<unsigned char>(body[0])) &&
        (body.find('-', 1) != std::string::npos || body.find(':') != std::string::npos) &&
        body.find_first_of("eE") == std::string::npos)
      fail("dates and times are not supported ('", tok, "'); use a string");
    if (body.size() > 2 && body[0] == '0' && (body[1] == 'x' || body[1] == 'o' || body[1] == 'b')) {
      if (clean[0] == '+' || clean[0] == '-')
        fail("invalid value '", tok, "' (no sign on 0x/0o/0b)");
      int base = body[1] == 'x' ? 16 : body[1] == 'o' ? 8 : 2;
      errno = 0;
      char* end = nullptr;
      unsigned long long u = std::strtoull(body.c_str() + 2, &end, base);
      if (*end != '\0' || errno == ERANGE || u > 0x7fffffffffffffffULL)
        fail("invalid integer '", tok, "'");
      return Value(static_cast<long long>(u));
    }
    for (char ch : body) {
      if (ch == '.' || ch == 'e' || ch == 'E')
        is_float = true;
      else if (!std::isdigit(static_cast<unsigned char>(ch)) && ch != '+' && ch != '-')
        fail("invalid value '", tok, "' (strings need quotes)");
    }
    if (!std::isdigit(static_cast<unsigned char>(body[0]))) fail("invalid value '", tok, "'");
    if (body.size() > 1 && body[0] == '0' && std::isdigit(static_cast<unsigned char>(body[1])))
      fail("invalid value '", tok, "' (leading zeros are not allowed)");
    errno = 0;
    char* end = nullptr;
    if (is_float) {
      size_t dot = body.find('.');
      if (dot != std::string::npos &&
          (dot + 1 >= body.size() || !std::isdigit(static_cast<unsigned char>(body[dot + 1]))))
        fail("invalid float '", tok, "' (a digit must follow '.')");
      double d = std::strtod(clean.c_str(), &end);
      if (*end != '\0') fail("invalid float '", tok, "'");
      return Value(d);
    }
    long long v = std::strtoll(clean.c_str(), &end, 10);
    if (*end != '\0') fail("invalid integer '", tok, "'");
    if (errno == ERANGE) fail("integer '", tok, "' is out of the 64-bit range");
    return Value(v);
  }

  Value parse_array(const std::vector<std::string>& path) {
    ++pos_;
    Value arr = Value::array();
    while (true) {
      skip_ws_comments_newlines();
      if (eof()) fail("unterminated array");
      if (peek() == ']') {
        ++pos_;
        return arr;
      }
      arr.push_back(parse_value(path));
      skip_ws_comments_newlines();
      if (eof()) fail("unterminated array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != ']') fail("expected ',' or ']' in array, got '", peek(), "'");
    }
  }

  Value parse_inline_table(const std::vector<std::string>& path) {
    ++pos_;
    Value tbl = Value::object();
    skip_ws();
    if (!eof() && peek() == '}') {
      ++pos_;
      return tbl;
    }
    std::set<std::string> frozen_inner;
    while (true) {
      std::vector<std::string> key = parse_key();
      skip_ws();
      expect('=', "after a key in an inline table");
      skip_ws();
      Value v = parse_value(path);
      Value* cur = &tbl;
      for (size_t i = 0; i + 1 < key.size(); ++i) {
        auto& obj = cur->as_object_mut();
        Value* next = nullptr;
        for (auto& kv : obj)
          if (kv.first == key[i]) next = &kv.second;
        if (!next) {
          obj.emplace_back(key[i], Value::object());
          next = &obj.back().second;
        } else if (!next->is_object() || frozen_inner.count(join(key, i + 1))) {
          fail("key '", join(key, i + 1), "' in an inline table cannot be extended");
        }
        cur = next;
      }
      auto& obj = cur->as_object_mut();
      for (auto& kv : obj)
        if (kv.first == key.back())
          fail("key '", join(key), "' is defined twice in an inline table");
      if (v.is_object()) frozen_inner.insert(join(key));
      obj.emplace_back(key.back(), std::move(v));
      skip_ws();
      if (eof()) fail("unterminated inline table");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return tbl;
      }
      fail("expected ',' or '}' in inline table, got '", peek(), "'");
    }
  }

  std::string_view s_;
  std::string source_;
  size_t pos_ = 0;
  int line_ = 1;
  std::string key_;
  std::set<std::string> defined_tables_, assigned_, frozen_;
};

}  // namespace

json::Value parse(std::string_view text, std::string_view source) {
  return Parser(text, source).run();
}

json::Value parse_file(const std::string& path) {
  // A folder opens as a stream that reads nothing: it would be an empty config (every option
  // its default) instead of the file the user meant.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(str("TOML file ", path, " is a folder, not a file"));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(str("cannot open TOML file ", path, ": ", std::strerror(errno)));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw InputError(str("cannot read TOML file ", path, ": ", std::strerror(errno)));
  return parse(ss.str(), path);
}

}  // namespace colossal::toml
