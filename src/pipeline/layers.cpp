// Layer splits over virtual pipeline stages: the default rule, a user's list, the cost-balanced
// split, and the block ranges of each virtual stage and rank.
#include "colossal/pipeline/layers.h"

#include <cmath>
#include <cstdlib>
#include <limits>

#include "colossal/core/error.h"

namespace colossal::pipeline {

std::vector<int64_t> distribute_layers(int64_t num_layers, int stages, int chunks) {
  COLOSSAL_CHECK_INPUT(stages >= 1 && chunks >= 1, "pipeline: stages (", stages, ") and chunks (",
                       chunks, ") must be >= 1");
  const int64_t v = int64_t{stages} * chunks;
  COLOSSAL_CHECK_INPUT(num_layers >= v, "pipeline: ", num_layers, " decoder layers cannot fill ", v,
                       " virtual stages (", stages, " stages x ", chunks,
                       " chunks); each needs >= 1 layer");
  std::vector<int64_t> out(v, num_layers / v);
  const int64_t r = num_layers % v, start = v / 2 - r / 2;
  for (int64_t i = start; i < start + r; ++i) ++out[i];
  return out;
}

void check_layers_per_stage(const std::vector<int64_t>& layers, int64_t num_layers,
                            int virtual_stages) {
  COLOSSAL_CHECK_INPUT(static_cast<int64_t>(layers.size()) == virtual_stages,
                       "num_layers_per_stage has ", layers.size(), " entries for ", virtual_stages,
                       " virtual stages");
  int64_t sum = 0;
  for (size_t v = 0; v < layers.size(); ++v) {
    COLOSSAL_CHECK_INPUT(layers[v] >= 1, "num_layers_per_stage[", v, "] = ", layers[v],
                         ": every virtual stage needs >= 1 layer");
    sum += layers[v];
  }
  COLOSSAL_CHECK_INPUT(sum == num_layers, "num_layers_per_stage sums to ", sum,
                       " layers; the model has ", num_layers);
}

std::vector<int64_t> balance_layers(int64_t num_layers, int virtual_stages, double layer_cost,
                                    double first_extra, double last_extra) {
  const int64_t L = num_layers, V = virtual_stages;
  COLOSSAL_CHECK_INPUT(V >= 1 && L >= V, "pipeline: ", L, " decoder layers cannot fill ", V,
                       " virtual stages; each needs >= 1 layer");
  COLOSSAL_CHECK_INPUT(std::isfinite(layer_cost) && layer_cost > 0, "balance_layers: layer_cost ",
                       layer_cost, " must be > 0");
  COLOSSAL_CHECK_INPUT(std::isfinite(first_extra) && first_extra >= 0 &&
                           std::isfinite(last_extra) && last_extra >= 0,
                       "balance_layers: first_extra ", first_extra, " and last_extra ", last_extra,
                       " must be finite and >= 0");
  auto cost = [&](int64_t v, int64_t n) {
    return static_cast<double>(n) * layer_cost + (v == 0 ? first_extra : 0.0) +
           (v == V - 1 ? last_extra : 0.0);
  };
  const double inf = std::numeric_limits<double>::infinity();
  // best[v][k]: the least largest cost of stages 0..v-1 holding the first k layers.
  std::vector<std::vector<double>> best(V + 1, std::vector<double>(L + 1, inf));
  best[0][0] = 0;
  for (int64_t v = 1; v <= V; ++v)
    for (int64_t k = v; k <= L - (V - v); ++k)
      for (int64_t n = 1; n <= k - (v - 1); ++n)
        best[v][k] = std::min(best[v][k], std::max(best[v - 1][k - n], cost(v - 1, n)));
  const double limit = best[V][L] * (1 + 1e-12);
  // Among the splits within the optimum: the least sum |n_v - default_v|.
  const std::vector<int64_t> target = distribute_layers(L, static_cast<int>(V), 1);
  const int64_t none = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> dev(V + 1, std::vector<int64_t>(L + 1, none));
  std::vector<std::vector<int64_t>> take(V + 1, std::vector<int64_t>(L + 1, 0));
  dev[0][0] = 0;
  for (int64_t v = 1; v <= V; ++v)
    for (int64_t k = v; k <= L - (V - v); ++k)
      for (int64_t n = 1; n <= k - (v - 1); ++n) {
        if (dev[v - 1][k - n] == none || cost(v - 1, n) > limit) continue;
        const int64_t d = dev[v - 1][k - n] + std::llabs(n - target[v - 1]);
        if (d < dev[v][k]) {
          dev[v][k] = d;
          take[v][k] = n;
        }
      }
  std::vector<int64_t> out(V);
  for (int64_t v = V, k = L; v >= 1; --v) {
    out[v - 1] = take[v][k];
    k -= take[v][k];
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> stage_block_ranges(
    const std::vector<int64_t>& layers_per_virtual_stage) {
  const auto& layers = layers_per_virtual_stage;
  COLOSSAL_CHECK_INPUT(!layers.empty(), "stage_block_ranges: no virtual stages");
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t next = 1;  // block of the next layer
  for (size_t v = 0; v < layers.size(); ++v) {
    COLOSSAL_CHECK_INPUT(layers[v] >= 1, "layers per virtual stage [", v, "] = ", layers[v],
                         ": every virtual stage needs >= 1 layer");
    const int64_t begin = v == 0 ? 0 : next;
    next += layers[v];
    out.push_back({begin, v + 1 == layers.size() ? next + 2 : next});
  }
  return out;
}

std::vector<int> rank_virtual_stages(int virtual_stages, int stages, int rank, bool v_placement) {
  const int V = virtual_stages;
  COLOSSAL_CHECK_INPUT(stages >= 1 && V >= 1 && V % stages == 0, "pipeline: ", V,
                       " virtual stages are not a multiple of ", stages, " stages");
  COLOSSAL_CHECK_INPUT(0 <= rank && rank < stages, "pipeline: rank ", rank, " outside [0, ", stages,
                       ")");
  const int chunks = V / stages;
  COLOSSAL_CHECK_INPUT(!v_placement || chunks == 2, "the V placement takes 2 chunks per rank, got ",
                       chunks);
  std::vector<int> out;
  for (int c = 0; c < chunks; ++c)
    out.push_back(v_placement ? (c == 0 ? rank : 2 * stages - 1 - rank) : c * stages + rank);
  return out;
}

std::vector<std::pair<int64_t, int64_t>> rank_block_ranges(
    const std::vector<int64_t>& layers_per_virtual_stage, int stages, int rank, bool v_placement) {
  const auto all = stage_block_ranges(layers_per_virtual_stage);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int v : rank_virtual_stages(static_cast<int>(all.size()), stages, rank, v_placement))
    out.push_back(all[v]);
  return out;
}

}  // namespace colossal::pipeline
