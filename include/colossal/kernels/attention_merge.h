// Merging partial attention results by their log-sum-exp (kernels/ layer): what ring attention
// does after each block, and what a split over keys does after its parts.
#pragma once

#include <ATen/core/Tensor.h>

namespace colossal::kernels {

// ---- Merge a partial result into the running result of the same query rows, in place ------
// out [B, H, n, D] float32 and lse [B, H, n] float32 hold the rows' running output and
// log-sum-exp (natural log; a row not yet written holds lse = -inf and out = 0); part_out
// [B, H, n, D] (float32, bfloat16 or half) and part_lse [B, H, n] float32 are a partial result
// over other keys. Afterwards
//   lse' = log(e^lse + e^part_lse),  out' = e^(lse - lse') out + e^(part_lse - lse') part_out,
// computed in fp32; a row where both are -inf is left as it is. out: any strides with a unit
// last stride; part_out, lse, part_lse: any strides (part_out is copied first when its last
// stride is not 1). On CUDA one pass (each row's weights computed once, out read and
// written once, part_out read once); elsewhere (CPU included) attention_merge_reference.
// InputError naming the bad argument (dtype, shape, device, a non-unit last stride of out).
void attention_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse);
// The ATen composite of the same (also the CPU path).
void attention_merge_reference(const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& part_out, const at::Tensor& part_lse);

}  // namespace colossal::kernels
