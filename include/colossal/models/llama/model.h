// The causal language model of the Llama family (llama, mistral, qwen2), laid out and named as
// transformers' *ForCausalLM: model.embed_tokens, model.layers.N.{self_attn,mlp,...},
// model.norm, lm_head. Built from the generic layers of nn/ and free of communication: every
// sub-layer sits in a replaceable slot (Module::replace_child / nn::replace_module), so a
// parallel plan (plan.h), LoRA or FP8 swaps a layer without editing this file, and the fused
// q/k/v and gate/up GEMMs run only while the projections are plain (nn::fused_projections).
// It exposes its ordered blocks so a pipeline stage can keep only its chunks (one or more block
// ranges), names unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "colossal/models/llama/config.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/checkpointing.h"
#include "colossal/nn/embedding.h"
#include "colossal/nn/feed_forward.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/module.h"
#include "colossal/nn/norm.h"
#include "colossal/nn/rotary.h"

namespace colossal::models {

using nn::AttentionMask;
using nn::CheckpointMode;
using nn::KVCache;
using nn::SequenceInfo;

// What a decoder layer needs besides its input: the rotary tables and the mask of the whole
// step (over all sequence shards), the KV cache, and where this rank's tokens sit.
struct LayerContext {
  at::Tensor cos, sin;  // [B|1, global_len, head_dim]
  AttentionMask mask;
  KVCache* cache = nullptr;
  SequenceInfo seq;
};

class Attention : public nn::Module {
 public:
  Attention(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x, const LayerContext& ctx);
  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<nn::CoreAttention> core_attn;  // SDPA by default; no parameters
  int64_t layer_idx() const { return layer_idx_; }

 private:
  int64_t head_dim_, layer_idx_;
};

// The dense feed-forward: down(silu(gate(x)) * up(x)).
class MLP : public nn::FeedForward {
 public:
  MLP(const ModelConfig& cfg, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x) override;
  std::shared_ptr<nn::Linear> gate_proj, up_proj, down_proj;
};

class DecoderLayer : public nn::Module {
 public:
  DecoderLayer(const ModelConfig& cfg, int64_t layer_idx, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x, const LayerContext& ctx);
  // The same layer with its input and output residual adds left to the neighbouring norms:
  // the input is x + delta (delta undefined: x alone), the output {h, m} means h + m, the
  // next layer's (or the final norm's) forward_add. Not for checkpointed layers (their
  // recompute takes one tensor): the model calls forward() for those.
  std::pair<at::Tensor, at::Tensor> forward_deferred(const at::Tensor& x, const at::Tensor& delta,
                                                     const LayerContext& ctx);
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<nn::FeedForward> mlp;
  std::shared_ptr<nn::RMSNorm> input_layernorm, post_attention_layernorm;
  // The FFN as the dense MLP; Error when it was replaced by another kind.
  MLP& dense_mlp() const;
  bool sliding() const { return sliding_; }
  // Recompute in backward (checkpointing.h); applies only when grad is on and no KV cache is used.
  CheckpointMode checkpointing = CheckpointMode::None;
  // Whether a forward with this cache (and the current grad mode) recomputes in backward.
  bool recomputes(const KVCache* cache) const;

