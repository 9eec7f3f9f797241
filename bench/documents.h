// Packed documents for the attention benchmarks (issue 25): lengths from a log-normal (median
// ~400 tokens, long tail; a stand-in for a corpus's length distribution), packed into b rows
// of s tokens: a document that does not fit is cut at the row's end and goes on in the next
// row, as packing does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace colossal::bench {

inline std::vector<int64_t> packed_documents(int64_t b, int64_t s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> len(6.0, 1.0);
  std::vector<int64_t> docs;
  int64_t carry = 0;
  for (int64_t row = 0; row < b; ++row) {
    int64_t left = s;
    while (left > 0) {
      int64_t l = carry > 0 ? carry : std::max<int64_t>(16, int64_t(len(rng)));
      const int64_t take = std::min(l, left);
      docs.push_back(take);
      carry = l - take;
      left -= take;
    }
  }
  return docs;
}

// Given document lengths (a corpus's, in order; cycled when they run out) packed into b rows of
// s tokens, cut at row ends as packing cuts them.
inline std::vector<int64_t> pack_lengths(const std::vector<int64_t>& lengths, int64_t b,
                                         int64_t s) {
  std::vector<int64_t> docs;
  if (lengths.empty()) return std::vector<int64_t>(static_cast<size_t>(b), s);
  size_t next = 0;
  int64_t carry = 0;
  for (int64_t row = 0; row < b; ++row) {
    int64_t left = s;
    while (left > 0) {
      int64_t l = carry > 0 ? carry : lengths[next++ % lengths.size()];
      const int64_t take = std::min(l, left);
      docs.push_back(take);
      carry = l - take;
      left -= take;
    }
  }
  return docs;
}

}  // namespace colossal::bench
