// UTF-8 validation shared by the tokenizers and `colossal prepare`: the Unicode "maximal
// subpart" rules (those of Rust's from_utf8_lossy, which `tokenizers` uses): overlong forms,
// surrogates and code points above U+10FFFF are invalid.
#pragma once

#include <cstddef>
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

}  // namespace colossal::data