 private:
  bool sliding_;
};

// Holds the decoder layers as children "0".."N-1" (HF's ModuleList names); each is replaceable,
// and a pipeline stage drops the ones it does not own.
class LayerList : public nn::Module {
 public:
  void add(std::shared_ptr<DecoderLayer> layer);
  void drop(int64_t index);
  std::vector<std::shared_ptr<DecoderLayer>> layers;  // null where not owned by this stage
};

class DecoderModel : public nn::Module {
 public:
  DecoderModel(const ModelConfig& cfg, const at::TensorOptions& opts);
  std::shared_ptr<nn::Embedding> embed_tokens;  // null when dropped by keep_chunks
  std::shared_ptr<LayerList> layers;
  std::shared_ptr<nn::RMSNorm> norm;  // null when dropped
  std::shared_ptr<nn::RotaryEmbedding> rotary_emb;
};

struct ForwardOptions {
  KVCache* cache = nullptr;   // attend to and append to this cache
  at::Tensor attention_mask;  // optional [B, past + S]: 1 = token, 0 = padding
  at::Tensor position_ids;    // optional [B, S]; default past .. past + S - 1
  // A sequence shard: the input holds tokens [seq_offset, seq_offset + S) of a step of
  // global_seq_len new tokens (0: S, the whole step is local). Rotary tables and masks are built
  // for the whole step; each layer takes the part its tokens need.
  int64_t seq_offset = 0;
  int64_t global_seq_len = 0;
  // Optional int64 [S]: the global position of each input token (nn::shard_sequence's
  // `positions`, e.g. a zigzag shard of ring attention); the rotary tables are built for these
  // positions only. Undefined: the tokens are contiguous from seq_offset. Takes no KV cache,
  // position_ids or attention_mask.
  at::Tensor positions;
  // The tokens the input stands for, when a pipeline stage's hidden-state input holds fewer rows:
  // under split_gather / ring the activations between stages are sequence shards of the tp group
  // (the layers gather them), so a later stage's [B, S/tp, hidden] input is S tokens. 0: the
  // input's own length.
  int64_t input_tokens = 0;
  // Optional int64 [B, S] on the CPU: packed documents (--doc_mask). Equal ids mark one document
  // of a row (contiguous); each token attends only to the tokens before it in its document
  // (nn::DocumentMask). Pair it with position_ids restarting at each document. Takes no KV
  // cache, attention_mask or sequence shard.
  at::Tensor document_ids;
  // forward_loss: > 0 divides the summed loss of the counted targets by this instead of taking
  // their mean (the trainer's global normalization of masked targets; fused_ce.h).
  double loss_divisor = 0;
};

// One pipeline unit: its HF name prefix and module.
struct Block {
  std::string name;  // "model.embed_tokens", "model.layers.3", "model.norm", "lm_head"
  std::shared_ptr<torch::nn::Module> module;
};

class CausalLM : public nn::Module {
 public:
  // opts.device(at::kMeta) builds the shapes only (no memory); see init.h to materialize.
  explicit CausalLM(const ModelConfig& cfg, const at::TensorOptions& opts = {});

  // A whole model: ids [B, S] -> logits [B, S, vocab]; with a vocab-sharded head (lm_head
  // column-sharded, or the tied embedding vocab-sharded, over a group) this rank's columns of
  // the padded vocabulary [B, S, P/tp] unless its spec gathers output (parallel_output=false).
  // A pipeline stage of one chunk: forward_chunk(0, ...). InputError with several chunks.
  at::Tensor forward(const at::Tensor& input, const ForwardOptions& opts = {});

  // Blocks in order: embed_tokens, layers.0..N-1, norm, lm_head (lm_head's module is null when
  // the head is tied to the embedding). Only the owned blocks are listed, in block order (a
  // tied copy of the embedding is not a block: see holds_tied_copy).
  std::vector<Block> blocks() const;
  int64_t num_blocks() const { return config_.num_hidden_layers + 3; }
  // "model.embed_tokens", "model.layers.<i-1>", "model.norm" or "lm_head" for block i of a
  // whole model. InputError outside [0, num_blocks()).
  std::string block_name(int64_t i) const;

