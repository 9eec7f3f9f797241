// Rotary position embedding (kernels/ layer; contract in kernels/fused.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// ---- Rotary position embedding (HF apply_rotary_pos_emb, rotate_half convention) ------------
// x [B, heads, S, D] (any strides with a unit last stride, e.g. the transposed projection
// output), cos/sin [B, S, D] of x's dtype:  y = x * cos + rotate_half(x) * sin,
// rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). The result has x's shape; it is stored
// [B, S, heads, D]-contiguous (a transposed view), the layout SDPA's flash kernel reads.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor apply_rotary_reference(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin);

}  // namespace colossal::kernels
