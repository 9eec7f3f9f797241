// Llama-family causal LM: attention, MLP and decoder layer over the generic layers of nn/, the
// block layout, masks, forward over the owned blocks, loss, greedy decoding with a KV cache.
#include "colossal/models/llama/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/fused_ce.h"

namespace colossal::models {

using nn::EmbeddingOptions;
using nn::LinearOptions;
using nn::use_fused_kernels;

// ---- Attention ----------------------------------------------------------------------------
Attention::Attention(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts)
    : head_dim_(cfg.head_dim), layer_idx_(layer_idx) {
  const int64_t h = cfg.hidden_size, q = cfg.num_attention_heads * cfg.head_dim;
  auto linear = [&](int64_t in, int64_t out, bool bias, int64_t heads = 0) {
    return std::make_shared<nn::Linear>(
        LinearOptions(in, out).bias(bias).heads(heads).tensor_options(opts));
  };
  // k/v say their heads: column sharding over more ranks than kv heads replicates each head on
  // the ranks whose query heads read it (rank r: kv head r * kv / tp), never splits one.
  register_slot("q_proj", q_proj, linear(h, q, cfg.qkv_bias));
  register_slot("k_proj", k_proj, linear(h, cfg.kv_dim(), cfg.qkv_bias, cfg.num_key_value_heads));
  register_slot("v_proj", v_proj, linear(h, cfg.kv_dim(), cfg.qkv_bias, cfg.num_key_value_heads));
  register_slot("o_proj", o_proj, linear(q, h, cfg.o_bias));
  register_slot<nn::CoreAttention>("core_attn", core_attn, std::make_shared<nn::SdpaAttention>());
}

at::Tensor Attention::forward(const at::Tensor& x, const LayerContext& ctx) {
  ForwardScope scope(*this);
  const int64_t b = x.size(0);
  // Head counts follow the (possibly column-sharded) projections: views take -1 heads. The
  // sequence length is the projections' output length (a column linear under split_gather
  // gathers the sequence).
  at::Tensor q, k, v;
  if (auto qkv = nn::fused_projections(x, {q_proj.get(), k_proj.get(), v_proj.get()})) {
    // One GEMM for q, k and v (one dx GEMM in backward instead of three plus two adds).
    std::vector<at::Tensor> parts = qkv->split_with_sizes(
        {q_proj->out_features(), k_proj->out_features(), v_proj->out_features()}, -1);
    q = parts[0];
    k = parts[1];
    v = parts[2];
  } else {
    q = q_proj->forward(x);
    k = k_proj->forward(x);
    v = v_proj->forward(x);
  }
  const int64_t s = q.size(1);
  // Local heads: q holds heads / tp, k and v kv / tp or (kv < tp) the one head this rank's
  // query heads share; SDPA's GQA maps query head i to kv head i / (q heads / kv heads).
  COLOSSAL_CHECK(k.size(-1) > 0 && q.size(-1) % k.size(-1) == 0, "attention ", name(), ": ",
                 q.size(-1) / head_dim_, " local query heads cannot share ", k.size(-1) / head_dim_,
                 " local key/value heads");
  q = q.view({b, s, -1, head_dim_}).transpose(1, 2);
  k = k.view({b, s, -1, head_dim_}).transpose(1, 2);
  v = v.view({b, s, -1, head_dim_}).transpose(1, 2);
  // The tables cover the whole step (unless built from ForwardOptions::positions: then they are
  // this rank's already); a layer holding only this rank's tokens takes their part.
  at::Tensor cos = ctx.cos, sin = ctx.sin;
  if (ctx.seq.sharded() && s == ctx.seq.local_len && cos.size(1) == ctx.seq.global_len) {
    cos = cos.narrow(1, ctx.seq.offset, s);
    sin = sin.narrow(1, ctx.seq.offset, s);
  }
  q = nn::apply_rotary(q, cos, sin);
  k = nn::apply_rotary(k, cos, sin);
  if (ctx.cache) std::tie(k, v) = ctx.cache->update(layer_idx_, k, v);
  at::Tensor out = core_attn->forward(q, k, v, ctx.mask, ctx.seq);
  out = out.transpose(1, 2).reshape({b, s, -1});
  return o_proj->forward(out);
}

// ---- MLP and decoder layer ----------------------------------------------------------------
MLP::MLP(const ModelConfig& cfg, const at::TensorOptions& opts) {
  auto linear = [&](int64_t in, int64_t out) {
    return std::make_shared<nn::Linear>(
        LinearOptions(in, out).bias(cfg.mlp_bias).tensor_options(opts));
  };
  register_slot("gate_proj", gate_proj, linear(cfg.hidden_size, cfg.intermediate_size));
  register_slot("up_proj", up_proj, linear(cfg.hidden_size, cfg.intermediate_size));
  register_slot("down_proj", down_proj, linear(cfg.intermediate_size, cfg.hidden_size));
}

at::Tensor MLP::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (auto packed = nn::fused_projections(x, {gate_proj.get(), up_proj.get()})) {
    // gate and up as one GEMM into a packed [.., 2F] tensor; SwiGLU reads it and writes its
    // gradient packed, which the concatenated GEMM's backward consumes directly.
    return down_proj->forward(kernels::swiglu_packed(*packed));
  }
  // Separate projections (another layer kind in gate or up: LoRA, FP8, QLoRA, tensor-parallel):
  // their outputs still meet in our SwiGLU kernel on the GPU (one pass each way instead of
  // silu, mul and their backward's three).
  at::Tensor gate = gate_proj->forward(x), up = up_proj->forward(x);
  return down_proj->forward(use_fused_kernels(gate) ? kernels::swiglu(gate, up)
                                                    : at::silu(gate) * up);
}

