// Sum of squares of a tensor list: the gradient norm's pass (kernels/ layer; contract in
// kernels/fused.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// ---- Sum of squares of a tensor list (the gradient norm's pass) ------------------------------
// fp64 scalar tensor on the tensors' device: sum over every element of every tensor of x^2
// (inf/nan propagate). All tensors on one device; any float dtypes (grouped per dtype). On
// CUDA: squares summed in fp32 within blocks of 65536 elements, the block partials in fp64.
// Elsewhere (CPU included) the ATen composite: fp64 _foreach_norm, squared and summed.
at::Tensor sum_squares(const std::vector<at::Tensor>& tensors);
at::Tensor sum_squares_reference(const std::vector<at::Tensor>& tensors);

}  // namespace colossal::kernels
