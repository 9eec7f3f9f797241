// RMSNorm as Hugging Face's LlamaRMSNorm computes it (normalise in fp32, cast back, then scale),
// with the residual add of a pre-norm block fusable into it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

#include "colossal/nn/module.h"

namespace colossal::nn {

class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps, const at::TensorOptions& opts);
  virtual at::Tensor forward(const at::Tensor& x);
  // {h = x + r, forward(h)}: the residual add of a pre-norm block fused into the norm (one
  // kernel each way on CUDA, kernels::add_rms_norm), else the two ops.
  virtual std::pair<at::Tensor, at::Tensor> forward_add(const at::Tensor& x, const at::Tensor& r);
  const at::Tensor& weight() const { return param("weight"); }
  double eps() const { return eps_; }

 private:
  double eps_;
};

}  // namespace colossal::nn