DecoderLayer::DecoderLayer(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts)
    : sliding_(cfg.uses_sliding(layer_idx)) {
  register_slot("self_attn", self_attn, std::make_shared<Attention>(cfg, layer_idx, opts));
  register_slot<nn::FeedForward>("mlp", mlp, std::make_shared<MLP>(cfg, opts));
  register_slot("input_layernorm", input_layernorm,
                std::make_shared<nn::RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps, opts));
  register_slot("post_attention_layernorm", post_attention_layernorm,
                std::make_shared<nn::RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps, opts));
}

MLP& DecoderLayer::dense_mlp() const {
  auto* m = dynamic_cast<MLP*>(mlp.get());
  COLOSSAL_CHECK(m != nullptr, "decoder layer ", name(), ": its mlp is not the dense MLP");
  return *m;
}

bool DecoderLayer::recomputes(const KVCache* cache) const {
  return !cache && checkpointing != CheckpointMode::None && at::GradMode::is_enabled();
}

std::pair<at::Tensor, at::Tensor> DecoderLayer::forward_deferred(const at::Tensor& x,
                                                                 const at::Tensor& delta,
                                                                 const LayerContext& ctx) {
  ForwardScope scope(*this);
  COLOSSAL_CHECK(!recomputes(ctx.cache),
                 "DecoderLayer::forward_deferred: layers with activation checkpointing take "
                 "forward()");
  at::Tensor h, n;
  if (delta.defined()) {
    std::tie(h, n) = input_layernorm->forward_add(x, delta);
  } else {
    h = x;
    n = input_layernorm->forward(x);
  }
  auto [h2, n2] = post_attention_layernorm->forward_add(h, self_attn->forward(n, ctx));
  return {h2, mlp->forward(n2)};
}

at::Tensor DecoderLayer::forward(const at::Tensor& x, const LayerContext& ctx) {
  ForwardScope scope(*this);
  const CheckpointMode mode = ctx.cache ? CheckpointMode::None : checkpointing;
  auto attention = [&](const at::Tensor& in) {
    return self_attn->forward(input_layernorm->forward(in), ctx);
  };
  auto whole = [&](const at::Tensor& in) {
    at::Tensor h = in + attention(in);
    return h + mlp->forward(post_attention_layernorm->forward(h));
  };
  if (mode == CheckpointMode::None) return whole(x);
  // The recompute runs in backward, after this frame is gone: capture by value (no cache:
  // recomputing layers never use one).
  auto self = std::static_pointer_cast<DecoderLayer>(shared_from_this());
  LayerContext c = ctx;
  if (mode == CheckpointMode::Full) {
    return nn::checkpoint(
        [self, c](const at::Tensor& in) {
          at::Tensor h = in + self->self_attn->forward(self->input_layernorm->forward(in), c);
          return h + self->mlp->forward(self->post_attention_layernorm->forward(h));
        },
        x, parameters());
  }
  std::vector<at::Tensor> attn_params = input_layernorm->parameters();
  for (auto& p : self_attn->parameters()) attn_params.push_back(p);
  at::Tensor h = x + nn::checkpoint(
                         [self, c](const at::Tensor& in) {
                           return self->self_attn->forward(self->input_layernorm->forward(in), c);
                         },
                         x, attn_params);
  return h + mlp->forward(post_attention_layernorm->forward(h));
}

