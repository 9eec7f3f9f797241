// Rotary position embedding, computed as transformers 5 does (fp32 tables, same op order).
#include "colossal/nn/rotary.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numbers>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/linear.h"

namespace colossal::nn {

// ---- Rotary -------------------------------------------------------------------------------
at::Tensor rope_inv_freq(const RotaryOptions& cfg, std::optional<int64_t> seq_len) {
  const int64_t dim = cfg.head_dim;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const RopeConfig& r = cfg.rope;
  auto base_freq = [&](const at::Tensor& base) {
    // 1 / base^(arange(0, dim, 2) / dim), in fp32 as transformers computes it.
    at::Tensor ex =
        at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
    return at::reciprocal(at::pow(base, ex));
  };
  if (r.type == "default") {
    at::Tensor ex = at::arange(0, dim, 2, f32) / dim;
    return at::reciprocal(at::pow(r.theta, ex));
  }
  if (r.type == "linear") {
    at::Tensor ex =
        at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
    return at::reciprocal(at::pow(r.theta, ex)) / r.factor;
  }
  if (r.type == "dynamic") {
    const int64_t mpe = cfg.max_position_embeddings;
    if (!seq_len) {
      // At construction HF passes no seq_len: python-float arithmetic, base unchanged.
      double base =
          r.theta * std::pow((r.factor * mpe / mpe) - (r.factor - 1), double(dim) / (dim - 2));
      at::Tensor ex =
          at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
      return at::reciprocal(at::pow(base, ex));
    }
    // In forward HF passes seq_len as a tensor: the base is computed in fp32 tensor arithmetic.
    at::Tensor s =
        at::maximum(at::scalar_tensor(*seq_len, at::kLong), at::scalar_tensor(mpe, at::kLong));
    at::Tensor t = r.factor * s;  // int64 tensor * python float -> fp32
    t = t / mpe;
    t = t - (r.factor - 1);
    t = at::pow(t, double(dim) / (dim - 2));
    at::Tensor base = r.theta * t;
    return base_freq(base);
  }
  if (r.type == "llama3") {
    at::Tensor ex =
        at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
    at::Tensor inv_freq = at::reciprocal(at::pow(r.theta, ex));
    const double old_ctx = double(r.original_max_position_embeddings);
    const double low_wl = old_ctx / r.low_freq_factor, high_wl = old_ctx / r.high_freq_factor;
    at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * std::numbers::pi);
    at::Tensor llama = at::where(wavelen > low_wl, inv_freq / r.factor, inv_freq);
    at::Tensor smooth = (at::reciprocal(wavelen) * old_ctx - r.low_freq_factor) /
                        (r.high_freq_factor - r.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * llama / r.factor + smooth * llama;
    at::Tensor medium = at::logical_not(wavelen < high_wl) * at::logical_not(wavelen > low_wl);
    return at::where(medium, smoothed, llama);
  }
  throw InputError(str("rope type '", r.type, "' is not supported"));
}

RotaryEmbedding::RotaryEmbedding(const RotaryOptions& cfg)
    : opts_(cfg),
      max_seq_len_cached_(cfg.max_position_embeddings),
      original_max_seq_len_(cfg.max_position_embeddings) {
  inv_freq_ = rope_inv_freq(opts_);
  original_inv_freq_ = inv_freq_.clone();
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::forward(const at::Tensor& positions,
                                                           at::ScalarType dtype) {
  ForwardScope scope(*this);
  at::NoGradGuard ng;
  if (opts_.rope.type == "dynamic") {
    int64_t seq_len = positions.max().item<int64_t>() + 1;
    if (seq_len > max_seq_len_cached_) {
      inv_freq_ = rope_inv_freq(opts_, seq_len);
      max_seq_len_cached_ = seq_len;
    }
    if (seq_len < original_max_seq_len_ && max_seq_len_cached_ > original_max_seq_len_) {
      inv_freq_ = original_inv_freq_;
      max_seq_len_cached_ = original_max_seq_len_;
    }
  }
  if (!inv_freq_device_.defined() || inv_freq_device_.device() != positions.device() ||
      !inv_freq_device_src_.is_same(inv_freq_)) {
    inv_freq_device_ = inv_freq_.to(positions.device());
    inv_freq_device_src_ = inv_freq_;
  }
  const at::Tensor& inv = inv_freq_device_;
  // [B, D/2, 1] @ [B, 1, S] -> [B, D/2, S] -> [B, S, D/2]
  at::Tensor freqs = at::matmul(inv.unsqueeze(0).unsqueeze(-1).expand({positions.size(0), -1, 1}),
                                positions.unsqueeze(1).to(at::kFloat))
                         .transpose(1, 2);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::forward_range(int64_t start, int64_t end,
                                                                 at::Device device,
                                                                 at::ScalarType dtype) {
  auto positions = [&] {
    return at::arange(start, end, at::TensorOptions().dtype(at::kLong).device(device)).unsqueeze(0);
  };
  if (opts_.rope.type == "dynamic") return forward(positions(), dtype);
  Cached& c = cached_;
  if (c.start != start || c.end != end || c.device != device || c.dtype != dtype ||
      !c.cos.defined()) {
    auto [cos, sin] = forward(positions(), dtype);
    c = Cached{start, end, device, dtype, cos, sin};
  }
  return {c.cos, c.sin};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // cos/sin are [B, S, D] or [1, S, D] (positions shared by the batch: the usual case).
  if (use_fused_kernels(x) && x.dim() == 4 && cos.dim() == 3 &&
      x.scalar_type() == cos.scalar_type() && (cos.size(0) == x.size(0) || cos.size(0) == 1) &&
      x.size(2) == cos.size(1) && x.size(3) == cos.size(2))
    return kernels::apply_rotary(x, cos, sin);
  at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  int64_t half = x.size(-1) / 2;
  at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rot * s;
}

}  // namespace colossal::nn
