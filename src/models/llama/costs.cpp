// Forward FLOPs per token of the embedding, a decoder layer and the head with its loss.
#include "colossal/models/llama/costs.h"

#include <algorithm>

#include "colossal/core/error.h"

namespace colossal::models {

BlockCosts block_costs(const ModelConfig& cfg, int64_t seq_len) {
  COLOSSAL_CHECK_INPUT(seq_len >= 1, "block_costs: seq_len must be >= 1, got ", seq_len);
  const double h = static_cast<double>(cfg.hidden_size), s = static_cast<double>(seq_len);
  const double q = static_cast<double>(cfg.num_attention_heads * cfg.head_dim);
  const double kv = static_cast<double>(cfg.kv_dim());
  const double f = static_cast<double>(cfg.intermediate_size);
  const double vocab = static_cast<double>(cfg.vocab_size);
  // Keys a query attends to, averaged over the positions 0..S-1 and over the layers.
  const double causal = (s + 1) / 2;
  double keys = 0;
  const int64_t L = std::max<int64_t>(cfg.num_hidden_layers, 1);
  for (int64_t i = 0; i < L; ++i) {
    if (cfg.sliding_window && cfg.uses_sliding(i) && *cfg.sliding_window < seq_len) {
      const double w = static_cast<double>(*cfg.sliding_window);
      keys += (w * (w + 1) / 2 + (s - w) * w) / s;  // min(p + 1, w) summed over p
    } else {
      keys += causal;
    }
  }
  keys /= static_cast<double>(L);
  BlockCosts c;
  c.embedding = 2 * h;
  c.layer = 2 * h * (2 * q + 2 * kv) + 4 * q * keys + 6 * h * f;
  c.head = 2 * h * vocab + 5 * vocab;
  return c;
}

}  // namespace colossal::models