// ---- Layer list, decoder model, causal LM -------------------------------------------------
void LayerList::add(std::shared_ptr<DecoderLayer> layer) {
  const size_t i = layers.size();
  const std::string name = std::to_string(i);
  layers.push_back(register_module(name, std::move(layer)));
  register_setter(name, typeid(DecoderLayer).name(),
                  [this, i](const std::shared_ptr<torch::nn::Module>& m) {
                    auto typed = std::dynamic_pointer_cast<DecoderLayer>(m);
                    if (!typed && m) return false;
                    layers[i] = std::move(typed);
                    return true;
                  });
}

void LayerList::drop(int64_t index) {
  if (layers.at(index)) drop_child(std::to_string(index));
}

DecoderModel::DecoderModel(const ModelConfig& cfg, const at::TensorOptions& opts) {
  register_slot("embed_tokens", embed_tokens,
                std::make_shared<nn::Embedding>(EmbeddingOptions(cfg.vocab_size, cfg.hidden_size)
                                                    .padding_idx(cfg.pad_token_id)
                                                    .tensor_options(opts)));
  register_slot("layers", layers, std::make_shared<LayerList>());
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    layers->add(std::make_shared<DecoderLayer>(cfg, i, opts));
  register_slot("norm", norm,
                std::make_shared<nn::RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps, opts));
  register_slot("rotary_emb", rotary_emb, std::make_shared<nn::RotaryEmbedding>(cfg.rotary()));
}

CausalLM::CausalLM(const ModelConfig& cfg, const at::TensorOptions& opts)
    : config_(cfg), chunks_{{0, cfg.num_hidden_layers + 3}} {
  config_.validate();
  register_slot("model", model, std::make_shared<DecoderModel>(config_, opts));
  if (!config_.tie_word_embeddings) {
    register_slot(
        "lm_head", lm_head,
        std::make_shared<nn::Linear>(
            LinearOptions(cfg.hidden_size, cfg.vocab_size).bias(false).tensor_options(opts)));
  }
}

const at::Tensor& CausalLM::head_weight() const {
  if (lm_head) return lm_head->weight();
  COLOSSAL_CHECK(model->embed_tokens,
                 "tied lm_head needs model.embed_tokens, which this stage dropped");
  return model->embed_tokens->weight();
}

bool CausalLM::vocab_parallel_head() const {
  if (lm_head) return lm_head->vocab_parallel_head();
  return model && model->embed_tokens && model->embed_tokens->vocab_parallel_head();
}

void CausalLM::check_tied_head() const {
  const at::Tensor& w = head_weight();
  // A vocab-sharded embedding holds a slice of the rows: its product would be a slice of the
  // logits, silently. The vocab-parallel head and loss belong to the tensor-parallel plan.
  COLOSSAL_CHECK(lm_head || w.size(0) == config_.vocab_size,
                 "the tied lm_head reads model.embed_tokens, which holds ", w.size(0), " of the ",
                 config_.vocab_size,
                 " vocabulary rows on this rank (vocab-sharded); a tied head needs the whole "
                 "vocabulary");
}

void CausalLM::set_activation_checkpointing(CheckpointMode mode, int64_t num_layers) {
  int64_t owned = 0;
  for (auto& layer : model->layers->layers)
    if (layer) ++owned;
  COLOSSAL_CHECK_INPUT(num_layers <= owned, "activation checkpointing of ", num_layers,
                       " layers: this model owns only ", owned, " decoder layers");
  int64_t given = 0;
  for (auto& layer : model->layers->layers)
    if (layer)
      layer->checkpointing = (num_layers < 0 || given++ < num_layers) ? mode : CheckpointMode::None;
  checkpointing_ = num_layers == 0 ? CheckpointMode::None : mode;
}

