// Multi-tensor AdamW on fp32 masters (kernels/ layer; contract in kernels/fused.h). The
// hyper-parameter struct is in kernels/adamw_hyper.h, shared with optim/.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "colossal/kernels/adamw_hyper.h"
#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// ---- Multi-tensor AdamW on fp32 masters ------------------------------------------------------
// torch.optim.AdamW semantics (decoupled weight decay, bias-corrected), one step for every
// tensor of the lists, in as few launches as the sizes allow (one per ~chunk of tensors):
//   g    = grad / grad_divisor                      (grad fp32, bf16 or fp16; read, not changed)
//   p    = p * (1 - lr * weight_decay)
//   m    = beta1 * m + (1 - beta1) * g
//   v    = beta2 * v + (1 - beta2) * g^2
//   p    = p - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//   out  = to_dtype(p)                                 (only when `working` is not empty)
// params, exp_avgs, exp_avg_sqs: fp32, contiguous; grads: same shapes; working: empty, or one
// bf16/fp16 tensor per param (the model's working weights, written with the updated master).
// All tensors on one device. Errors (InputError/Error) name the offending list index.
void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& working,
                 const AdamWStep& hyper);
// The same update by ATen ops (grad upcast, at::_foreach_* math, working.copy_(p)).
void fused_adamw_reference(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& working, const AdamWStep& hyper);

}  // namespace colossal::kernels
