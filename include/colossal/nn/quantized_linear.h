// A frozen linear layer whose weight is stored quantized, the base of QLoRA: NF4 (4-bit
// NormalFloat with double quantisation, nn/nf4.h; about 4.13 bits per weight) or FP8 (e4m3
// with one fp32 scale per output row; 8.0 bits per weight plus the scales). It is a layer kind
// of the linear family (replace_module swaps it in), never fused with siblings, and it has no
// "weight" parameter: the quantized storage is not trained, not in checkpoints (a QLoRA run
// quantizes its base again from the pretrained folder when it resumes) and not touched by the
// plugins' casts. Forward dequantizes the weight into the input's dtype (our CUDA kernels on
// CUDA, kernels/quant.h) and multiplies; backward dequantizes it again for the input gradient
// (nothing but the quantized storage is kept between them, so no full-precision weight lives
// longer than one GEMM). The bias, if any, is an ordinary frozen parameter under its HF name.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/nf4.h"

namespace colossal::nn {

struct QuantizeConfig {
  std::string kind = "nf4";  // "nf4" | "fp8"
  int64_t blocksize = 64;    // nf4: values per absmax block (QLoRA's 64)
  bool double_quant = true;  // nf4: quantize the absmax constants too (QLoRA)
  // Linear layers kept in full precision, by the last component of their name. lm_head always
  // stays (the fused cross-entropy reads its weight), as transformers' bitsandbytes integration
  // keeps it.
  std::vector<std::string> skip_modules;
  // InputError naming the field for an unknown kind, a blocksize that is not positive and even.
  void validate() const;
};

class QuantizedLinear : public Linear {
 public:
  // Of `options`' shape, with no weight yet (set_weight); the bias, if any, is allocated as
  // options' tensor_options say (meta: materialized by the loader) and frozen.
  QuantizedLinear(const LinearOptions& options, const QuantizeConfig& cfg);
  // Quantizes a plain, unsharded Linear's weight on its device and shares its bias.
  static std::shared_ptr<QuantizedLinear> from(const Linear& base, const QuantizeConfig& cfg);

  // Quantizes w ([out, in], any floating dtype) on w's device into this layer's storage,
  // replacing what it held. InputError for a wrong shape.
  void set_weight(const at::Tensor& w);
  bool has_weight() const;
  // The weight dequantized, [out, in], `dtype`, on the storage's device.
  at::Tensor dequantized_weight(at::ScalarType dtype) const;

  at::Tensor forward(const at::Tensor& x) override;
  // x W^T + bias through the dequantizing GEMM (bias may be undefined), without firing hooks:
  // forward() with this layer's bias, and what a LoRA layer over this base computes with its own.
  at::Tensor matmul_weight(const at::Tensor& x, const at::Tensor& bias) const;
  // The dtype the weight was quantized from and the storage's device (for adapters over it).
  at::TensorOptions weight_options() const;
  // Not sharded (tensor-parallel QLoRA is not built): InputError.
  void shard(const ShardSpec& spec) override;
  std::vector<int64_t> full_shape(const std::string& name) const override;

  const QuantizeConfig& config() const { return cfg_; }
  at::Device storage_device() const;
  int64_t storage_bytes() const;  // codes and constants
  // The stored tensors themselves (for tests across devices): kind nf4, and kind fp8's
  // {codes, scale}.
  const NF4Tensor& nf4_storage() const { return nf4_; }
  std::pair<at::Tensor, at::Tensor> fp8_storage() const { return {fp8_codes_, fp8_scale_}; }
  // Moves the quantized storage with the module (dtypes kept: the dtype argument only casts the
  // bias).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

 private:
  QuantizeConfig cfg_;
  NF4Tensor nf4_;                          // kind nf4
  at::Tensor fp8_codes_, fp8_scale_;       // kind fp8: float8_e4m3fn [out, in], fp32 [out]
  at::ScalarType fp8_dtype_ = at::kFloat;  // kind fp8: the dtype quantized from
};

// Replaces every plain nn::Linear under `root` (except lm_head and cfg.skip_modules) by a
// QuantizedLinear holding its quantized weight (quantized on the weight's device; meta weights
// give empty layers for a loader to fill with set_weight). The full-precision weights are
// released. Returns the paths. InputError for an invalid config or a sharded layer.
std::vector<std::string> quantize_linears(torch::nn::Module& root, const QuantizeConfig& cfg);

// Gives every QuantizedLinear under `root` that holds no weight the initial value the plain
// model's init_parameters gives "<path>.weight" (init_value: the same seed rule, so a quantized
// model is the quantization of the plain one), quantized on `device`. The values are made on
// the host by up to 8 threads at once, one weight per thread. Returns the storage bytes.
int64_t init_quantized_weights(torch::nn::Module& root, const InitOptions& opts,
                               const at::Device& device);

// The weight elements (out x in each) that the quantized layers under `root` stand for, the
// quantized bases of LoRA layers included (held without being registered as submodules): what a
// parameter count of a QLoRA model leaves out.
int64_t quantized_weight_count(torch::nn::Module& root);

}  // namespace colossal::nn
