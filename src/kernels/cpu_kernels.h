// CPU paths of kernels/fused.h: fused single-pass loops over contiguous tensors (inputs are
// made contiguous by the callers in fused.cpp), split over std::threads for large inputs.
#pragma once

#include <ATen/core/Tensor.h>

#include "colossal/kernels/fused.h"

namespace colossal::kernels::cpu {

// x [rows, h], w [h] -> y [rows, h], rstd [rows] fp32.
void rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd,
                  double eps);
// dy, x [rows, h], w [h], rstd [rows] -> dx [rows, h], dw [h] (fp32 accumulation).
void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw);
// x [B, heads, S, D] (unit last stride), cos/sin [B, S, D] (unit last stride) -> y of x's
// shape (any strides, unit last); backward applies the transposed rotation.
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y,
            bool backward);
void swiglu_fwd(const at::Tensor& gate, const at::Tensor& up, at::Tensor& y);
void swiglu_bwd(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                at::Tensor& dgate, at::Tensor& dup);
// One tensor's AdamW step (arguments validated by the caller).
void adamw(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
           const at::Tensor& work, const AdamWStep& hyper);

// logits [rows, V] (in place), targets [rows] int64 in range (checked by the caller) or
// ignore_index -> row_loss [rows] fp32.
void cross_entropy_grad(at::Tensor& logits, const at::Tensor& targets, at::Tensor& row_loss,
                        float scale, int64_t ignore_index);

}  // namespace colossal::kernels::cpu
