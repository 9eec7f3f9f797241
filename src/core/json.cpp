// JSON parser and writer (RFC 8259): strict, with positions in every error.
#include "colossal/core/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "colossal/core/error.h"

namespace colossal::json {

const char* Value::type_name() const {
  switch (type_) {
    case Type::Null:
      return "null";
    case Type::Bool:
      return "bool";
    case Type::Int:
      return "integer";
    case Type::Double:
      return "number";
    case Type::String:
      return "string";
    case Type::Array:
      return "array";
    case Type::Object:
      return "object";
  }
  return "?";
}

namespace {
[[noreturn]] void type_error(std::string_view what, const char* want, const Value& v) {
  throw InputError(str(what, ": expected ", want, ", got ", v.type_name()));
}
}  // namespace

bool Value::as_bool(std::string_view what) const {
  if (type_ != Type::Bool) type_error(what, "a bool", *this);
  return b_;
}
int64_t Value::as_int(std::string_view what) const {
  if (type_ == Type::Int) return i_;
  if (type_ == Type::Double && std::nearbyint(d_) == d_ && std::fabs(d_) < 9.007199254740992e15)
    return static_cast<int64_t>(d_);
  type_error(what, "an integer", *this);
}
double Value::as_double(std::string_view what) const {
  if (type_ == Type::Double) return d_;
  if (type_ == Type::Int) return static_cast<double>(i_);
  type_error(what, "a number", *this);
}
const std::string& Value::as_string(std::string_view what) const {
  if (type_ != Type::String) type_error(what, "a string", *this);
  return s_;
}
const Value::Array& Value::as_array(std::string_view what) const {
  if (type_ != Type::Array) type_error(what, "an array", *this);
  return a_;
}
const Value::Object& Value::as_object(std::string_view what) const {
  if (type_ != Type::Object) type_error(what, "an object", *this);
  return o_;
}
Value::Array& Value::as_array_mut() {
  if (type_ != Type::Array) type_error("value", "an array", *this);
  return a_;
}
Value::Object& Value::as_object_mut() {
  if (type_ != Type::Object) type_error("value", "an object", *this);
  return o_;
}

const Value* Value::find(std::string_view key) const {
  if (type_ != Type::Object) return nullptr;
  for (const auto& kv : o_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}
const Value& Value::at(std::string_view key) const {
  const Value* v = find(key);
  if (!v) throw InputError(str("missing key \"", key, "\""));
  return *v;
}
Value& Value::set(std::string key, Value v) {
  if (type_ == Type::Null) type_ = Type::Object;
  if (type_ != Type::Object) type_error(key, "an object to set a key in", *this);
  for (auto& kv : o_)
    if (kv.first == key) return kv.second = std::move(v);
  o_.emplace_back(std::move(key), std::move(v));
  return o_.back().second;
}
void Value::push_back(Value v) {
  if (type_ == Type::Null) type_ = Type::Array;
  if (type_ != Type::Array) type_error("push_back", "an array", *this);
  a_.push_back(std::move(v));
}
size_t Value::size() const {
  if (type_ == Type::Array) return a_.size();
  if (type_ == Type::Object) return o_.size();
  return 0;
}

bool operator==(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.type_ == Value::Type::Int && b.type_ == Value::Type::Int) return a.i_ == b.i_;
    return a.as_double() == b.as_double();
  }
  if (a.type_ != b.type_) return false;
  switch (a.type_) {
    case Value::Type::Null:
      return true;
    case Value::Type::Bool:
      return a.b_ == b.b_;
    case Value::Type::String:
      return a.s_ == b.s_;
    case Value::Type::Array:
      return a.a_ == b.a_;
    case Value::Type::Object:
      return a.o_ == b.o_;
    default:
      return false;
  }
}

namespace {
void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}
void newline(std::string& out, int indent, int depth) {
  if (indent < 0) return;
  out += '\n';
  out.append(static_cast<size_t>(indent * depth), ' ');
}
}  // namespace

void Value::dump_to(std::string& out, int indent, int depth) const {
  switch (type_) {
    case Type::Null:
      out += "null";
      break;
    case Type::Bool:
      out += b_ ? "true" : "false";
      break;
    case Type::Int:
      out += std::to_string(i_);
      break;
    case Type::Double: {
      if (!std::isfinite(d_)) {
        out += "null";  // JSON has no inf/nan
        break;
      }
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", d_);
      std::string s = buf;
      if (s.find_first_of(".eE") == std::string::npos) s += ".0";
      out += s;
      break;
    }
    case Type::String:
      dump_string(out, s_);
      break;
    case Type::Array: {
      out += '[';
      for (size_t i = 0; i < a_.size(); ++i) {
        if (i) out += indent < 0 ? "," : ",";
        newline(out, indent, depth + 1);
        a_[i].dump_to(out, indent, depth + 1);
      }
      if (!a_.empty()) newline(out, indent, depth);
      out += ']';
      break;
    }
    case Type::Object: {
      out += '{';
      for (size_t i = 0; i < o_.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, depth + 1);
        dump_string(out, o_[i].first);
        out += indent < 0 ? ":" : ": ";
        o_[i].second.dump_to(out, indent, depth + 1);
      }
      if (!o_.empty()) newline(out, indent, depth);
      out += '}';
      break;
    }
  }
}