void CausalLM::set_activation_checkpointing(CheckpointMode mode,
                                            const std::vector<int64_t>& per_chunk) {
  const int64_t L = config_.num_hidden_layers;
  COLOSSAL_CHECK_INPUT(static_cast<int64_t>(per_chunk.size()) == num_chunks(),
                       "activation checkpointing per chunk: ", per_chunk.size(),
                       " entries for a model of ", num_chunks(), " chunks");
  // Layers of chunk c: its blocks within [1, L].
  auto layers_of = [&](int64_t c) {
    return std::pair{std::max<int64_t>(chunks_[c].first, 1),
                     std::min<int64_t>(chunks_[c].second, L + 1)};
  };
  for (int64_t c = 0; c < num_chunks(); ++c) {
    const auto [b, e] = layers_of(c);
    const int64_t n = std::max<int64_t>(e - b, 0);
    COLOSSAL_CHECK_INPUT(per_chunk[c] <= n, "activation checkpointing of ", per_chunk[c],
                         " layers in chunk ", c, ": it holds only ", n, " decoder layers");
  }
  bool any = false;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    const auto [b, e] = layers_of(c);
    for (int64_t i = b; i < e; ++i) {
      const bool on = per_chunk[c] < 0 || i - b < per_chunk[c];
      model->layers->layers[i - 1]->checkpointing = on ? mode : CheckpointMode::None;
      any = any || on;
    }
  }
  checkpointing_ = any ? mode : CheckpointMode::None;
}

std::string CausalLM::block_name(int64_t i) const {
  const int64_t L = config_.num_hidden_layers;
  COLOSSAL_CHECK_INPUT(0 <= i && i < num_blocks(), "block ", i, " of a model of ", num_blocks(),
                       " blocks");
  if (i == 0) return "model.embed_tokens";
  if (i <= L) return "model.layers." + std::to_string(i - 1);
  return i == L + 1 ? "model.norm" : "lm_head";
}

std::vector<Block> CausalLM::blocks() const {
  std::vector<Block> out;
  const int64_t L = config_.num_hidden_layers;
  for (int64_t i = 0; i < num_blocks(); ++i) {
    if (!owns_block(i)) continue;
    std::shared_ptr<torch::nn::Module> m;
    if (i == 0) {
      m = model->embed_tokens;
    } else if (i <= L) {
      m = model->layers->layers[i - 1];
    } else if (i == L + 1) {
      m = model->norm;
    } else {
      m = lm_head;
    }
    out.push_back({block_name(i), std::move(m)});
  }
  return out;
}

bool CausalLM::owns_block(int64_t i) const {
  for (const auto& [b, e] : chunks_)
    if (b <= i && i < e) return true;
  return false;
}

std::pair<int64_t, int64_t> CausalLM::chunk_blocks(int64_t c) const {
  COLOSSAL_CHECK_INPUT(0 <= c && c < num_chunks(), "chunk ", c, " of a model holding ",
                       num_chunks(), " chunks");
  return chunks_[c];
}

int64_t CausalLM::first_block() const {
  int64_t first = num_blocks();
  for (const auto& r : chunks_) first = std::min(first, r.first);
  return first;
}

int64_t CausalLM::end_block() const {
  int64_t end = 0;
  for (const auto& r : chunks_) end = std::max(end, r.second);
  return end;
}

bool CausalLM::whole() const {
  return chunks_.size() == 1 && chunks_[0].first == 0 && chunks_[0].second == num_blocks();
}

std::vector<std::string> CausalLM::dropped_blocks() const {
  std::vector<std::string> out;
  for (int64_t i = 0; i < num_blocks(); ++i)
    if (!owns_block(i) && !(i == 0 && tied_copy_)) out.push_back(block_name(i));
  return out;
}

void CausalLM::keep_blocks(int64_t begin, int64_t end) {
  keep_chunks({{begin, end}});
}

void CausalLM::keep_chunks(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  const int64_t n = num_blocks(), L = config_.num_hidden_layers;
  COLOSSAL_CHECK_INPUT(!ranges.empty(), "keep_chunks: no block ranges (a stage keeps >= 1 chunk)");
  for (const auto& [b, e] : ranges) {
    COLOSSAL_CHECK_INPUT(0 <= b && b < e && e <= n, "keep_chunks: block range [", b, ", ", e,
                         ") is empty or outside the model's [0, ", n, ")");
    for (int64_t i = b; i < e; ++i)
      COLOSSAL_CHECK_INPUT(owns_block(i), "keep_chunks: block range [", b, ", ", e,
                           ") includes block ", i, " (", block_name(i),
                           "), which this model no longer owns");
  }
  std::vector<std::pair<int64_t, int64_t>> sorted = ranges;
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 1; k < sorted.size(); ++k)
    COLOSSAL_CHECK_INPUT(sorted[k].first >= sorted[k - 1].second, "keep_chunks: block ranges [",
                         sorted[k - 1].first, ", ", sorted[k - 1].second, ") and [",
                         sorted[k].first, ", ", sorted[k].second, ") overlap");
  auto keep = [&](int64_t i) {
    for (const auto& [b, e] : ranges)
      if (b <= i && i < e) return true;
    return false;
  };
  // A tied head keeps the embedding module as its weight (not as a block).
  const bool tied_copy = config_.tie_word_embeddings && keep(L + 2) && !keep(0);
  if (!keep(0) && !tied_copy && model->embed_tokens) model->drop_child("embed_tokens");
  for (int64_t i = 0; i < L; ++i)
    if (!keep(i + 1)) model->layers->drop(i);
  if (!keep(L + 1) && model->norm) model->drop_child("norm");
  if (!keep(L + 2) && lm_head) drop_child("lm_head");
  chunks_ = ranges;
  tied_copy_ = tied_copy;
}

