// Layers of the Llama family, numerically aligned with transformers 5 (same op order, fp32
// norms and rotary tables) so logits agree to float rounding.
#include "colossal/nn/layers.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numbers>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"

namespace colossal::nn {

bool use_fused_kernels(const at::Tensor& x) {
  return x.is_cuda() && kernels::enabled() && kernels::has_fused_kernels(x);
}

namespace {

void check_shard(const ShardSpec& s, int64_t size, const std::string& what) {
  COLOSSAL_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "shard spec of ", what, ": rank ",
                 s.rank, " / world ", s.world, " is invalid");
  COLOSSAL_CHECK(size % s.world == 0, "cannot shard ", what, ": size ", size,
                 " is not divisible by ", s.world);
}

// narrow + clone + set_data: the parameter keeps its identity (optimizer/hooks stay valid).
void shard_in_place(const at::Tensor& p, int64_t dim, const ShardSpec& s) {
  at::NoGradGuard ng;
  int64_t chunk = p.size(dim) / s.world;
  const_cast<at::Tensor&>(p).set_data(p.narrow(dim, s.rank * chunk, chunk).clone());
}

}  // namespace

// ---- Linear -------------------------------------------------------------------------------
Linear::Linear(int64_t in, int64_t out, bool bias, const at::TensorOptions& opts)
    : in_(in), out_(out), full_in_(in), full_out_(out), has_bias_(bias) {
  register_parameter("weight", at::empty({out, in}, opts));
  if (bias) register_parameter("bias", at::empty({out}, opts));
}

at::Tensor Linear::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  return has_bias_ ? at::linear(x, weight(), param("bias")) : at::linear(x, weight());
}

void Linear::shard(const ShardSpec& spec) {
  COLOSSAL_CHECK(!shard_spec_, "Linear ", name(), " is already sharded");
  if (spec.kind == ShardSpec::Kind::Column) {
    check_shard(spec, out_, "Linear out_features");
    shard_in_place(weight(), 0, spec);
    if (has_bias_) shard_in_place(param("bias"), 0, spec);
    out_ /= spec.world;
  } else if (spec.kind == ShardSpec::Kind::Row) {
    check_shard(spec, in_, "Linear in_features");
    shard_in_place(weight(), 1, spec);
    in_ /= spec.world;
  } else {
    throw Error(str("Linear supports column and row sharding, not ", to_string(spec.kind)));
  }
  shard_spec_ = spec;
}

at::Tensor Linear::shard_slice(const std::string& name, const at::Tensor& full) const {
  if (!shard_spec_) return full;
  const ShardSpec& s = *shard_spec_;
  if (s.kind == ShardSpec::Kind::Column) return full.narrow(0, s.rank * out_, out_);
  if (name == "weight") return full.narrow(1, s.rank * in_, in_);
  return full;  // row-parallel bias stays whole
}

std::vector<int64_t> Linear::full_shape(const std::string& name) const {
  if (name == "weight") return {full_out_, full_in_};
  return {full_out_};
}

// ---- Embedding ----------------------------------------------------------------------------
Embedding::Embedding(int64_t num, int64_t dim, std::optional<int64_t> padding_idx,
                     const at::TensorOptions& opts)
    : num_(num), dim_(dim), full_num_(num), padding_idx_(padding_idx) {
  COLOSSAL_CHECK_INPUT(!padding_idx || (*padding_idx >= 0 && *padding_idx < num), "pad_token_id ",
                       padding_idx.value_or(0), " is outside the vocabulary of ", num);
  register_parameter("weight", at::empty({num, dim}, opts));
}

at::Tensor Embedding::forward(const at::Tensor& ids) {
  ForwardScope scope(*this);
  if (!shard_spec_) return at::embedding(weight(), ids, padding_idx_.value_or(-1));
  at::Tensor in_range = (ids >= vocab_begin_) & (ids < vocab_begin_ + num_);
  at::Tensor local = at::where(in_range, ids - vocab_begin_, at::zeros_like(ids));
  int64_t pad = -1;
  if (padding_idx_ && *padding_idx_ >= vocab_begin_ && *padding_idx_ < vocab_begin_ + num_) {
    pad = *padding_idx_ - vocab_begin_;
  }
  return at::embedding(weight(), local, pad) * in_range.unsqueeze(-1).to(weight().scalar_type());
}

void Embedding::shard(const ShardSpec& spec) {
  COLOSSAL_CHECK(!shard_spec_, "Embedding ", name(), " is already sharded");
  COLOSSAL_CHECK(spec.kind == ShardSpec::Kind::Vocab, "Embedding supports vocab sharding, not ",
                 to_string(spec.kind));
  check_shard(spec, num_, "Embedding vocabulary");
  shard_in_place(weight(), 0, spec);
  num_ /= spec.world;
  vocab_begin_ = spec.rank * num_;
  shard_spec_ = spec;
}

