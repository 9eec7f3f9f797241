#include "colossal/data/sort_task.h"

#include <algorithm>

#include "colossal/core/error.h"

namespace colossal::data {
namespace {
// splitmix64: portable, so the demo data is the same on every machine.
uint64_t next(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

std::vector<int64_t> SortTask::prompt(const std::vector<int64_t>& d) const {
  std::vector<int64_t> out{kBos};
  for (int64_t x : d) out.push_back(kDigit0 + x);
  out.push_back(kSep);
  return out;
}

std::vector<int64_t> SortTask::answer(const std::vector<int64_t>& d) const {
  std::vector<int64_t> s = d;
  std::sort(s.begin(), s.end());
  for (auto& x : s) x += kDigit0;
  return s;
}

bool SortTask::held_out(const std::vector<int64_t>& d) const {
  uint64_t v = 0;
  for (int64_t x : d) v = v * 10 + static_cast<uint64_t>(x);
  return v % 7 == 0;
}

std::vector<std::vector<int64_t>> SortTask::draw(int64_t count, uint64_t seed,
                                                 bool want_held_out) const {
  COLOSSAL_CHECK_INPUT(length >= 1 && length <= 18, "sort task: length must be in [1, 18], got ",
                       length);
  std::vector<std::vector<int64_t>> out;
  uint64_t s = seed;
  while (static_cast<int64_t>(out.size()) < count) {
    std::vector<int64_t> d(static_cast<size_t>(length));
    for (auto& x : d) x = static_cast<int64_t>(next(s) % 10);
    if (held_out(d) == want_held_out) out.push_back(std::move(d));
  }
  return out;
}

std::vector<int64_t> SortTask::training_stream(int64_t num_tokens, uint64_t seed) const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_tokens + example_tokens()));
  int64_t n = (num_tokens + example_tokens() - 1) / example_tokens();
  for (const auto& d : draw(n, seed, false)) {
    auto p = prompt(d), a = answer(d);
    out.insert(out.end(), p.begin(), p.end());
    out.insert(out.end(), a.begin(), a.end());
    out.push_back(kEos);
  }
  out.resize(static_cast<size_t>(num_tokens));
  return out;
}

}  // namespace colossal::data