namespace {

// bool [B|1, 1, S, past+S]: causal, optionally a sliding window and key padding.
at::Tensor build_mask(int64_t past, int64_t s, std::optional<int64_t> window,
                      const at::Tensor& padding, const at::Device& device) {
  const int64_t kv = past + s;
  auto lopt = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor q = at::arange(past, kv, lopt).unsqueeze(1);
  at::Tensor k = at::arange(0, kv, lopt).unsqueeze(0);
  at::Tensor m = k <= q;
  if (window) m = m & (k > q - *window);
  m = m.unsqueeze(0).unsqueeze(0);  // [1, 1, S, kv]
  if (padding.defined()) {
    m = m & padding.to(device).to(at::kBool).view({padding.size(0), 1, 1, kv});
    // A query that may see nothing (left padding) would give NaN: let it see every key; its
    // output belongs to a padding position and is never used.
    m = m | at::logical_not(m.any(-1, /*keepdim=*/true));
  }
  return m;
}

// Whether the layer runs forward_deferred (its residual adds fused into the next norms): with
// the fused kernels, and not under activation checkpointing (whose recompute takes one tensor).
bool deferred_residual(const DecoderLayer& layer, const at::Tensor& x, const KVCache* cache) {
  return use_fused_kernels(x) && !layer.recomputes(cache);
}

}  // namespace

at::Tensor CausalLM::forward(const at::Tensor& input, const ForwardOptions& opts) {
  COLOSSAL_CHECK_INPUT(num_chunks() == 1, "CausalLM::forward runs a model of one chunk; this one ",
                       "holds ", num_chunks(), " (forward_chunk)");
  return forward_chunk(0, input, opts);
}

at::Tensor CausalLM::forward_chunk(int64_t c, const at::Tensor& input, const ForwardOptions& opts) {
  const auto [begin, end] = chunk_blocks(c);
  return forward_blocks(begin, end, input, opts);
}

at::Tensor CausalLM::forward_loss(const at::Tensor& input, const at::Tensor& targets,
                                  int64_t chunk_tokens, const ForwardOptions& opts) {
  COLOSSAL_CHECK_INPUT(num_chunks() == 1, "CausalLM::forward_loss runs a model of one chunk; ",
                       "this one holds ", num_chunks(), " (forward_chunk_loss)");
  return forward_chunk_loss(0, input, targets, chunk_tokens, opts);
}

at::Tensor CausalLM::forward_chunk_loss(int64_t c, const at::Tensor& input,
                                        const at::Tensor& targets, int64_t chunk_tokens,
                                        const ForwardOptions& opts) {
  const auto [begin, end] = chunk_blocks(c);
  COLOSSAL_CHECK(end == num_blocks(), "CausalLM::forward_loss needs the chunk holding lm_head; ",
                 "chunk ", c, " holds blocks [", begin, ", ", end, ")");
  at::Tensor h = forward_blocks(begin, end - 1, input, opts);
  nn::FusedCEOptions fo;
  fo.chunk_tokens = chunk_tokens;
  fo.divisor = opts.loss_divisor;
  // A head sharded over the vocabulary (lm_head, or the embedding it is tied to) takes the
  // vocab-parallel loss, which owns its collectives and never gathers the logits.
  if (lm_head && lm_head->vocab_parallel_head())
    return lm_head->vocab_parallel_loss(h, targets, fo);
  if (!lm_head && model->embed_tokens && model->embed_tokens->vocab_parallel_head())
    return model->embed_tokens->vocab_parallel_loss(h, targets, fo);
  if (lm_head && !lm_head->fusable()) {
    // A head of another kind (adapted, FP8) computes its own logits.
    at::Tensor logits = lm_head->forward(h);
    COLOSSAL_CHECK(logits.size(-1) == config_.vocab_size, "lm_head ", lm_head->name(), " returned ",
                   logits.size(-1), " logits per token for a vocabulary of ", config_.vocab_size,
                   " (a vocab-sharded head of this kind cannot take the loss)");
    if (opts.loss_divisor > 0)
      return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                    targets.to(logits.device()).reshape({-1}), std::nullopt,
                                    at::Reduction::Sum, -100) /
             opts.loss_divisor;
    return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                  targets.to(logits.device()).reshape({-1}), std::nullopt,
                                  at::Reduction::Mean, -100);
  }
  std::optional<ForwardScope> head_scope;
  if (lm_head) head_scope.emplace(*lm_head);  // lm_head's hooks fire as in forward()
  check_tied_head();
  return nn::fused_linear_cross_entropy(h, head_weight(), targets.to(h.device()), fo);
}

