// The small Llama shape the layer tests build (tests/nn, tests/kernels, tests/pipeline,
// tests/booster): hidden 32, intermediate 48, 4 query heads of 8 over 2 key/value heads, no
// sliding window; `layers` decoder layers and a vocabulary of `vocab`. Callers change what their
// test is about (tied embeddings, a sliding window) on the copy.
#pragma once

#include <cstdint>

#include "colossal/models/llama/config.h"

namespace colossal::tests {

inline models::ModelConfig tiny_llama(int64_t layers = 2, int64_t vocab = 64) {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = vocab;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.layer_sliding.assign(static_cast<size_t>(layers), false);
  return c;
}

}  // namespace colossal::tests
