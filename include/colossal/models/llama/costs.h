// Forward cost per token of each kind of pipeline block, for pipeline::balance_layers: an
// estimate in FLOPs from the config (matrix products and the loss; norms, rotary and
// activations are left out as small next to them).
#pragma once

#include <cstdint>

#include "colossal/models/llama/config.h"

namespace colossal::models {

struct BlockCosts {
  // The embedding lookup does no arithmetic; its memory traffic (a row read and written per
  // token) is counted as 2 * hidden, a small cost.
  double embedding = 0;
  // One decoder layer: the q/k/v/o projections (2 * hidden * (2 * q_dim + 2 * kv_dim)), the
  // scores and the weighted sum over the keys a query sees (4 * q_dim * keys; keys = the causal
  // average (S + 1) / 2, or less under a sliding window, averaged over the layers) and the MLP
  // (6 * hidden * intermediate).
  double layer = 0;
  // The final norm, the head (2 * hidden * vocab) and the cross-entropy (about 5 * vocab:
  // max, exp, sum, log and the gradient's softmax).
  double head = 0;
};

// InputError when seq_len < 1.
BlockCosts block_costs(const ModelConfig& cfg, int64_t seq_len);

}  // namespace colossal::models
