// The causal language model of the Llama family (llama, mistral, qwen2), laid out and named as
// transformers' *ForCausalLM: model.embed_tokens, model.layers.N..., model.norm, lm_head.
// It exposes its ordered blocks so a pipeline stage can keep only its slice, names unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "colossal/nn/config.h"
#include "colossal/nn/layers.h"
#include "colossal/nn/module.h"

namespace colossal::nn {

// Holds the decoder layers as children "0".."N-1" (HF's ModuleList names); a pipeline stage
// unregisters the ones it does not own.
class LayerList : public Module {
 public:
  std::vector<std::shared_ptr<DecoderLayer>> layers;  // null where not owned by this stage
};

class DecoderModel : public Module {
 public:
  DecoderModel(const ModelConfig& cfg, const at::TensorOptions& opts);
  std::shared_ptr<Embedding> embed_tokens;  // null when dropped by keep_blocks
  std::shared_ptr<LayerList> layers;
  std::shared_ptr<RMSNorm> norm;  // null when dropped
  std::shared_ptr<RotaryEmbedding> rotary_emb;
};

struct ForwardOptions {
  KVCache* cache = nullptr;   // attend to and append to this cache
  at::Tensor attention_mask;  // optional [B, past + S]: 1 = token, 0 = padding
  at::Tensor position_ids;    // optional [B, S]; default past .. past + S - 1
};

// One pipeline unit: its HF name prefix and module.
struct Block {
  std::string name;  // "model.embed_tokens", "model.layers.3", "model.norm", "lm_head"
  std::shared_ptr<torch::nn::Module> module;
};

class CausalLM : public Module {
 public:
  // opts.device(at::kMeta) builds the shapes only (no memory); see init.h to materialize.
  explicit CausalLM(const ModelConfig& cfg, const at::TensorOptions& opts = {});

  // A whole model: ids [B, S] -> logits [B, S, vocab]. A pipeline stage: its first block's input
  // (ids for the embedding, else hidden states [B, S, hidden]) -> its last block's output.
  at::Tensor forward(const at::Tensor& input, const ForwardOptions& opts = {});

  // Blocks in order: embed_tokens, layers.0..N-1, norm, lm_head (lm_head's module is null when
  // the head is tied to the embedding). Only the blocks still owned are listed.
  std::vector<Block> blocks() const;
  int64_t num_blocks() const { return config_.num_hidden_layers + 3; }
  // Keeps blocks [begin, end) of the full list (indices as in a whole model's blocks()) and
  // drops the rest; parameter names do not change.
  void keep_blocks(int64_t begin, int64_t end);
  int64_t first_block() const { return first_; }
  int64_t end_block() const { return end_; }

  // Recompute decoder layers in backward (checkpointing.h): the first `num_layers` owned decoder
  // layers get `mode` (all of them when num_layers < 0), the others none: per-layer selective
  // recompute trades memory for the fewest recomputed layers (ColossalAI's
  // num_ckpt_layers_per_stage). InputError when num_layers exceeds the owned layers.
  void set_activation_checkpointing(CheckpointMode mode, int64_t num_layers = -1);
  CheckpointMode activation_checkpointing() const { return checkpointing_; }

  const ModelConfig& config() const { return config_; }
  bool tied() const { return config_.tie_word_embeddings; }
  // The output projection's weight ([vocab, hidden]): lm_head's, or the embedding's when tied.
  const at::Tensor& head_weight() const;
  // Mean cross-entropy of `targets` [B, S] (the next token of each position; ignore_index
  // -100) computed straight from the final hidden states by fused_linear_cross_entropy over
  // head_weight(), chunk_tokens tokens at a time: the [B, S, vocab] logits never exist. Equals
  // cross_entropy(forward(input), targets) within fp32 rounding. Needs the blocks through lm_head.
  at::Tensor forward_loss(const at::Tensor& input, const at::Tensor& targets,
                          int64_t chunk_tokens = 4096, const ForwardOptions& opts = {});

  std::shared_ptr<DecoderModel> model;
  std::shared_ptr<Linear> lm_head;  // null when tied

 private:
  // forward over the owned blocks [first_, stop).
  at::Tensor forward_blocks(const at::Tensor& input, const ForwardOptions& opts, int64_t stop);
  ModelConfig config_;
  int64_t first_ = 0, end_;
  CheckpointMode checkpointing_ = CheckpointMode::None;
};

// Mean token cross-entropy of logits [B, S, V] against labels [B, S] shifted by one (HF's
// ForCausalLMLoss: fp32, ignore_index -100).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

// Greedy decoding with a KV cache: the prompt runs once, then one position per new token.
// Returns the new tokens of each row [B, n]. Stops early only when every row produced
// eos_token_id (if given).
at::Tensor generate_greedy(CausalLM& model, const at::Tensor& prompt_ids, int64_t max_new_tokens,
                           std::optional<int64_t> eos_token_id = std::nullopt);

}  // namespace colossal::nn
