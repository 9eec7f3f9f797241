// Configuration of a Llama-family causal LM (llama, mistral, qwen2), read from and written to
// Hugging Face's config.json, plus the benchmark presets. Unknown architectures and options
// we do not implement are InputErrors naming them: the model never silently differs from HF.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "colossal/core/json.h"
#include "colossal/nn/rotary.h"

namespace colossal::models {

using nn::RopeConfig;

struct ModelConfig {
  std::string model_type = "llama";  // llama | mistral | qwen2
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // llama attention_bias, or qwen2 (always true)
  bool o_bias = false;    // llama attention_bias
  bool mlp_bias = false;  // llama mlp_bias
  RopeConfig rope;
  // Sliding-window attention: the window (tokens a query sees, itself included) and which
  // layers use it (mistral: all; qwen2: layer_types / max_window_layers).
  std::optional<int64_t> sliding_window;
  std::vector<bool> layer_sliding;
  std::optional<int64_t> pad_token_id;
  json::Value bos_token_id, eos_token_id;  // kept as given (eos may be a list)
  std::string dtype = "float32";           // HF's torch_dtype / dtype

  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  nn::RotaryOptions rotary() const { return {rope, head_dim, max_position_embeddings}; }
  bool uses_sliding(int64_t layer) const;
  void validate() const;  // InputError naming the bad field

  // config.json <-> config. from_json accepts transformers 5 `rope_parameters` and the older
  // `rope_theta` + `rope_scaling`.
  static ModelConfig from_json(const json::Value& j);
  static ModelConfig from_file(const std::string& path);
  json::Value to_json() const;  // HF-loadable (model_type, architectures, dtype, ...)

  // tiny | 100m | 1b | 7b | 13b | 70b (ColossalAI's benchmark shapes; 1b is TinyLlama).
  static ModelConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

// Parameters of the whole model (embedding, layers, norms, head unless tied); -1 when the count
// overflows int64.
int64_t parameter_count(const ModelConfig& cfg);
// Before allocating: an InputError naming `what` and the byte count when the parameters, at
// `bytes_per_param` bytes each, exceed the memory of `device` (cuda: the device's total; cpu:
// the host's MemAvailable). Absurd sizes fail here, not as a raw allocator message.
void check_fits_memory(const ModelConfig& cfg, const at::Device& device, int64_t bytes_per_param,
                       const std::string& what);

// Inverse rotary frequencies of this model (nn::rope_inv_freq of cfg.rotary()).
at::Tensor rope_inv_freq(const ModelConfig& cfg, std::optional<int64_t> seq_len = std::nullopt);

}  // namespace colossal::models
