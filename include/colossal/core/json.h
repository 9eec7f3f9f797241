// A small JSON value with a strict parser and a writer: HF config.json, safetensors headers,
// checkpoint indexes and metrics lines. Parsing treats its input as untrusted: depth and size
// limits, and every error names where it happened and in what.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace colossal::json {

class Value {
 public:
  enum class Type { Null, Bool, Int, Double, String, Array, Object };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;  // insertion order kept

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : type_(Type::Bool), b_(b) {}
  Value(int v) : type_(Type::Int), i_(v) {}
  Value(long v) : type_(Type::Int), i_(v) {}
  Value(long long v) : type_(Type::Int), i_(v) {}
  Value(unsigned v) : type_(Type::Int), i_(v) {}
  Value(unsigned long v) : type_(Type::Int), i_(static_cast<int64_t>(v)) {}
  Value(unsigned long long v) : type_(Type::Int), i_(static_cast<int64_t>(v)) {}
  Value(double v) : type_(Type::Double), d_(v) {}
  Value(std::string s) : type_(Type::String), s_(std::move(s)) {}
  Value(const char* s) : type_(Type::String), s_(s) {}
  Value(std::string_view s) : type_(Type::String), s_(s) {}
  Value(Array a) : type_(Type::Array), a_(std::move(a)) {}
  Value(Object o) : type_(Type::Object), o_(std::move(o)) {}

  static Value object() { return Value(Object{}); }
  static Value array() { return Value(Array{}); }

  Type type() const { return type_; }
  const char* type_name() const;
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_int() const { return type_ == Type::Int; }
  bool is_number() const { return type_ == Type::Int || type_ == Type::Double; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }

  // Typed access; a wrong type throws colossal::InputError naming `what` (e.g. the key path).
  bool as_bool(std::string_view what = "value") const;
  int64_t as_int(std::string_view what = "value") const;    // integral numbers only
  double as_double(std::string_view what = "value") const;  // ints convert
  const std::string& as_string(std::string_view what = "value") const;
  const Array& as_array(std::string_view what = "value") const;
  const Object& as_object(std::string_view what = "value") const;
  Array& as_array_mut();
  Object& as_object_mut();

  // Objects: find returns nullptr when absent; at throws naming the key; set inserts or replaces.
  const Value* find(std::string_view key) const;
  bool contains(std::string_view key) const { return find(key) != nullptr; }
  const Value& at(std::string_view key) const;
  Value& set(std::string key, Value v);
  // Arrays
  void push_back(Value v);
  size_t size() const;

  // Compact (indent < 0) or pretty with `indent` spaces. Doubles round-trip (%.17g).
  std::string dump(int indent = -1) const;

  friend bool operator==(const Value& a, const Value& b);

 private:
  void dump_to(std::string& out, int indent, int depth) const;
  Type type_ = Type::Null;
  bool b_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  Array a_;
  Object o_;
};

// Parses one JSON document (trailing whitespace allowed, nothing else). Errors throw
// colossal::InputError: "<source>: <problem> at line L column C". Nesting deeper than
// `max_depth` is refused (hostile headers must not overflow the stack).
Value parse(std::string_view text, std::string_view source = "JSON", int max_depth = 256);

// Reads and parses a file; errors name the path.
Value parse_file(const std::string& path);

// Appends code point `cp` (<= 0x10FFFF, not a surrogate: the caller checks) as UTF-8. Shared by
// the JSON and TOML parsers' \u escapes.
void append_utf8(std::string& out, uint32_t cp);

}  // namespace colossal::json
