// KV cache and the SDPA core attention.
#include "colossal/nn/attention.h"

#include <ATen/ATen.h>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/kernels/attention.h"
#include "colossal/nn/sequence_parallel.h"

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

// ---- Documents ----------------------------------------------------------------------------
DocumentMask make_documents(const at::Tensor& ids_cpu, const at::Device& device) {
  COLOSSAL_CHECK(ids_cpu.dim() == 2 && ids_cpu.scalar_type() == at::kLong && ids_cpu.is_cpu(),
                 "document ids must be an int64 [batch, seq] CPU tensor, got ",
                 ids_cpu.scalar_type(), " ", ids_cpu.sizes(), " on ", ids_cpu.device());
  at::Tensor ids = ids_cpu.contiguous();
  const int64_t B = ids.size(0), S = ids.size(1);
  const int64_t* p = ids.data_ptr<int64_t>();
  std::vector<int32_t> cu{0};
  int64_t max_len = 0, start = 0;
  COLOSSAL_CHECK(B * S < (int64_t{1} << 31), "document masks: ", B, " x ", S,
                 " tokens exceed the int32 offsets of the variable-length kernels");
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < S; ++j) {
      const int64_t t = b * S + j;
      if (j > 0 && p[t] == p[t - 1]) continue;
      if (t > 0) {
        cu.push_back(static_cast<int32_t>(t));
        max_len = std::max(max_len, t - start);
      }
      start = t;
    }
  }
  if (B * S > 0) {
    cu.push_back(static_cast<int32_t>(B * S));
    max_len = std::max(max_len, B * S - start);
  }
  DocumentMask d;
  d.ids = upload_async(ids, device);
  d.cu_seqlens_cpu = at::tensor(cu, at::kInt);
  d.cu_seqlens = upload_async(d.cu_seqlens_cpu, device);
  d.max_len = max_len;
  return d;
}

at::Tensor document_causal_mask(const at::Tensor& ids) {
  const int64_t S = ids.size(1);
  at::Tensor same = ids.unsqueeze(2) == ids.unsqueeze(1);  // [B, S, S]
  at::Tensor causal = at::ones({S, S}, ids.options().dtype(at::kBool)).tril();
  return (same & causal).unsqueeze(1);
}

// ---- Core attention -----------------------------------------------------------------------
namespace {

// Packed documents through the variable-length flash kernel: q [B, Hq, S, D] -> the tokens as
// [B*S, H, D] rows, causal inside each cu_seqlens segment. Differentiable (ATen's
// FlashAttentionBackward0).
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const DocumentMask& d) {
  const int64_t B = q.size(0), S = q.size(2), D = q.size(3);
  auto rows = [&](const at::Tensor& x) { return x.transpose(1, 2).reshape({B * S, x.size(1), D}); };
  auto out = std::get<0>(at::_flash_attention_forward(rows(q), rows(k), rows(v), d.cu_seqlens,
                                                      d.cu_seqlens, d.max_len, d.max_len, 0.0,
                                                      /*is_causal=*/true, false));
  return out.view({B, S, q.size(1), D}).transpose(1, 2);
}

}  // namespace

bool varlen_attention_applies(const at::Tensor& q, const AttentionMask& mask) {
  const auto dt = q.scalar_type();
  return mask.documents.defined() && !mask.mask.defined() && q.is_cuda() &&
         (dt == at::kHalf || dt == at::kBFloat16) && q.size(3) % 8 == 0 && q.size(3) <= 256;
}

at::Tensor SdpaAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionMask& mask, const SequenceInfo& seq) {
  ForwardScope scope(*this);
  const bool gqa = q.size(1) != k.size(1);
  if (mask.documents.defined()) {
    COLOSSAL_CHECK(seq.past == 0 && !seq.sharded() && k.size(2) == q.size(2) &&
                       mask.documents.ids.size(0) == q.size(0) &&
                       mask.documents.ids.size(1) == q.size(2),
                   "document masks apply to whole sequences without a KV cache: q ", q.sizes(),
                   ", k ", k.sizes(), ", document ids ", mask.documents.ids.sizes());
    if (varlen_attention_applies(q, mask)) return varlen_attention(q, k, v, mask.documents);
    at::Tensor dense = document_causal_mask(mask.documents.ids);
    if (mask.mask.defined()) dense = dense & mask.mask;
    return at::scaled_dot_product_attention(q, k, v, dense, 0.0, false, std::nullopt, gqa);
  }
  if (mask.mask.defined())
    return at::scaled_dot_product_attention(q, k, v, mask.mask, 0.0, false, std::nullopt, gqa);
  // is_causal aligns the query block at the top-left of the keys: right only without a cache
  // (the model passes an explicit mask otherwise) and for more than one query.
  return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, mask.causal && q.size(2) > 1,
                                          std::nullopt, gqa);
}

