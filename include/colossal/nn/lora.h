// LoRA (Hu et al., 2021) as a layer kind of the linear family: LoraLinear takes the place of a
// projection (Module::replace_child) and computes base(x) + B(A(dropout(x))) * scaling with the
// base weight frozen. Being a derived Linear it is never folded into its siblings' fused GEMM
// (Linear::fusable), so the adapter runs on every device. Parameter names follow PEFT's module
// layout: "<projection>.lora_A.weight" [r, in] and "<projection>.lora_B.weight" [out, r] next to
// the base's "<projection>.weight", so an adapter file maps name for name (checkpoint/lora.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "colossal/nn/linear.h"

namespace colossal::nn {

class QuantizedLinear;

// PEFT's LoraConfig fields and defaults (peft.LoraConfig), where we support them.
struct LoraConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0.0;
  // Linear layers whose last name component is one of these ("q_proj", "down_proj", ...).
  std::vector<std::string> target_modules;
  std::string bias = "none";  // only "none": biases stay frozen
  bool use_rslora = false;    // scaling alpha / sqrt(r) instead of alpha / r
  // "default": A kaiming-uniform (bound 1/sqrt(in_features)), B zero, as PEFT's
  // init_lora_weights=True; "gaussian": A normal(0, 1/r), B zero.
  std::string init = "default";

  double scaling() const;
  // InputError naming the field for r <= 0, alpha <= 0, dropout outside [0, 1), no targets, a
  // bias mode or init we do not implement.
  void validate() const;
};

class LoraLinear : public Linear {
 public:
  // Wraps `base` (a plain, unsharded Linear): shares its weight and bias, frozen, and adds A and
  // B in the base's dtype and device, initialised as cfg.init says from `seed`. A quantized base
  // (QLoRA: nn::QuantizedLinear, held by shared_ptr) is kept whole as this layer's base: this
  // layer then has no "weight" parameter either, its forward runs the base's dequantizing GEMM,
  // and A and B take the dtype the base was quantized from, on the base's device.
  LoraLinear(const Linear& base, const LoraConfig& cfg, uint64_t seed);
  at::Tensor forward(const at::Tensor& x) override;
  // The quantized base (QLoRA), or null for a plain one.
  const std::shared_ptr<QuantizedLinear>& quantized_base() const { return quantized_base_; }
  // Moves a quantized base's storage with the module (as QuantizedLinear::to).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  // Tensor parallelism: the base shards as a Linear does, and the adapter with it.
  //   Column base (output split): B [out, r] is split by rows like the base's output (the same
  //     heads, so a replicated GQA head replicates its rows of B and sums their gradient over
  //     the sharing ranks); A [r, in] stays whole and reads the input the base's GEMM reads (the
  //     region-entered x, gathered under split_gather). Each rank's A gradient is a partial sum
  //     (its output features only), so A is read through copy_to_region over the group: the
  //     gradient is the whole sum, the same on every rank.
  //   Row base (input split): A is split by columns like the base's input; B stays whole. The
  //     adapter's partial products h_r B^T are added to the base's before its one reduction
  //     (all-reduce, or reduce-scatter under split_gather), and B is read through
  //     copy_to_region (each rank's gradient is the part of its h_r).
  // Under ring (chunked, overlapped collectives) the adapter's small [.., r] activations take
  // their own gather (column) or reduce-scatter (row) beside the base's ring.
  // The children record it as specs of their own (lora_A / lora_B are Linear layers sharded as
  // Column with replicated rows where whole), so shard_slice / full_shape / replication (the
  // tensor-parallel checkpoint IO, the gradient norm) see full-shape adapter tensors.
  // InputError naming the layer for a vocabulary head's options (padding, gather_output) and
  // for a quantized base (tensor-parallel QLoRA is not built).
  void shard(const ShardSpec& spec) override;
  // The base's names as Linear's; "lora_A.weight" / "lora_B.weight" as the adapter's children.
  at::Tensor shard_slice(const std::string& name, const at::Tensor& full) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  int64_t replication(const std::string& name) const override;
  // Without dropout, over a plain unsharded base: the base joins its siblings' fused GEMM and
  // the adapter follows it (Linear::low_rank_addition); nullopt otherwise (a quantized base, a
  // tensor-parallel layer, dropout).
  std::optional<LowRankAddition> low_rank_addition() override;

  double scaling() const { return scaling_; }
  int64_t rank() const { return r_; }
  std::shared_ptr<Linear> lora_A, lora_B;

 private:
  // forward over a group (shard()'s layout).
  at::Tensor sharded_forward(const at::Tensor& x);
  int64_t r_;
  double scaling_, dropout_;
  std::shared_ptr<QuantizedLinear> quantized_base_;
};

// Whether a parameter name is a LoRA adapter's ("<path>.lora_A.<...>" / "<path>.lora_B.<...>"),
// e.g. in a training checkpoint that holds them beside the base's weights.
bool is_lora_parameter(std::string_view name);

// Replaces every nn::Linear under `root` whose last name component is a target with a
// LoraLinear, after freezing every parameter of `root`: only the adapters train. Returns the
// adapted paths in module order. InputError for an invalid config, a target that matches no
// linear layer (naming it and the linear layers there are), a layer that already has LoRA, a
// layer that is sharded already (apply LoRA to the whole model; shard() then shards it).
std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraConfig& cfg,
                                    uint64_t seed = 0);

// Folds every adapter into its base, W + scaling * B A (computed in fp32, stored in W's dtype),
// (a quantized base dequantized first, the merged weight in the dtype it was quantized from)
// and puts a plain Linear with that weight (and the base's bias) back in the LoraLinear's place,
// so the model is an ordinary one again (save_pretrained writes HF weights only). Returns the
// merged paths. Dropout is an identity at inference, so the merged model computes the adapted
// model's eval-mode function. InputError for a sharded LoRA layer (merge the whole model).
std::vector<std::string> merge_lora(torch::nn::Module& root);

}  // namespace colossal::nn
