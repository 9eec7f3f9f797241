// Softmax cross-entropy and its gradient in place: the fused CE's per-chunk step (kernels/
// layer; contract in kernels/fused.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// ---- Softmax cross-entropy and its gradient, in place (the fused CE's per-chunk step) ---------
// logits [n, V] contiguous fp32/bf16/fp16 (overwritten), targets [n] int64 in [0, V) or
// ignore_index, scale: an fp32 scalar tensor on logits' device (no host sync), or undefined = 1.
// Returns the per-row loss, fp32 [n]: logsumexp(row) - row[target] (0 on ignored rows), and
// overwrites logits with (softmax(row) - onehot(target)) * scale (0 on ignored rows), rounded
// to logits' dtype: the gradient of sum(loss) * scale. One read for the statistics (fp32), one
// read and one write for the gradient. A target outside [0, V) is an error (on CUDA: the kernel
// prints it and traps, as ATen's gather does).
at::Tensor cross_entropy_grad_(at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                               const at::Tensor& scale);
at::Tensor cross_entropy_grad_reference_(at::Tensor& logits, const at::Tensor& targets,
                                         int64_t ignore_index, const at::Tensor& scale);

// ---- The same step for a softmax split over ranks (the vocabulary-parallel cross-entropy) ----
// logits [n, V] contiguous fp32/bf16/fp16. Returns fp32 [n, 2]: each row's max and the sum of
// exp(x - max) over the row (V == 0: -inf and 0), to be combined over the ranks' parts.
at::Tensor softmax_row_stats_(const at::Tensor& logits);
// With lse [n] fp32 the logsumexp of each whole row (every rank's part), overwrites logits with
// (exp(x - lse) - onehot(target)) * row_scale, rounded to logits' dtype. targets [n] int64 are
// local columns; a target outside [0, V) (held by another rank) adds no onehot. row_scale [n]
// fp32 (0 for ignored rows). On the CPU and other devices both run as ATen composites.
void softmax_grad_given_lse_(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                             const at::Tensor& row_scale);
// The ATen composites (what the CPU runs), without argument checks.
at::Tensor softmax_row_stats_reference_(const at::Tensor& logits);
void softmax_grad_given_lse_reference_(at::Tensor& logits, const at::Tensor& targets,
                                       const at::Tensor& lse, const at::Tensor& row_scale);

}  // namespace colossal::kernels