  // Pipeline chunks: several non-contiguous block ranges on one rank (interleaved and ZB-V
  // schedules). Keeps ranges[c] = [begin, end) (indices of a whole model's blocks()) as local
  // chunk c and drops every other block; parameter names do not change. Each range must be
  // non-empty and still owned, and no two may overlap (InputError naming them). Tied
  // embeddings: when the kept blocks include lm_head (L + 2) but not the embedding (0), the
  // module model.embed_tokens stays as the head's weight holder (holds_tied_copy()).
  void keep_chunks(const std::vector<std::pair<int64_t, int64_t>>& ranges);
  // keep_chunks({{begin, end}}): one chunk.
  void keep_blocks(int64_t begin, int64_t end);
  int64_t num_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  // Chunk c's block range [begin, end). InputError when c is not a chunk.
  std::pair<int64_t, int64_t> chunk_blocks(int64_t c) const;
  bool owns_block(int64_t i) const;
  // With one chunk its range; with several the smallest owned block and one past the largest
  // (blocks in between may belong to other ranks: test owns_block or whole()).
  int64_t first_block() const;
  int64_t end_block() const;
  // Whether every block is owned (a whole model, one chunk).
  bool whole() const;
  // The names (block_name) of the blocks this model dropped, for nn::PlanOptions::absent_modules
  // (a plan written for the whole model applies to a stage, the rules of other stages' blocks
  // matching nothing here). A held tied copy of the embedding is present, not dropped.
  std::vector<std::string> dropped_blocks() const;
  // Tied embeddings across stages (tie_word_embeddings): a rank holding lm_head without the
  // embedding keeps model.embed_tokens (same name and parameter, model.embed_tokens.weight) as
  // the head's weight: head_weight(), the tied projection and the vocab-parallel tied loss read
  // it; it is not an owned block and forward never looks tokens up with it. The contract with
  // the pipeline plugin: this parameter exists on both the first and the last stage, both
  // copies start equal (init and loading are keyed by name), and the plugin sums its gradient
  // over the two stages before the step (so both copies take the same update) and counts it
  // once in the gradient norm; a checkpoint writer saves it once. A vocab-sharded tied
  // embedding is sharded on both stages alike.
  bool holds_tied_copy() const { return tied_copy_; }

  // Chunk c: its first block's input (token ids [B, S] when it starts at the embedding, else
  // hidden states [B, S, hidden]) -> its last block's output (hidden states, or logits when it
  // ends with lm_head, as forward). Rotary tables, masks and sequence shards (opts) are built
  // for every chunk exactly as in the whole model, and the deferred residual (fused kernels)
  // is resolved at the chunk's end: a chunk ending after a decoder layer returns x + delta.
  at::Tensor forward_chunk(int64_t c, const at::Tensor& input, const ForwardOptions& opts = {});
  // forward_loss of chunk c, which must end with lm_head (the same loss paths).
  at::Tensor forward_chunk_loss(int64_t c, const at::Tensor& input, const at::Tensor& targets,
                                int64_t chunk_tokens = 4096, const ForwardOptions& opts = {});

  // Recompute decoder layers in backward (checkpointing.h): the first `num_layers` owned decoder
  // layers (in block order, over all chunks) get `mode` (all of them when num_layers < 0), the
  // others none: per-layer selective recompute trades memory for the fewest recomputed layers
  // (ColossalAI's num_ckpt_layers_per_stage). InputError when num_layers exceeds the owned layers.
  void set_activation_checkpointing(CheckpointMode mode, int64_t num_layers = -1);
  // Per chunk (ColossalAI's num_ckpt_layers_per_stage, indexed by virtual stage: pick a rank's
  // entries with pipeline::rank_virtual_stages): the first per_chunk[c] decoder layers of chunk c
  // get `mode` (all of them when < 0), the others none. InputError when the size is not
  // num_chunks() or an entry exceeds its chunk's layers.
  void set_activation_checkpointing(CheckpointMode mode, const std::vector<int64_t>& per_chunk);
  CheckpointMode activation_checkpointing() const { return checkpointing_; }

