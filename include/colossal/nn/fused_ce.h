// Fused output projection + cross-entropy: loss = mean over non-ignored tokens of
// cross_entropy(h · Wᵀ, target), computed chunk by chunk over the tokens so the full
// [tokens, vocab] logits (and their fp32 copy and gradient) never exist at once. Works on any
// device ATen runs on (plain ATen ops, no custom kernel).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace colossal::nn {

struct FusedCEOptions {
  // Tokens per chunk: the extra memory is about chunk_tokens * vocab fp32 values (plus one
  // working-dtype copy of them). 0: one chunk holding every token (the unfused memory profile).
  int64_t chunk_tokens = 4096;
  int64_t ignore_index = -100;
};

// hidden [..., H] (fp32, bf16 or fp16), weight [V, H] of the same dtype, targets [...] int64
// with hidden's leading shape. Returns the fp32 scalar mean loss over targets != ignore_index
// (NaN when every target is ignored, like at::cross_entropy_loss). Differentiable w.r.t. hidden
// and weight: when either requires grad, the gradients are produced during the forward chunk
// loop (logits -> log-softmax -> dlogits -> dh, dW) and only scaled by backward, so backward
// keeps no logits. The logits of a chunk are computed in the working dtype and upcast to fp32;
// the loss and dW are accumulated in fp32.
at::Tensor fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& targets, const FusedCEOptions& opts = {});

}  // namespace colossal::nn
