// Llama-family causal LM: block layout, masks, forward over the owned blocks, loss, greedy
// decoding with a KV cache.
#include "colossal/nn/causal_lm.h"

#include <ATen/ATen.h>

#include <utility>

#include "colossal/core/error.h"
#include "colossal/nn/fused_ce.h"

namespace colossal::nn {

DecoderModel::DecoderModel(const ModelConfig& cfg, const at::TensorOptions& opts) {
  embed_tokens = register_module(
      "embed_tokens",
      std::make_shared<Embedding>(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id, opts));
  layers = register_module("layers", std::make_shared<LayerList>());
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    layers->layers.push_back(
        layers->register_module(std::to_string(i), std::make_shared<DecoderLayer>(cfg, i, opts)));
  }
  norm =
      register_module("norm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps, opts));
  rotary_emb = register_module("rotary_emb", std::make_shared<RotaryEmbedding>(cfg));
}

CausalLM::CausalLM(const ModelConfig& cfg, const at::TensorOptions& opts)
    : config_(cfg), end_(cfg.num_hidden_layers + 3) {
  config_.validate();
  model = register_module("model", std::make_shared<DecoderModel>(config_, opts));
  if (!config_.tie_word_embeddings) {
    lm_head = register_module(
        "lm_head", std::make_shared<Linear>(cfg.hidden_size, cfg.vocab_size, false, opts));
  }
}

const at::Tensor& CausalLM::head_weight() const {
  if (lm_head) return lm_head->weight();
  COLOSSAL_CHECK(model->embed_tokens,
                 "tied lm_head needs model.embed_tokens, which this stage dropped");
  return model->embed_tokens->weight();
}

void CausalLM::set_activation_checkpointing(CheckpointMode mode, int64_t num_layers) {
  int64_t owned = 0;
  for (auto& layer : model->layers->layers)
    if (layer) ++owned;
  COLOSSAL_CHECK_INPUT(num_layers <= owned, "activation checkpointing of ", num_layers,
                       " layers: this model owns only ", owned, " decoder layers");
  int64_t given = 0;
  for (auto& layer : model->layers->layers)
    if (layer) layer->checkpointing = (num_layers < 0 || given++ < num_layers) ? mode : CheckpointMode::None;
  checkpointing_ = num_layers == 0 ? CheckpointMode::None : mode;
}

std::vector<Block> CausalLM::blocks() const {
  std::vector<Block> out;
  const int64_t L = config_.num_hidden_layers;
  for (int64_t i = first_; i < end_; ++i) {
    if (i == 0) {
      out.push_back({"model.embed_tokens", model->embed_tokens});
    } else if (i <= L) {
      out.push_back({"model.layers." + std::to_string(i - 1), model->layers->layers[i - 1]});
    } else if (i == L + 1) {
      out.push_back({"model.norm", model->norm});
    } else {
      out.push_back({"lm_head", lm_head});
    }
  }
  return out;
}

void CausalLM::keep_blocks(int64_t begin, int64_t end) {
  const int64_t n = num_blocks(), L = config_.num_hidden_layers;
  COLOSSAL_CHECK(0 <= begin && begin < end && end <= n, "keep_blocks(", begin, ", ", end,
                 "): need 0 <= begin < end <= ", n);
  COLOSSAL_CHECK(begin >= first_ && end <= end_, "keep_blocks(", begin, ", ", end,
                 "): blocks outside [", first_, ", ", end_, ") were already dropped");
  COLOSSAL_CHECK(!(config_.tie_word_embeddings && end == n && begin > 0),
                 "a pipeline stage holding the tied lm_head must also hold model.embed_tokens "
                 "(tie_word_embeddings)");
  auto keep = [&](int64_t i) { return begin <= i && i < end; };
  if (!keep(0) && model->embed_tokens) {
    model->unregister_module("embed_tokens");
    model->embed_tokens = nullptr;
  }
  for (int64_t i = 0; i < L; ++i) {
    if (!keep(i + 1) && model->layers->layers[i]) {
      model->layers->unregister_module(std::to_string(i));
      model->layers->layers[i] = nullptr;
    }
  }
  if (!keep(L + 1) && model->norm) {
    model->unregister_module("norm");
    model->norm = nullptr;
  }
  if (!keep(L + 2) && lm_head) {
    unregister_module("lm_head");
    lm_head = nullptr;
  }
  first_ = begin;
  end_ = end;
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
  return forward_blocks(input, opts, end_);
}

at::Tensor CausalLM::forward_loss(const at::Tensor& input, const at::Tensor& targets,
                                  int64_t chunk_tokens, const ForwardOptions& opts) {
  COLOSSAL_CHECK(end_ == num_blocks(), "CausalLM::forward_loss needs the stage holding lm_head");
  at::Tensor h = forward_blocks(input, opts, end_ - 1);
  std::optional<ForwardScope> head_scope;
  if (lm_head) head_scope.emplace(*lm_head);  // lm_head's hooks fire as in forward()
  FusedCEOptions fo;
  fo.chunk_tokens = chunk_tokens;
  return fused_linear_cross_entropy(h, head_weight(), targets.to(h.device()), fo);
}

at::Tensor CausalLM::forward_blocks(const at::Tensor& input, const ForwardOptions& opts,
                                    int64_t stop) {
  ForwardScope scope(*this);
  const int64_t L = config_.num_hidden_layers;
  COLOSSAL_CHECK(input.dim() == (first_ == 0 ? 2 : 3), "CausalLM::forward: expected ",
                 first_ == 0 ? "token ids [batch, seq]" : "hidden states [batch, seq, hidden]",
                 ", got ", input.dim(), " dims");
  const int64_t s = input.size(1);
  int64_t past = 0;
  if (opts.cache) {
    const int64_t first_layer = std::max<int64_t>(first_ - 1, 0);
    if (first_layer < L) past = opts.cache->length(first_layer);
  }
  const int64_t kv = past + s;
  if (opts.attention_mask.defined()) {
    COLOSSAL_CHECK_INPUT(opts.attention_mask.dim() == 2 && opts.attention_mask.size(1) == kv &&
                             opts.attention_mask.size(0) == input.size(0),
                         "attention_mask must be [batch, past + seq] = [", input.size(0), ", ", kv,
                         "], got ", opts.attention_mask.sizes());
  }
  at::Tensor x = input;
  at::Tensor delta;  // the residual add left pending by forward_deferred: the state is x + delta
  at::Tensor cos, sin;
  AttentionMask full, sliding;
  bool masks_ready = false;
  for (int64_t i = first_; i < stop; ++i) {
    if (i == 0) {
      x = model->embed_tokens->forward(x);
    } else if (i <= L) {
      if (!masks_ready) {
        std::tie(cos, sin) =
            opts.position_ids.defined()
                ? model->rotary_emb->forward(opts.position_ids.to(x.device()), x.scalar_type())
                : model->rotary_emb->forward_range(past, kv, x.device(), x.scalar_type());
        const bool explicit_full = opts.attention_mask.defined() || (past > 0 && s > 1);
        if (explicit_full)
          full.mask = build_mask(past, s, std::nullopt, opts.attention_mask, x.device());
        if (config_.sliding_window) {
          if (kv > *config_.sliding_window) {
            sliding.mask =
                build_mask(past, s, config_.sliding_window, opts.attention_mask, x.device());
          } else {
            sliding = full;  // the window covers every key: same as full attention
          }
        }
        masks_ready = true;
      }
      auto& layer = model->layers->layers[i - 1];
      const AttentionMask& m = layer->sliding() ? sliding : full;
      if (deferred_residual(*layer, x, opts.cache)) {
        std::tie(x, delta) = layer->forward_deferred(x, delta, cos, sin, m, opts.cache);
      } else {
        if (delta.defined()) x = x + std::exchange(delta, at::Tensor());
        x = layer->forward(x, cos, sin, m, opts.cache);
      }
    } else if (i == L + 1) {
      x = delta.defined() ? model->norm->forward_add(x, std::exchange(delta, at::Tensor())).second
                          : model->norm->forward(x);
    } else {
      x = lm_head ? lm_head->forward(x) : at::linear(x, head_weight());
    }
  }
  return delta.defined() ? x + delta : x;  // a stage ending after a layer returns the sum
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

at::Tensor generate_greedy(CausalLM& m, const at::Tensor& prompt, int64_t max_new,
                           std::optional<int64_t> eos) {
  COLOSSAL_CHECK_INPUT(prompt.dim() == 2 && prompt.size(1) > 0,
                       "generate: prompt ids must be [batch, len>0], got ", prompt.sizes());
  COLOSSAL_CHECK_INPUT(max_new >= 0, "generate: max_new_tokens must be >= 0, got ", max_new);
  COLOSSAL_CHECK(m.first_block() == 0 && m.end_block() == m.num_blocks(),
                 "generate needs the whole model");
  at::NoGradGuard ng;
  // cuDNN's attention plans per shape and the key length grows every step: on an H200 it made
  // bf16 decoding of a 1B model 5x slower (14 vs 75 tokens/s). Flash/efficient kernels do not.
  struct CudnnSdpaOff {
    bool prev = at::globalContext().userEnabledCuDNNSDP();
    CudnnSdpaOff() { at::globalContext().setSDPUseCuDNN(false); }
    ~CudnnSdpaOff() { at::globalContext().setSDPUseCuDNN(prev); }
  } cudnn_off;
  KVCache cache(m.config().num_hidden_layers, prompt.size(1) + max_new);
  std::vector<at::Tensor> out;
  at::Tensor done =
      at::zeros({prompt.size(0)}, at::TensorOptions().dtype(at::kBool).device(prompt.device()));
  at::Tensor input = prompt;
  for (int64_t t = 0; t < max_new; ++t) {
    ForwardOptions fo;
    fo.cache = &cache;
    at::Tensor logits = m.forward(input, fo);
    at::Tensor next = logits.select(1, logits.size(1) - 1).to(at::kFloat).argmax(-1);
    out.push_back(next);
    if (eos) {
      done = done | (next == *eos);
      if (done.all().item<bool>()) break;
    }
    input = next.unsqueeze(1);
  }
  if (out.empty()) return at::empty({prompt.size(0), 0}, prompt.options());
  return at::stack(out, 1);
}

}  // namespace colossal::nn
