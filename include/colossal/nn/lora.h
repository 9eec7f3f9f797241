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
  // Tensor-parallel LoRA (A split like the base's input, B like its output) is not built yet:
  // InputError.
  void shard(const ShardSpec& spec) override;

  double scaling() const { return scaling_; }
  int64_t rank() const { return r_; }
  std::shared_ptr<Linear> lora_A, lora_B;

 private:
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
// linear layer (naming it and the linear layers there are), a layer that already has LoRA.
std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraConfig& cfg,
                                    uint64_t seed = 0);

// Folds every adapter into its base, W + scaling * B A (computed in fp32, stored in W's dtype),
// (a quantized base dequantized first, the merged weight in the dtype it was quantized from)
// and puts a plain Linear with that weight (and the base's bias) back in the LoraLinear's place,
// so the model is an ordinary one again (save_pretrained writes HF weights only). Returns the
// merged paths. Dropout is an identity at inference, so the merged model computes the adapted
// model's eval-mode function.
std::vector<std::string> merge_lora(torch::nn::Module& root);

}  // namespace colossal::nn