at::Tensor CausalLM::forward_blocks(int64_t begin, int64_t stop, const at::Tensor& input,
                                    const ForwardOptions& opts) {
  ForwardScope scope(*this);
  const int64_t L = config_.num_hidden_layers;
  COLOSSAL_CHECK(input.dim() == (begin == 0 ? 2 : 3), "CausalLM::forward: expected ",
                 begin == 0 ? "token ids [batch, seq]" : "hidden states [batch, seq, hidden]",
                 ", got ", input.dim(), " dims");
  COLOSSAL_CHECK_INPUT(opts.input_tokens == 0 || (begin > 0 && opts.input_tokens >= input.size(1)),
                       "CausalLM::forward: input_tokens=", opts.input_tokens,
                       " applies to hidden-state inputs of at least that many rows only (got ",
                       input.sizes(), ")");
  const int64_t s = opts.input_tokens > 0 ? opts.input_tokens : input.size(1);
  SequenceInfo seq;
  seq.offset = opts.seq_offset;
  seq.local_len = s;
  seq.global_len = opts.global_seq_len > 0 ? opts.global_seq_len : s;
  COLOSSAL_CHECK_INPUT(seq.offset >= 0 && seq.offset + s <= seq.global_len,
                       "CausalLM::forward: a sequence shard of ", s, " tokens at offset ",
                       seq.offset, " does not fit a step of ", seq.global_len, " tokens");
  COLOSSAL_CHECK_INPUT(!seq.sharded() || (!opts.cache && !opts.position_ids.defined() &&
                                          !opts.attention_mask.defined()),
                       "CausalLM::forward: a sequence shard takes no KV cache, position_ids or "
                       "attention_mask");
  if (opts.positions.defined()) {
    COLOSSAL_CHECK_INPUT(opts.positions.dim() == 1 && opts.positions.size(0) == s &&
                             opts.positions.scalar_type() == at::kLong,
                         "CausalLM::forward: positions must be int64 [", s, "], got ",
                         opts.positions.scalar_type(), " ", opts.positions.sizes());
    COLOSSAL_CHECK_INPUT(
        !opts.cache && !opts.position_ids.defined() && !opts.attention_mask.defined(),
        "CausalLM::forward: positions take no KV cache, position_ids or "
        "attention_mask");
  }
  if (opts.document_ids.defined()) {
    COLOSSAL_CHECK_INPUT(
        opts.document_ids.dim() == 2 && opts.document_ids.size(0) == input.size(0) &&
            opts.document_ids.size(1) == s && opts.document_ids.scalar_type() == at::kLong,
        "CausalLM::forward: document_ids must be int64 [", input.size(0), ", ", s, "], got ",
        opts.document_ids.scalar_type(), " ", opts.document_ids.sizes());
    COLOSSAL_CHECK_INPUT(!opts.cache && !opts.attention_mask.defined() && !seq.sharded() &&
                             !opts.positions.defined(),
                         "CausalLM::forward: document_ids take no KV cache, attention_mask, "
                         "positions or sequence shard");
  }
  if (opts.cache) {
    const int64_t first_layer = std::max<int64_t>(begin - 1, 0);
    if (first_layer < L) seq.past = opts.cache->length(first_layer);
  }
  const int64_t past = seq.past, kv = past + seq.global_len;
  if (opts.attention_mask.defined()) {
    COLOSSAL_CHECK_INPUT(opts.attention_mask.dim() == 2 && opts.attention_mask.size(1) == kv &&
                             opts.attention_mask.size(0) == input.size(0),
                         "attention_mask must be [batch, past + seq] = [", input.size(0), ", ", kv,
                         "], got ", opts.attention_mask.sizes());
  }
  at::Tensor x = input;
  at::Tensor delta;  // the residual add left pending by forward_deferred: the state is x + delta
  LayerContext full, sliding;
  bool context_ready = false;
  // A chunk starting mid-model builds the same context from opts as the whole model does.
  for (int64_t i = begin; i < stop; ++i) {
    if (i == 0) {
      x = model->embed_tokens->forward(x);
    } else if (i <= L) {
      if (!context_ready) {
        // Tables and masks of the whole step (every sequence shard's positions).
        std::tie(full.cos, full.sin) =
            opts.positions.defined()
                ? model->rotary_emb->forward(opts.positions.to(x.device()).unsqueeze(0),
                                             x.scalar_type())
            : opts.position_ids.defined()
                ? model->rotary_emb->forward(opts.position_ids.to(x.device()), x.scalar_type())
                : model->rotary_emb->forward_range(past, kv, x.device(), x.scalar_type());
        full.cache = opts.cache;
        full.seq = seq;
        const int64_t q_len = seq.global_len;
        const bool explicit_full = opts.attention_mask.defined() || (past > 0 && q_len > 1);
        if (explicit_full)
          full.mask.mask = build_mask(past, q_len, std::nullopt, opts.attention_mask, x.device());
        if (opts.document_ids.defined())
          full.mask.documents = nn::make_documents(opts.document_ids.cpu(), x.device());
        sliding = full;  // the window covers every key unless longer than it
        if (config_.sliding_window && kv > *config_.sliding_window) {
          sliding.mask.mask =
              build_mask(past, q_len, config_.sliding_window, opts.attention_mask, x.device());
        }
        context_ready = true;
      }
      auto& layer = model->layers->layers[i - 1];
      const LayerContext& ctx = layer->sliding() ? sliding : full;
      if (deferred_residual(*layer, x, opts.cache)) {
        std::tie(x, delta) = layer->forward_deferred(x, delta, ctx);
      } else {
        if (delta.defined()) x = x + std::exchange(delta, at::Tensor());
        x = layer->forward(x, ctx);
      }
    } else if (i == L + 1) {
      x = delta.defined() ? model->norm->forward_add(x, std::exchange(delta, at::Tensor())).second
                          : model->norm->forward(x);
    } else {
      if (lm_head) {
        x = lm_head->forward(x);
      } else {
        // The tied head: the embedding's own projection (vocab-sharded logits when it is
        // sharded over a group, the whole vocabulary when its spec gathers them).
        if (!model->embed_tokens->vocab_parallel_head()) check_tied_head();
        x = model->embed_tokens->project(x);
      }
    }
  }
  return delta.defined() ? x + delta : x;  // a chunk ending after a layer returns the sum
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  COLOSSAL_CHECK(logits.dim() == 3 && labels.dim() == 2 && logits.size(0) == labels.size(0) &&
                     logits.size(1) == labels.size(1),
                 "causal_lm_loss: logits [B, S, V] and labels [B, S] expected, got ",
                 logits.sizes(), " and ", labels.sizes());
  const int64_t v = logits.size(2);
  at::Tensor shifted =
      at::constant_pad_nd(labels, {0, 1}, -100).narrow(1, 1, labels.size(1)).contiguous();
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, v}),
                                shifted.view({-1}).to(logits.device()), std::nullopt,
                                at::Reduction::Mean, -100);
}

