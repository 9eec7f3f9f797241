// RMSNorm and residual add + RMSNorm (kernels/ layer; contract in kernels/fused.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// ---- RMSNorm (HF LlamaRMSNorm) -------------------------------------------------------------
// x [..., H] fp32/bf16/fp16, weight [H] of x's dtype:
//   y = weight * to_dtype(x_f32 * rsqrt(mean(x_f32^2, -1) + eps))
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// ---- Residual add + RMSNorm (the seam between pre-norm blocks) -------------------------------
// x, r [..., H] of one dtype and device, weight [H]: returns {h, y} with h = x + r (rounded to
// the dtype, as ATen's add) and y = rms_norm(h, weight, eps). Backward: x and r both receive
// dh + (rms_norm's input gradient), summed in the working dtype as autograd sums them. On CUDA
// one kernel each way (the add and the residual gradient's sum ride on the norm's passes);
// on CPU the add is ATen's and the norm the fused loop.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                               const at::Tensor& weight, double eps);
std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& x, const at::Tensor& r,
                                                         const at::Tensor& weight, double eps);

}  // namespace colossal::kernels
