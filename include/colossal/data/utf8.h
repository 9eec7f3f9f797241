// UTF-8 validation shared by the tokenizers and `colossal prepare`: the Unicode "maximal
// subpart" rules (those of Rust's from_utf8_lossy, which `tokenizers` uses): overlong forms,
// surrogates and code points above U+10FFFF are invalid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace colossal::data {

// Length of the valid UTF-8 sequence at s[i], or 0 when the bytes there are not one; `bad`
// receives how many bytes the invalid prefix spans (at least 1).
size_t utf8_valid_at(std::string_view s, size_t i, size_t* bad);

// Offset of the first byte that does not start a valid sequence, or std::string_view::npos.
size_t first_invalid_utf8(std::string_view s);

// Every maximal invalid subpart replaced by one U+FFFD (Rust's String::from_utf8_lossy).
std::string utf8_lossy(std::string_view s);

// Decoding text already validated (undefined on invalid UTF-8): the length of the sequence
// that starts with byte `b`, and the code point of the sequence at s[i].
inline size_t utf8_len(unsigned char b) {
  return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

inline uint32_t utf8_decode(std::string_view s, size_t i) {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return c;
  if (c < 0xE0) return ((c & 0x1Fu) << 6) | (b(1) & 0x3Fu);
  if (c < 0xF0) return ((c & 0x0Fu) << 12) | ((b(1) & 0x3Fu) << 6) | (b(2) & 0x3Fu);
  return ((c & 0x07u) << 18) | ((b(1) & 0x3Fu) << 12) | ((b(2) & 0x3Fu) << 6) | (b(3) & 0x3Fu);
}

}  // namespace colossal::data