// ---- Our kernels ----------------------------------------------------------------------------
std::string own_attention_fallback(const at::Tensor& q, const at::Tensor& k,
                                   const AttentionMask& mask, const SequenceInfo& seq) {
  if (seq.past > 0 || seq.sharded())
    return "a KV cache or a sequence shard (decoding, ring attention) goes to SDPA";
  if (q.dim() != 4 || k.dim() != 4 || k.size(2) != q.size(2))
    return "keys of another length than the queries go to SDPA";
  if (mask.mask.defined()) return "an explicit attention mask goes to SDPA";
  return kernels::own_attention_unsupported(q.select(0, 0), k.select(0, 0));
}

std::string OwnAttention::summary() const {
  // The settings a measurement depends on: the schedule, the head sections' L2 budget, the
  // backward's launch order and deterministic mode (which `auto` launches at its own setting).
  const int64_t interleave = kernels::attention_bwd_interleave();
  std::string s = str(
      "own ", own_calls_, " calls (schedule ", kernels::to_string(kernels::attention_schedule()),
      ", L2 ", kernels::attention_l2_budget() >> 20, " MiB, backward order ",
      interleave == kernels::kAttentionBwdInterleaveAuto ? std::string("auto")
                                                         : std::to_string(interleave),
      deterministic_ ? ", deterministic" : "", "), SDPA ", fallback_calls_);
  if (fallback_calls_ > 0) s += str(" (", fallback_reason_, ")");
  return s;
}

at::Tensor OwnAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionMask& mask, const SequenceInfo& seq) {
  ForwardScope scope(*this);
  const std::string why = own_attention_fallback(q, k, mask, seq);
  if (!why.empty()) {
    if (fallback_calls_++ == 0) fallback_reason_ = why;
    return sdpa_.forward(q, k, v, mask, seq);
  }
  ++own_calls_;
  const int64_t B = q.size(0), S = q.size(2), D = q.size(3);
  // [B, H, S, D] -> the tokens as rows [B*S, H, D] (free when the heads were transposed out of
  // a [B, S, H, D] projection output, as the model's are).
  auto rows = [&](const at::Tensor& x) { return x.transpose(1, 2).reshape({B * S, x.size(1), D}); };
  at::Tensor cu;
  int64_t max_len = S;
  if (mask.documents.defined()) {
    COLOSSAL_CHECK(mask.documents.ids.size(0) == B && mask.documents.ids.size(1) == S,
                   "document ids ", mask.documents.ids.sizes(), " do not match q ", q.sizes());
    cu = mask.documents.cu_seqlens_cpu.defined() ? mask.documents.cu_seqlens_cpu
                                                 : mask.documents.cu_seqlens;
    max_len = mask.documents.max_len;
  } else {
    if (!uniform_cu_.defined() || uniform_cu_.numel() != B + 1 ||
        (B > 0 && uniform_cu_[1].item<int64_t>() != S))
      uniform_cu_ = at::arange(0, B * S + 1, std::max<int64_t>(S, 1), at::kInt);
    cu = uniform_cu_;
  }
  at::Tensor out =
      kernels::attention(rows(q), rows(k), rows(v), cu, max_len,
                         (mask.causal || mask.documents.defined()) && S > 1, 0, deterministic_);
  return out.view({B, S, q.size(1), D}).transpose(1, 2);
}

std::pair<std::shared_ptr<OwnAttention>, int64_t> use_own_attention(torch::nn::Module& root,
                                                                    bool deterministic) {
  // A bad COLOSSAL_ATTENTION_SCHEDULE, COLOSSAL_ATTENTION_L2_MB or
  // COLOSSAL_ATTENTION_BWD_INTERLEAVE fails here, not later.
  (void)kernels::attention_schedule();
  (void)kernels::attention_l2_budget();
  (void)kernels::attention_bwd_interleave();
  auto own = std::make_shared<OwnAttention>(deterministic);
  std::vector<std::string> paths;
  for (const auto& item : root.named_modules("", false)) {
    const auto& m = item.value();
    if (m && typeid(*m) == typeid(SdpaAttention)) paths.push_back(item.key());
  }
  for (const std::string& path : paths) replace_module(root, path, own);
  // ring_attn's slots keep their kind; their blocks pick their kernel (ring_block_kernel) and
  // follow the deterministic setting.
  for (const auto& item : root.named_modules("", false))
    if (auto* ring = dynamic_cast<RingAttention*>(item.value().get()))
      ring->set_deterministic(deterministic);
  return {own, static_cast<int64_t>(paths.size())};
}

}  // namespace colossal::nn
