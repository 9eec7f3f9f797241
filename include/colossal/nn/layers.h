// The layers of a Llama-family decoder: Linear, Embedding, RMSNorm, rotary embedding (default,
// linear, dynamic, llama3 — as transformers 5 computes them), grouped-query attention through
// at::scaled_dot_product_attention with a KV cache, the SwiGLU MLP and the decoder layer.
// Parameters are named as in Hugging Face, so state dicts load one-to-one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "colossal/nn/checkpointing.h"
#include "colossal/nn/config.h"
#include "colossal/nn/module.h"

namespace colossal::nn {

// y = x W^T + b. weight [out, in], optional bias [out].
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x);
  const at::Tensor& weight() const { return param("weight"); }
  bool has_bias() const { return has_bias_; }
  // Column: weight/bias rows split; Row: weight columns split (bias stays whole: the later
  // row-parallel forward adds it once after the reduction).
  void shard(const ShardSpec& spec) override;
  at::Tensor shard_slice(const std::string& name, const at::Tensor& full) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  int64_t in_features() const { return in_; }  // current (local) sizes
  int64_t out_features() const { return out_; }

 private:
  int64_t in_, out_, full_in_, full_out_;
  bool has_bias_;
};

// Token embedding: weight [vocab, hidden]. Vocab sharding keeps rows [rank*V/w, (rank+1)*V/w);
// ids outside the local range look up zeros (the vocab-parallel all-reduce comes later).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
            const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& ids);
  const at::Tensor& weight() const { return param("weight"); }
  std::optional<int64_t> padding_idx() const { return padding_idx_; }
  void shard(const ShardSpec& spec) override;
  at::Tensor shard_slice(const std::string& name, const at::Tensor& full) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  int64_t vocab_begin() const { return vocab_begin_; }

 private:
  int64_t num_, dim_, full_num_, vocab_begin_ = 0;
  std::optional<int64_t> padding_idx_;
};

// HF's LlamaRMSNorm: normalise in fp32, cast back, then scale.
// Whether the model runs the fused kernels (kernels/fused.h) for tensors like x: on CUDA, when
// the build has them and they are enabled. On the CPU the ATen composites are vectorised and
// multi-threaded while the fused CPU loops (kept for tests and devices without ATen kernels)
// are scalar, so the composites are faster there (docs/kernels.md).
bool use_fused_kernels(const at::Tensor& x);

class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x);
  // {h = x + r, forward(h)}: the residual add of a pre-norm block fused into the norm (one
  // kernel each way on CUDA, kernels::add_rms_norm), else the two ops.
  std::pair<at::Tensor, at::Tensor> forward_add(const at::Tensor& x, const at::Tensor& r);
  const at::Tensor& weight() const { return param("weight"); }
  double eps() const { return eps_; }

 private:
  double eps_;
};

// Inverse frequencies for a rope config (fp32, CPU), as transformers' rope init functions do.
// seq_len matters only for `dynamic` (NTK scaling grows with the sequence).
at::Tensor rope_inv_freq(const ModelConfig& cfg, std::optional<int64_t> seq_len = std::nullopt);

// cos/sin tables for given positions. `dynamic` keeps HF's state: frequencies grow with the
// longest sequence seen and reset below max_position_embeddings.
class RotaryEmbedding : public Module {
 public:
  explicit RotaryEmbedding(const ModelConfig& cfg);
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
  ModelConfig cfg_;
  at::Tensor inv_freq_, original_inv_freq_;  // CPU fp32 (not parameters nor buffers)
  // inv_freq_ on the device of the last forward (no host-to-device copy per step, which would
  // also break CUDA graph capture), and the CPU tensor it was copied from.
  at::Tensor inv_freq_device_, inv_freq_device_src_;
  int64_t max_seq_len_cached_, original_max_seq_len_;
};

// q*cos + rotate_half(q)*sin, x [B, H, S, D], cos/sin [B, S, D].
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// RMSNorm, rotary and the SwiGLU product run the fused kernels of kernels/fused.h while
// kernels::enabled() (default), else the ATen composites that define them.

// Keys and values of every layer so far (post-rotary, as HF caches them). Reserve() to write in
// place; without it each step appends with a concatenation.
struct KVCache {
  std::vector<at::Tensor> k, v;  // per layer [B, kv_heads, capacity, head_dim]
  std::vector<int64_t> len;      // per layer valid length
  int64_t capacity = 0;          // 0: grow by concatenation
  explicit KVCache(int64_t num_layers = 0, int64_t reserve_tokens = 0)
      : k(num_layers), v(num_layers), len(num_layers, 0), capacity(reserve_tokens) {}
  int64_t length(int64_t layer = 0) const { return len.empty() ? 0 : len[layer]; }
  // Appends [B, kvh, S, D] and returns the whole valid [B, kvh, len, D] views.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& k_new,
                                           const at::Tensor& v_new);
};

// What attention masks out. An undefined `mask` with causal=true is the plain causal case
// (SDPA's is_causal); otherwise `mask` is a bool [B|1, 1, S, kv_len] (true = attend).
struct AttentionMask {
  at::Tensor mask;
  bool causal = true;
};

class Attention : public Module {
 public:
  Attention(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const AttentionMask& mask, KVCache* cache);
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  int64_t layer_idx() const { return layer_idx_; }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, layer_idx_;
};

// down(silu(gate(x)) * up(x))
class MLP : public Module {
 public:
  MLP(const ModelConfig& cfg, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

class DecoderLayer : public Module {
 public:
  DecoderLayer(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const AttentionMask& mask, KVCache* cache);
  // The same layer with its input and output residual adds left to the neighbouring norms:
  // the input is x + delta (delta undefined: x alone), the output {h, m} means h + m, the
  // next layer's (or the final norm's) forward_add. Not for checkpointed layers (their
  // recompute takes one tensor): the model calls forward() for those.
  std::pair<at::Tensor, at::Tensor> forward_deferred(const at::Tensor& x, const at::Tensor& delta,
                                                     const at::Tensor& cos, const at::Tensor& sin,
                                                     const AttentionMask& mask, KVCache* cache);
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<MLP> mlp;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
  bool sliding() const { return sliding_; }
  // Recompute in backward (checkpointing.h); applies only when grad is on and no KV cache is used.
  CheckpointMode checkpointing = CheckpointMode::None;
  // Whether a forward with this cache (and the current grad mode) recomputes in backward.
  bool recomputes(const KVCache* cache) const;

 private:
  bool sliding_;
};

}  // namespace colossal::nn
