// Fused output projection + cross-entropy: loss = mean over non-ignored tokens of
// cross_entropy(h · Wᵀ, target), computed chunk by chunk over the tokens so the full
// [tokens, vocab] logits (and their fp32 copy and gradient) never exist at once. Works on any
// device ATen runs on (plain ATen ops, no custom kernel).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "colossal/dist/communicator.h"

namespace colossal::nn {

struct FusedCEOptions {
  // Tokens per chunk: the extra memory is about chunk_tokens * vocab fp32 values (plus one
  // working-dtype copy of them). 0: one chunk holding every token (the unfused memory profile).
  int64_t chunk_tokens = 4096;
  int64_t ignore_index = -100;
  // > 0: the loss is the sum over counted targets divided by this (a caller normalizing over
  // more than this call's targets: a global batch of masked targets); 0: the mean over the
  // counted targets of this call.
  double divisor = 0;
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

// The vocabulary split of an output head over a tensor-parallel group: this rank holds the rows
// [vocab_begin, vocab_begin + weight.size(0)) of the (padded) vocabulary, of which only those
// below vocab_size are real; the rest are padding and excluded from the softmax.
struct VocabParallel {
  dist::Communicator group;
  int64_t vocab_begin = 0;
  int64_t vocab_size = 0;  // the whole, unpadded vocabulary
};

// The vocabulary-parallel form of fused_linear_cross_entropy (Megatron's
// vocab_parallel_cross_entropy fused with the head's GEMM; ColossalAI's parallel_output=true
// loss): every rank of vp.group passes the same hidden and targets and its own rows `weight`
// [V_local, H]; per chunk of tokens the logits of the real local rows are computed, the row max
// is all-reduced (max) and the sum of exponentials and the target logit (taken on the rank that
// owns the target, 0 elsewhere) are all-reduced (sum), so no rank ever holds the logits of the
// whole vocabulary. Returns the loss over the whole vocabulary, the same on every rank. Its
// gradients are local: dL/dweight is this rank's rows of the whole gradient (zero on padding
// rows), dL/dhidden is this rank's partial sum (softmax - onehot restricted to its columns,
// times its rows): the caller enters the region with copy_to_region (or gathers the sequence)
// so that backward sums it over the group. On CUDA with the fused kernels each chunk runs
// kernels::softmax_row_stats_ and kernels::softmax_grad_given_lse_.
at::Tensor vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                               const at::Tensor& targets, const VocabParallel& vp,
                                               const FusedCEOptions& opts = {});

}  // namespace colossal::nn