void GenerateOptions::validate() const {
  COLOSSAL_CHECK_INPUT(max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ",
                       max_new_tokens);
  COLOSSAL_CHECK_INPUT(std::isfinite(repetition_penalty) && repetition_penalty > 0,
                       "generate: repetition_penalty must be a finite number > 0, got ",
                       repetition_penalty);
  COLOSSAL_CHECK_INPUT(std::isfinite(temperature) && temperature > 0,
                       "generate: temperature must be a finite number > 0, got ", temperature,
                       " (for greedy decoding leave sampling off)");
  COLOSSAL_CHECK_INPUT(top_k >= 0, "generate: top_k must be >= 0 (0: off), got ", top_k);
  COLOSSAL_CHECK_INPUT(std::isfinite(top_p) && top_p > 0 && top_p <= 1,
                       "generate: top_p must be in (0, 1] (1: off), got ", top_p);
}

at::Tensor process_logits(const at::Tensor& scores_in, const at::Tensor& seen,
                          const GenerateOptions& o) {
  at::Tensor scores = scores_in;
  if (o.repetition_penalty != 1.0) {
    // Every id seen so far (duplicates gather and scatter the same value).
    at::Tensor s = scores.gather(1, seen);
    s = at::where(s < 0, s * o.repetition_penalty, s / o.repetition_penalty);
    scores = scores.scatter(1, seen, s);
  }
  if (!o.do_sample) return scores;
  const double inf = std::numeric_limits<double>::infinity();
  if (o.temperature != 1.0) scores = scores / o.temperature;
  if (o.top_k > 0) {
    // Everything below the k-th largest score goes; ties with it stay (HF's rule).
    const int64_t k = std::min<int64_t>(o.top_k, scores.size(-1));
    at::Tensor kth = std::get<0>(scores.topk(k, -1)).narrow(-1, k - 1, 1);
    scores = scores.masked_fill(scores < kth, -inf);
  }
  if (o.top_p < 1.0) {
    // The smallest scores whose probabilities sum to at most 1 - top_p go; the largest stays.
    auto [sorted, order] = scores.sort(-1, /*descending=*/false);
    at::Tensor drop = sorted.softmax(-1).cumsum(-1) <= (1.0 - o.top_p);
    drop.narrow(-1, drop.size(-1) - 1, 1).fill_(false);
    scores = scores.masked_fill(drop.scatter(1, order, drop), -inf);
  }
  return scores;
}

