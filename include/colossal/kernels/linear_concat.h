// Concatenated linear: one GEMM for layers that read the same input (kernels/ layer; contract
// in kernels/fused.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace colossal::kernels {

// ---- Concatenated linear (one GEMM for layers that read the same input) ---------------------
// y = cat([x·W1ᵀ + b1, x·W2ᵀ + b2, ...], -1) as one GEMM against the concatenated weight, e.g.
// q/k/v or gate/up. The concatenated weight exists only during the forward GEMM and is rebuilt
// for backward (never saved: no second copy of the weights lives until backward); the weight
// gradients are row blocks of one GEMM, dx one GEMM. biases: empty, or one per weight.
// An ATen composite (cuBLAS / CPU BLAS), so it runs on any device.
at::Tensor linear_concat(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& biases = {});
at::Tensor linear_concat_reference(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<at::Tensor>& biases = {});

}  // namespace colossal::kernels
