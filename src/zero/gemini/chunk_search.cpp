// Gemini's chunk size search (ColossalAI's search_chunk_configuration): candidate sizes, greedy
// packing in parameter order, the size that wastes the fewest elements.
#include <algorithm>
#include <numeric>

#include "colossal/core/error.h"
#include "colossal/zero/gemini/chunk_manager.h"
#include "zero/gemini/manager_internal.h"

namespace colossal::zero::gemini {

using namespace detail;

std::pair<int64_t, int64_t> pack(const std::vector<int64_t>& numels, int64_t size, int dp) {
  int64_t chunks = 0, wasted = 0, used = 0;
  bool open = false;
  for (int64_t n : numels) {
    if (n > size) {  // an oversize tensor gets a chunk of its own, rounded up to dp
      chunks += 1;
      wasted += round_up(n, dp) - n;
      continue;
    }
    if (!open || used + n > size) {
      if (open) wasted += size - used;
      chunks += 1;
      used = 0;
      open = true;
    }
    used += n;
  }
  if (open) wasted += size - used;
  return {chunks, wasted};
}

ChunkSearchResult search_chunk_size(const std::vector<int64_t>& numels, int dp,
                                    const ChunkSearchOptions& o) {
  COLOSSAL_CHECK_INPUT(o.search_range_m >= 0, "gemini: search_range_m must be >= 0, got ",
                       o.search_range_m);
  COLOSSAL_CHECK_INPUT(o.min_chunk_size_m > 0, "gemini: min_chunk_size_m must be > 0, got ",
                       o.min_chunk_size_m);
  COLOSSAL_CHECK_INPUT(o.hidden_dim >= 0, "gemini: hidden_dim must be >= 0, got ", o.hidden_dim);
  COLOSSAL_CHECK_INPUT(dp >= 1, "gemini: dp size must be >= 1, got ", dp);
  ChunkSearchResult r;
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  const int64_t min_size = std::max<int64_t>(1, static_cast<int64_t>(o.min_chunk_size_m * kM));
  if (numels.empty()) {
    r.chunk_size = round_up(1, dp);
    return r;
  }
  if (total <= min_size) {  // the whole model is one chunk
    r.chunk_size = round_up(total, dp);
    r.num_chunks = 1;
    r.wasted = r.chunk_size - total;
    r.candidates = 1;
    return r;
  }
  const int64_t interval = o.hidden_dim > 0 ? o.hidden_dim : 1024;
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  const int64_t start = round_up(std::max(min_size, largest), interval);
  const int64_t end = start + static_cast<int64_t>(o.search_range_m * kM);
  int64_t best_waste = -1;
  for (int64_t size = start; size <= end; size += interval) {
    const int64_t s = round_up(size, dp);
    auto [chunks, wasted] = pack(numels, s, dp);
    ++r.candidates;
    if (best_waste < 0 || wasted < best_waste) {
      best_waste = wasted;
      r.chunk_size = s;
      r.num_chunks = chunks;
      r.wasted = wasted;
    }
  }
  return r;
}

}  // namespace colossal::zero::gemini
