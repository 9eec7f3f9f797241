// The demo's built-in data: a synthetic "sort the digits" task the project generates itself
// (no text from elsewhere). An example is
//   BOS d1 .. dK SEP sorted(d1 .. dK) EOS
// with digits as tokens kDigit0..kDigit0+9. Inputs whose value (d1..dK read as a base-10
// number) is divisible by 7 are held out: they never appear in the training stream, so the
// exact-match accuracy on them measures generalisation, not memorisation.
#pragma once

#include <cstdint>
#include <vector>

namespace colossal::data {

struct SortTask {
  static constexpr int64_t kPad = 0, kBos = 1, kSep = 2, kEos = 3, kDigit0 = 4;
  int64_t length = 6;  // K digits per example

  int64_t example_tokens() const { return 2 * length + 3; }
  // The prompt (BOS d.. SEP) and the expected answer (sorted digits) of digit list d.
  std::vector<int64_t> prompt(const std::vector<int64_t>& digits) const;
  std::vector<int64_t> answer(const std::vector<int64_t>& digits) const;
  bool held_out(const std::vector<int64_t>& digits) const;
  // `count` random digit lists from `seed`, all held out (held_out = true) or none.
  std::vector<std::vector<int64_t>> draw(int64_t count, uint64_t seed, bool held_out) const;
  // A training stream of `num_tokens` tokens: whole examples back to back (non-held-out only).
  std::vector<int64_t> training_stream(int64_t num_tokens, uint64_t seed) const;
};

}  // namespace colossal::data