at::Tensor Embedding::shard_slice(const std::string&, const at::Tensor& full) const {
  return shard_spec_ ? full.narrow(0, vocab_begin_, num_) : full;
}

std::vector<int64_t> Embedding::full_shape(const std::string&) const {
  return {full_num_, dim_};
}

// ---- RMSNorm ------------------------------------------------------------------------------
RMSNorm::RMSNorm(int64_t dim, double eps, const at::TensorOptions& opts) : eps_(eps) {
  register_parameter("weight", at::empty({dim}, opts));
}

std::pair<at::Tensor, at::Tensor> RMSNorm::forward_add(const at::Tensor& x, const at::Tensor& r) {
  ForwardScope scope(*this);
  if (use_fused_kernels(x) && x.scalar_type() == weight().scalar_type() &&
      r.scalar_type() == x.scalar_type() && r.sizes() == x.sizes())
    return kernels::add_rms_norm(x, r, weight(), eps_);
  at::Tensor h = x + r;
  return {h, forward(h)};
}

at::Tensor RMSNorm::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (use_fused_kernels(x) && x.scalar_type() == weight().scalar_type())
    return kernels::rms_norm(x, weight(), eps_);
  at::Tensor h = x.to(at::kFloat);
  at::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(var + eps_);
  return weight() * h.to(x.scalar_type());
}

