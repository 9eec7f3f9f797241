// UTF-8 validation (colossal/data/utf8.h).
#include "colossal/data/utf8.h"

namespace colossal::data {

size_t utf8_valid_at(std::string_view s, size_t i, size_t* bad) {
  auto at = [&](size_t k) -> int {
    return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : -1;
  };
  int c = at(0);
  *bad = 1;
  if (c < 0x80) return 1;
  int n = 0, lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k <= n; ++k) {
    int x = at(k);
    int l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (x < l || x > h) {
      *bad = static_cast<size_t>(k);
      return 0;
    }
  }
  return static_cast<size_t>(n + 1);
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 1;
    size_t n = utf8_valid_at(s, i, &bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

size_t first_invalid_utf8(std::string_view s) {
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    const size_t n = utf8_valid_at(s, i, &bad);
    if (!n) return i;
    i += n;
  }
  return std::string_view::npos;
}

}  // namespace colossal::data
