// Rotary position embedding: inverse frequencies for the rope types transformers 5 implements
// (default, linear, dynamic, llama3), cos/sin tables for given positions, and their application
// to queries and keys.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "colossal/nn/module.h"

namespace colossal::nn {

struct RopeConfig {
  std::string type = "default";  // default | linear | dynamic | llama3
  double theta = 10000.0;
  double factor = 1.0;                           // linear, dynamic, llama3
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  int64_t original_max_position_embeddings = 0;  // llama3
};

// What the tables depend on: the rope config, the head dim and the model's context length.
struct RotaryOptions {
  RopeConfig rope;
  int64_t head_dim = 128;
  int64_t max_position_embeddings = 2048;
};

// Inverse frequencies (fp32, CPU), as transformers' rope init functions compute them. seq_len
// matters only for `dynamic` (NTK scaling grows with the sequence).
at::Tensor rope_inv_freq(const RotaryOptions& opts, std::optional<int64_t> seq_len = std::nullopt);

// cos/sin tables for given positions. `dynamic` keeps HF's state: frequencies grow with the
// longest sequence seen and reset below max_position_embeddings.
class RotaryEmbedding : public Module {
 public:
  explicit RotaryEmbedding(const RotaryOptions& opts);
  // positions [B, S] (int64) -> cos, sin [B, S, head_dim] in `dtype` on positions' device.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::ScalarType dtype);
  // The tables of positions [start, end) shared by the batch ([1, S, head_dim]), as forward()
  // computes them; kept for the last (start, end, device, dtype) so a training step of fixed
  // length builds them once (not for `dynamic`, whose frequencies follow the length).
  std::pair<at::Tensor, at::Tensor> forward_range(int64_t start, int64_t end, at::Device device,
                                                  at::ScalarType dtype);

 private:
  struct Cached {
    int64_t start = -1, end = -1;
    at::Device device{at::kCPU};
    at::ScalarType dtype = at::kFloat;
    at::Tensor cos, sin;
  };
  Cached cached_;
  RotaryOptions opts_;
  at::Tensor inv_freq_, original_inv_freq_;  // CPU fp32 (not parameters nor buffers)
  // inv_freq_ on the device of the last forward (no host-to-device copy per step, which would
  // also break CUDA graph capture), and the CPU tensor it was copied from.
  at::Tensor inv_freq_device_, inv_freq_device_src_;
  int64_t max_seq_len_cached_, original_max_seq_len_;
};

// q*cos + rotate_half(q)*sin, x [B, H, S, D], cos/sin [B|1, S, D]; the fused kernel on CUDA.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace colossal::nn