// ---- Rotary -------------------------------------------------------------------------------
at::Tensor rope_inv_freq(const ModelConfig& cfg, std::optional<int64_t> seq_len) {
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

RotaryEmbedding::RotaryEmbedding(const ModelConfig& cfg)
    : cfg_(cfg),
      max_seq_len_cached_(cfg.max_position_embeddings),
      original_max_seq_len_(cfg.max_position_embeddings) {
  inv_freq_ = rope_inv_freq(cfg_);
  original_inv_freq_ = inv_freq_.clone();
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::forward(const at::Tensor& positions,
                                                           at::ScalarType dtype) {
  ForwardScope scope(*this);
  at::NoGradGuard ng;
  if (cfg_.rope.type == "dynamic") {
    int64_t seq_len = positions.max().item<int64_t>() + 1;
    if (seq_len > max_seq_len_cached_) {
      inv_freq_ = rope_inv_freq(cfg_, seq_len);
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
  if (cfg_.rope.type == "dynamic") return forward(positions(), dtype);
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

// ---- Attention ----------------------------------------------------------------------------
Attention::Attention(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts)
    : num_heads_(cfg.num_attention_heads),
      num_kv_heads_(cfg.num_key_value_heads),
      head_dim_(cfg.head_dim),
      layer_idx_(layer_idx) {
  const int64_t h = cfg.hidden_size;
  q_proj = register_module("q_proj",
                           std::make_shared<Linear>(h, num_heads_ * head_dim_, cfg.qkv_bias, opts));
  k_proj = register_module(
      "k_proj", std::make_shared<Linear>(h, num_kv_heads_ * head_dim_, cfg.qkv_bias, opts));
  v_proj = register_module(
      "v_proj", std::make_shared<Linear>(h, num_kv_heads_ * head_dim_, cfg.qkv_bias, opts));
  o_proj = register_module("o_proj",
                           std::make_shared<Linear>(num_heads_ * head_dim_, h, cfg.o_bias, opts));
}

at::Tensor Attention::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const AttentionMask& mask, KVCache* cache) {
  ForwardScope scope(*this);
  const int64_t b = x.size(0), s = x.size(1);
  // Head counts follow the (possibly column-sharded) projections.
  at::Tensor q, k, v;
  if (use_fused_kernels(x)) {
    // One GEMM for q, k and v (one dx GEMM in backward instead of three plus two adds). The
    // projections' own hooks still fire around the read of their weights.
    ForwardScope sq(*q_proj), sk(*k_proj), sv(*v_proj);
    std::vector<at::Tensor> w{q_proj->weight(), k_proj->weight(), v_proj->weight()}, bias;
    if (q_proj->has_bias())
      bias = {q_proj->param("bias"), k_proj->param("bias"), v_proj->param("bias")};
    std::vector<at::Tensor> qkv =
        kernels::linear_concat(x, w, bias)
            .split_with_sizes({q_proj->out_features(), k_proj->out_features(),
                               v_proj->out_features()},
                              -1);
    q = qkv[0].view({b, s, -1, head_dim_}).transpose(1, 2);
    k = qkv[1].view({b, s, -1, head_dim_}).transpose(1, 2);
    v = qkv[2].view({b, s, -1, head_dim_}).transpose(1, 2);
  } else {
    q = q_proj->forward(x).view({b, s, -1, head_dim_}).transpose(1, 2);
    k = k_proj->forward(x).view({b, s, -1, head_dim_}).transpose(1, 2);
    v = v_proj->forward(x).view({b, s, -1, head_dim_}).transpose(1, 2);
  }
  q = apply_rotary(q, cos, sin);
  k = apply_rotary(k, cos, sin);
  if (cache) std::tie(k, v) = cache->update(layer_idx_, k, v);
  const bool gqa = q.size(1) != k.size(1);
  at::Tensor out;
  if (mask.mask.defined()) {
    out = at::scaled_dot_product_attention(q, k, v, mask.mask, 0.0, false, std::nullopt, gqa);
  } else {
    out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, mask.causal && s > 1,
                                           std::nullopt, gqa);
  }
  out = out.transpose(1, 2).reshape({b, s, -1});
  return o_proj->forward(out);
}

// ---- MLP and decoder layer ----------------------------------------------------------------
MLP::MLP(const ModelConfig& cfg, const at::TensorOptions& opts) {
  gate_proj = register_module(
      "gate_proj",
      std::make_shared<Linear>(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, opts));
  up_proj = register_module(
      "up_proj",
      std::make_shared<Linear>(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, opts));
  down_proj = register_module(
      "down_proj",
      std::make_shared<Linear>(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, opts));
}

at::Tensor MLP::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (use_fused_kernels(x)) {
    // gate and up as one GEMM into a packed [.., 2F] tensor; SwiGLU reads it and writes its
    // gradient packed, which the concatenated GEMM's backward consumes directly.
    at::Tensor h;
    {
      ForwardScope sg(*gate_proj), su(*up_proj);
      std::vector<at::Tensor> w{gate_proj->weight(), up_proj->weight()}, bias;
      if (gate_proj->has_bias()) bias = {gate_proj->param("bias"), up_proj->param("bias")};
      h = kernels::swiglu_packed(kernels::linear_concat(x, w, bias));
    }
    return down_proj->forward(h);
  }
  at::Tensor gate = gate_proj->forward(x), up = up_proj->forward(x);
  return down_proj->forward(at::silu(gate) * up);
}

DecoderLayer::DecoderLayer(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts)
    : sliding_(cfg.uses_sliding(layer_idx)) {
  self_attn = register_module("self_attn", std::make_shared<Attention>(cfg, layer_idx, opts));
  mlp = register_module("mlp", std::make_shared<MLP>(cfg, opts));
  input_layernorm = register_module(
      "input_layernorm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps, opts));
  post_attention_layernorm =
      register_module("post_attention_layernorm",
                      std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps, opts));
}

bool DecoderLayer::recomputes(const KVCache* cache) const {
  return !cache && checkpointing != CheckpointMode::None && at::GradMode::is_enabled();
}

std::pair<at::Tensor, at::Tensor> DecoderLayer::forward_deferred(
    const at::Tensor& x, const at::Tensor& delta, const at::Tensor& cos, const at::Tensor& sin,
    const AttentionMask& mask, KVCache* cache) {
  ForwardScope scope(*this);
  COLOSSAL_CHECK(!recomputes(cache),
                 "DecoderLayer::forward_deferred: layers with activation checkpointing take "
                 "forward()");
  at::Tensor h, n;
  if (delta.defined()) {
    std::tie(h, n) = input_layernorm->forward_add(x, delta);
  } else {
    h = x;
    n = input_layernorm->forward(x);
  }
  auto [h2, n2] =
      post_attention_layernorm->forward_add(h, self_attn->forward(n, cos, sin, mask, cache));
  return {h2, mlp->forward(n2)};
}

at::Tensor DecoderLayer::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const AttentionMask& mask, KVCache* cache) {
  ForwardScope scope(*this);
  const CheckpointMode mode = cache ? CheckpointMode::None : checkpointing;
  auto attention = [&](const at::Tensor& in) {
    return self_attn->forward(input_layernorm->forward(in), cos, sin, mask, cache);
  };
  auto whole = [&](const at::Tensor& in) {
    at::Tensor h = in + attention(in);
    return h + mlp->forward(post_attention_layernorm->forward(h));
  };
  if (mode == CheckpointMode::None) return whole(x);
  // The recompute runs in backward, after this frame is gone: capture by value.
  auto self = std::static_pointer_cast<DecoderLayer>(shared_from_this());
  if (mode == CheckpointMode::Full) {
    return checkpoint(
        [self, cos, sin, mask](const at::Tensor& in) {
          at::Tensor h = in + self->self_attn->forward(self->input_layernorm->forward(in), cos, sin,
                                                       mask, nullptr);
          return h + self->mlp->forward(self->post_attention_layernorm->forward(h));
        },
        x, parameters());
  }
  std::vector<at::Tensor> attn_params = input_layernorm->parameters();
  for (auto& p : self_attn->parameters()) attn_params.push_back(p);
  at::Tensor h = x + checkpoint(
                         [self, cos, sin, mask](const at::Tensor& in) {
                           return self->self_attn->forward(self->input_layernorm->forward(in), cos,
                                                           sin, mask, nullptr);
                         },
                         x, attn_params);
  return h + mlp->forward(post_attention_layernorm->forward(h));
}

}  // namespace colossal::nn