at::Tensor generate(CausalLM& m, const at::Tensor& prompt, const GenerateOptions& o) {
  COLOSSAL_CHECK_INPUT(prompt.dim() == 2 && prompt.size(1) > 0,
                       "generate: prompt ids must be [batch, len>0], got ", prompt.sizes());
  o.validate();
  COLOSSAL_CHECK(m.whole(), "generate needs the whole model");
  at::NoGradGuard ng;
  // cuDNN's attention plans per shape and the key length grows every step: on an H200 it made
  // bf16 decoding of a 1B model 5x slower (14 vs 75 tokens/s). Flash/efficient kernels do not.
  struct CudnnSdpaOff {
    bool prev = at::globalContext().userEnabledCuDNNSDP();
    CudnnSdpaOff() { at::globalContext().setSDPUseCuDNN(false); }
    ~CudnnSdpaOff() { at::globalContext().setSDPUseCuDNN(prev); }
  } cudnn_off;
  const int64_t max_new = o.max_new_tokens;
  KVCache cache(m.config().num_hidden_layers, prompt.size(1) + max_new);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<at::Tensor> out;
  at::Tensor done =
      at::zeros({prompt.size(0)}, at::TensorOptions().dtype(at::kBool).device(prompt.device()));
  at::Tensor seen = prompt;  // what the repetition penalty looks at
  at::Tensor input = prompt;
  for (int64_t t = 0; t < max_new; ++t) {
    ForwardOptions fo;
    fo.cache = &cache;
    at::Tensor logits = m.forward(input, fo);
    COLOSSAL_CHECK_INPUT(logits.size(-1) == m.config().vocab_size, "generate: the head returns ",
                         logits.size(-1), " logits per token of a vocabulary of ",
                         m.config().vocab_size,
                         " (vocab-sharded); shard it with parallel_output=false to decode");
    at::Tensor scores =
        process_logits(logits.select(1, logits.size(1) - 1).to(at::kFloat), seen, o);
    at::Tensor next;
    if (o.do_sample) {
      at::Tensor probs = scores.softmax(-1).to(at::kCPU);
      next = at::multinomial(probs, 1, /*replacement=*/false, gen).squeeze(1).to(prompt.device());
    } else {
      next = scores.argmax(-1);
    }
    out.push_back(next);
    if (o.on_token) o.on_token(next);
    if (o.repetition_penalty != 1.0) seen = at::cat({seen, next.unsqueeze(1)}, 1);
    if (o.eos_token_id) {
      done = done | (next == *o.eos_token_id);
      if (done.all().item<bool>()) break;
    }
    input = next.unsqueeze(1);
  }
  if (out.empty()) return at::empty({prompt.size(0), 0}, prompt.options());
  return at::stack(out, 1);
}

at::Tensor generate_greedy(CausalLM& m, const at::Tensor& prompt, int64_t max_new,
                           std::optional<int64_t> eos) {
  GenerateOptions o;
  o.max_new_tokens = max_new;
  o.eos_token_id = eos;
  return generate(m, prompt, o);
}

}  // namespace colossal::models