std::string Value::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

namespace {
class Parser {
 public:
  Parser(std::string_view text, std::string_view source, int max_depth)
      : t_(text), src_(source), max_depth_(max_depth) {}

  Value document() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (p_ != t_.size()) fail("unexpected trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(std::string_view what) {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < p_ && i < t_.size(); ++i) {
      if (t_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw InputError(str(src_, ": invalid JSON: ", what, " at line ", line, " column ", col));
  }
  void skip_ws() {
    while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r'))
      ++p_;
  }
  char peek() {
    if (p_ >= t_.size()) fail("unexpected end of input");
    return t_[p_];
  }
  void expect(std::string_view word) {
    if (t_.substr(p_, word.size()) != word) fail(str("expected '", word, "'"));
    p_ += word.size();
  }
  Value value(int depth) {
    if (depth > max_depth_) fail(str("nesting deeper than ", max_depth_));
    char c = peek();
    switch (c) {
      case '{':
        return object(depth);
      case '[':
        return array(depth);
      case '"':
        return Value(string());
      case 't':
        expect("true");
        return Value(true);
      case 'f':
        expect("false");
        return Value(false);
      case 'n':
        expect("null");
        return Value();
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return number();
        fail(str("unexpected character '", c, "'"));
    }
  }
  Value object(int depth) {
    ++p_;
    Value v = Value::object();
    std::unordered_set<std::string>
        seen;  // O(1) duplicate check: safetensors headers hold 10^4+ keys
    skip_ws();
    if (peek() == '}') {
      ++p_;
      return v;
    }
    while (true) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      skip_ws();
      if (peek() != ':') fail("expected ':'");
      ++p_;
      skip_ws();
      Value item = value(depth + 1);
      if (!seen.insert(key).second) fail(str("duplicate key \"", key, "\""));
      v.as_object_mut().emplace_back(std::move(key), std::move(item));
      skip_ws();
      char c = peek();
      ++p_;
      if (c == '}') return v;
      if (c != ',') {
        --p_;
        fail("expected ',' or '}'");
      }
    }
  }
  Value array(int depth) {
    ++p_;
    Value v = Value::array();
    skip_ws();
    if (peek() == ']') {
      ++p_;
      return v;
    }
    while (true) {
      skip_ws();
      v.push_back(value(depth + 1));
      skip_ws();
      char c = peek();
      ++p_;
      if (c == ']') return v;
      if (c != ',') {
        --p_;
        fail("expected ',' or ']'");
      }
    }
  }
  uint32_t hex4() {
    if (p_ + 4 > t_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = t_[p_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<uint32_t>(c - 'A' + 10);
      else
        fail("bad hex digit in \\u escape");
    }
    return v;
  }
  std::string string() {
    ++p_;  // opening quote
    std::string out;
    while (true) {
      if (p_ >= t_.size()) fail("unterminated string");
      char c = t_[p_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (p_ >= t_.size()) fail("unterminated escape");
      char e = t_[p_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (t_.substr(p_, 2) != "\\u") fail("unpaired surrogate");
            p_ += 2;
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail(str("bad escape '\\", e, "'"));
      }
    }
  }
  Value number() {
    size_t start = p_;
    bool integral = true;
    if (t_[p_] == '-') ++p_;
    if (p_ >= t_.size() || !(t_[p_] >= '0' && t_[p_] <= '9')) fail("bad number");
    if (t_[p_] == '0') {
      ++p_;
    } else {
      while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
    }
    if (p_ < t_.size() && t_[p_] == '.') {
      integral = false;
      ++p_;
      if (p_ >= t_.size() || !(t_[p_] >= '0' && t_[p_] <= '9')) fail("bad fraction");
      while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
    }
    if (p_ < t_.size() && (t_[p_] == 'e' || t_[p_] == 'E')) {
      integral = false;
      ++p_;
      if (p_ < t_.size() && (t_[p_] == '+' || t_[p_] == '-')) ++p_;
      if (p_ >= t_.size() || !(t_[p_] >= '0' && t_[p_] <= '9')) fail("bad exponent");
      while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
    }
    std::string tok(t_.substr(start, p_ - start));
    if (integral) {
      errno = 0;
      char* end = nullptr;
      long long v = std::strtoll(tok.c_str(), &end, 10);
      if (errno == 0) return Value(v);
      // out of int64 range (e.g. a uint64 near 2^64): keep as double
    }
    return Value(std::strtod(tok.c_str(), nullptr));
  }

  std::string_view t_;
  std::string_view src_;
  int max_depth_;
  size_t p_ = 0;
};
}  // namespace

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

Value parse(std::string_view text, std::string_view source, int max_depth) {
  return Parser(text, source, max_depth).document();
}

Value parse_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(str("cannot open ", path));
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse(ss.str(), path);
}

}  // namespace colossal::json
