// KV cache and the SDPA core attention.
#include "colossal/nn/attention.h"

#include <ATen/ATen.h>

#include "colossal/core/error.h"

namespace colossal::nn {

// ---- KV cache -----------------------------------------------------------------------------
std::pair<at::Tensor, at::Tensor> KVCache::update(int64_t layer, const at::Tensor& kn,
                                                  const at::Tensor& vn) {
  COLOSSAL_CHECK(layer >= 0 && layer < static_cast<int64_t>(k.size()), "KVCache has ", k.size(),
                 " layers, asked for layer ", layer);
  const int64_t s = kn.size(2);
  int64_t& n = len[layer];
  if (capacity > 0) {
    COLOSSAL_CHECK(n + s <= capacity, "KVCache: ", n + s, " tokens exceed the reserved ", capacity);
    if (!k[layer].defined()) {
      k[layer] = at::empty({kn.size(0), kn.size(1), capacity, kn.size(3)}, kn.options());
      v[layer] = at::empty({vn.size(0), vn.size(1), capacity, vn.size(3)}, vn.options());
    }
    k[layer].narrow(2, n, s).copy_(kn);
    v[layer].narrow(2, n, s).copy_(vn);
    n += s;
    return {k[layer].narrow(2, 0, n), v[layer].narrow(2, 0, n)};
  }
  k[layer] = k[layer].defined() ? at::cat({k[layer], kn}, 2) : kn;
  v[layer] = v[layer].defined() ? at::cat({v[layer], vn}, 2) : vn;
  n += s;
  return {k[layer], v[layer]};
}

// ---- Core attention -----------------------------------------------------------------------
at::Tensor SdpaAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionMask& mask, const SequenceInfo& seq) {
  ForwardScope scope(*this);
  const bool gqa = q.size(1) != k.size(1);
  if (mask.mask.defined())
    return at::scaled_dot_product_attention(q, k, v, mask.mask, 0.0, false, std::nullopt, gqa);
  // is_causal aligns the query block at the top-left of the keys: right only without a cache
  // (the model passes an explicit mask otherwise) and for more than one query.
  return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, mask.causal && q.size(2) > 1,
                                          std::nullopt, gqa);
}

}  // namespace colossal::nn
