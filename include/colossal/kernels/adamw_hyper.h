// The AdamW hyper-parameters: the one definition used by the fused kernel (kernels/adamw.h, its
// CUDA launch included), the optimizers (optim::AdamWHyper, the AdamW part of
// optim::GroupOptions) and ZeRO / Gemini. It sits in kernels/, the lowest layer that needs it,
// and includes nothing heavy so that the .cu files, which see no ATen, use the same struct.
#pragma once

#include <cstdint>

namespace colossal::kernels {

// torch.optim.AdamW's hyper-parameters (decoupled weight decay), with torch's defaults.
struct AdamWHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// One update's arguments: the hyper-parameters plus what changes per call.
struct AdamWStep : AdamWHyper {
  int64_t step = 1;           // counted after the increment: 1 on the first update
  double grad_divisor = 1.0;  // gradients are divided by this (unscale and clip folded in)
};

}  // namespace colossal::kernels
