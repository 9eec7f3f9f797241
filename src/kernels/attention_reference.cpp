// The fp64 attention oracle (kernels/attention_reference.h).
#include "colossal/kernels/attention_reference.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "colossal/core/error.h"

namespace colossal::kernels {

namespace {

// cu (int64 [n+1]) on the host, checked to run from 0 to `rows` without decreasing.
std::vector<int64_t> offsets(const at::Tensor& cu_seqlens, const char* name, int64_t rows) {
  COLOSSAL_CHECK_INPUT(
      cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2 && cu_seqlens.scalar_type() == at::kLong,
      "attention_reference: ", name, " must be int64 [sequences + 1]; got ",
      cu_seqlens.scalar_type(), " ", cu_seqlens.sizes());
  const at::Tensor cu = cu_seqlens.cpu().contiguous();
  std::vector<int64_t> c(cu.const_data_ptr<int64_t>(), cu.const_data_ptr<int64_t>() + cu.numel());
  const size_t n = c.size() - 1;
  COLOSSAL_CHECK_INPUT(c[0] == 0 && c[n] == rows, "attention_reference: ", name,
                       " must run from 0 to ", rows, " (the tokens); it runs from ", c[0], " to ",
                       c[n]);
  for (size_t i = 0; i < n; ++i)
    COLOSSAL_CHECK_INPUT(c[i + 1] >= c[i], "attention_reference: ", name, " decreases at ", i + 1,
                         " (", c[i], " then ", c[i + 1], ")");
  return c;
}

AttentionReference reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens_q, const at::Tensor* cu_seqlens_k,
                             bool causal, double scale) {
  COLOSSAL_CHECK_INPUT(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
                       "attention_reference: q, k and v must be [tokens, heads, dim]; got ",
                       q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), hkv = k.size(1);
  const int64_t tk = cu_seqlens_k != nullptr ? k.size(0) : t;
  COLOSSAL_CHECK_INPUT(k.sizes() == v.sizes() && k.size(0) == tk && k.size(2) == d,
                       "attention_reference: k and v must be [", tk, ", kv heads, ", d, "]; got ",
                       k.sizes(), " and ", v.sizes());
  COLOSSAL_CHECK_INPUT(hkv > 0 && h % hkv == 0, "attention_reference: ", h,
                       " query heads are not a multiple of ", hkv, " kv heads");
  const char* name_q = cu_seqlens_k != nullptr ? "cu_seqlens_q" : "cu_seqlens";
  const std::vector<int64_t> c = offsets(cu_seqlens_q, name_q, t);
  const std::vector<int64_t> ck =
      cu_seqlens_k != nullptr ? offsets(*cu_seqlens_k, "cu_seqlens_k", tk) : c;
  COLOSSAL_CHECK_INPUT(ck.size() == c.size(), "attention_reference: ", c.size() - 1,
                       " query sequences against ", ck.size() - 1, " key sequences");
  const int64_t n = static_cast<int64_t>(c.size()) - 1;
  const double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = c[i], len = c[i + 1] - c[i], ka = ck[i], klen = ck[i + 1] - ck[i];
    COLOSSAL_CHECK_INPUT(!causal || len == klen, "attention_reference: causal sequence ", i,
                         " has ", len, " queries and ", klen, " keys");
    if (len == 0) continue;
    COLOSSAL_CHECK_INPUT(klen > 0, "attention_reference: sequence ", i, " has ", len,
                         " queries and no keys");
    // [heads, len, dim]; each kv head serves h / hkv query heads.
    at::Tensor qs = q.narrow(0, a, len).to(at::kDouble).permute({1, 0, 2});
    at::Tensor ks = k.narrow(0, ka, klen).to(at::kDouble).permute({1, 0, 2});
    at::Tensor vs = v.narrow(0, ka, klen).to(at::kDouble).permute({1, 0, 2});
    if (hkv != h) {
      ks = ks.repeat_interleave(h / hkv, 0);
      vs = vs.repeat_interleave(h / hkv, 0);
    }
    at::Tensor scores = at::matmul(qs, ks.transpose(1, 2)) * s;  // [heads, len, klen]
    if (causal) {
      at::Tensor above = at::ones({len, len}, at::TensorOptions().dtype(at::kBool)).triu(1);
      scores = scores.masked_fill(above.to(scores.device()), -INFINITY);
    }
    at::Tensor lse = at::logsumexp(scores, -1);  // [heads, len]
    at::Tensor p = at::exp(scores - lse.unsqueeze(-1));
    outs.push_back(at::matmul(p, vs).permute({1, 0, 2}));  // [len, heads, dim]
    lses.push_back(lse);
  }
  AttentionReference r;
  r.out = outs.empty() ? at::empty({0, h, d}, q.options().dtype(at::kDouble)) : at::cat(outs, 0);
  r.lse = lses.empty() ? at::empty({h, 0}, q.options().dtype(at::kDouble)) : at::cat(lses, 1);
  return r;
}

}  // namespace

AttentionReference attention_reference(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cu_seqlens,
                                       bool causal, double scale) {
  return reference(q, k, v, cu_seqlens, nullptr, causal, scale);
}

AttentionReference attention_reference(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                       const at::Tensor& cu_seqlens_k, bool causal, double scale) {
  return reference(q, k, v, cu_seqlens_q, &cu_seqlens_k, causal, scale);
}

}  // namespace colossal::kernels
