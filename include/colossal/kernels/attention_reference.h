// The fp64 oracle for issue 25's attention kernels (and any attention path's GPU tests):
// softmax(q k^T * scale, causal within each sequence) v over packed variable-length sequences,
// with the log-sum-exp of every query's scores (what a ring-attention merge of partial results
// needs). Built from differentiable ATen ops, so autograd gives the reference dQ, dK and dV.
#pragma once

#include <ATen/core/Tensor.h>

namespace colossal::kernels {

struct AttentionReference {
  at::Tensor out;  // [T, H, D] float64
  at::Tensor lse;  // [H, T] float64: log sum_j exp(scale * q_i . k_j) over the keys i attends
};

// q [T, H, D], k and v [T, Hkv, D] (any floating dtype; computed in float64), H a multiple of Hkv:
// query head h reads kv head h / (H / Hkv), without copies of its own. Sequence i holds the tokens
// [cu_seqlens[i], cu_seqlens[i+1]) (int64 [n+1]: 0 first, T last, non-decreasing); nothing is
// attended across sequences. causal: a query attends to the keys of its sequence at positions up
// to its own. scale: 1/sqrt(D) when 0. InputError naming the bad argument.
AttentionReference attention_reference(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cu_seqlens,
                                       bool causal, double scale = 0);

// Keys of their own lengths (kernels::attention_forward's cross-length form): sequence i's
// queries are rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of q, its keys and values rows
// [cu_seqlens_k[i], cu_seqlens_k[i+1]) of k and v (int64, the same number of sequences; k and v
// [Tk, Hkv, D]). causal needs each sequence's two lengths equal. A sequence with queries but no
// keys has no softmax: InputError.
AttentionReference attention_reference(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                       const at::Tensor& cu_seqlens_k, bool causal,
                                       double scale = 0);

}  // namespace colossal::kernels
