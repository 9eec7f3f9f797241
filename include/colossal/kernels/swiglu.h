// SwiGLU, on separate gate/up tensors and on one packed tensor (kernels/ layer; contract in
// kernels/fused.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// ---- SwiGLU --------------------------------------------------------------------------------
// gate, up [..., F] of one dtype: y = silu(gate) * up (HF LlamaMLP's act_fn(gate) * up).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
at::Tensor swiglu_reference(const at::Tensor& gate, const at::Tensor& up);

// ---- Packed SwiGLU -------------------------------------------------------------------------
// gu [..., 2F] (gate in the first F columns, up in the last F, e.g. linear_concat's output of
// gate_proj and up_proj): y = silu(gate) * up, [..., F]. The gradient comes back packed in one
// [..., 2F] tensor, which is what linear_concat's backward reads (no split/cat copies).
at::Tensor swiglu_packed(const at::Tensor& gu);
at::Tensor swiglu_packed_reference(const at::Tensor& gu);

}  // namespace colossal::kernels
