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

}  // namespace colossal::kernels