  const ModelConfig& config() const { return config_; }
  bool tied() const { return config_.tie_word_embeddings; }
  // The output projection's weight ([vocab, hidden]): lm_head's, or the embedding's when tied
  // (this rank's rows of the padded vocabulary when the head is vocab-sharded).
  const at::Tensor& head_weight() const;
  // Whether the output head is sharded over the vocabulary (lm_head column-sharded, or the tied
  // embedding vocab-sharded, over a group): forward then returns sharded logits and the loss
  // is the vocab-parallel one.
  bool vocab_parallel_head() const;
  // Mean cross-entropy of `targets` [B, S] (the next token of each position; ignore_index
  // -100). A vocab-sharded head (see forward) takes the vocab-parallel fused cross-entropy
  // (nn::vocab_parallel_linear_cross_entropy, through the layer, which owns the collectives;
  // under split_gather the loss is over the whole gathered sequence). While the head is a
  // plain linear (or tied to an unsharded embedding) it is computed
  // straight from the final hidden states by fused_linear_cross_entropy over head_weight(),
  // chunk_tokens tokens at a time, so the [B, S, vocab] logits never exist; a head of another
  // kind runs its own forward and the loss is taken from its logits. Equals
  // cross_entropy(forward(input), targets) within fp32 rounding. Needs the blocks through lm_head.
  // A model of one chunk: forward_chunk_loss(0, ...).
  at::Tensor forward_loss(const at::Tensor& input, const at::Tensor& targets,
                          int64_t chunk_tokens = 4096, const ForwardOptions& opts = {});

  std::shared_ptr<DecoderModel> model;
  std::shared_ptr<nn::Linear> lm_head;  // null when tied

 private:
  // forward over blocks [begin, stop), all owned.
  at::Tensor forward_blocks(int64_t begin, int64_t stop, const at::Tensor& input,
                            const ForwardOptions& opts);
  // A tied head that is not vocab-sharded over a group reads the embedding's weight, which must
  // then hold the whole vocabulary.
  void check_tied_head() const;
  ModelConfig config_;
  std::vector<std::pair<int64_t, int64_t>> chunks_;  // [begin, end) of each local chunk
  bool tied_copy_ = false;
  CheckpointMode checkpointing_ = CheckpointMode::None;
};

// Mean token cross-entropy of logits [B, S, V] against labels [B, S] shifted by one (HF's
// ForCausalLMLoss: fp32, ignore_index -100).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

// Decoding as Hugging Face's generate() does it with num_beams=1: each step's last logits go
// through the repetition penalty (greedy and sampling alike), then, when sampling, temperature,
// top-k and top-p, in that order and with HF's tie and boundary rules; the next token is the
// argmax, or a draw from the softmax by a CPU generator seeded with `seed` (so a seed gives the
// same tokens on any device, and the same as HF's torch.multinomial after torch.manual_seed on
// CPU for equal logits).
struct GenerateOptions {
  int64_t max_new_tokens = 32;
  std::optional<int64_t> eos_token_id;  // stop once every row produced it
  bool do_sample = false;
  double temperature = 1.0;         // > 0; sampling only
  int64_t top_k = 0;                // 0: off; sampling only
  double top_p = 1.0;               // (0, 1]; 1: off; sampling only
  double repetition_penalty = 1.0;  // > 0; 1: off (HF's RepetitionPenaltyLogitsProcessor)
  uint64_t seed = 0;
  // Called with each step's tokens [B] (on the model's device) as they are chosen.
  std::function<void(const at::Tensor&)> on_token;
  void validate() const;  // InputError naming the first bad field
};

// One step's scores [B, V] (fp32) after the options' processors; `seen` [B, T] holds the ids so
// far (prompt and generated), which the repetition penalty reads.
at::Tensor process_logits(const at::Tensor& scores, const at::Tensor& seen,
                          const GenerateOptions& options);

// Generation with a KV cache: the prompt runs once, then one position per new token. Returns
// the new tokens of each row [B, n]; n < max_new_tokens only when every row produced eos.
at::Tensor generate(CausalLM& model, const at::Tensor& prompt_ids, const GenerateOptions& options);

// generate() with the defaults: greedy decoding.
at::Tensor generate_greedy(CausalLM& model, const at::Tensor& prompt_ids, int64_t max_new_tokens,
                           std::optional<int64_t> eos_token_id = std::nullopt);

}  // namespace colossal::models
