// Llama's tensor-parallel plan.
#include "colossal/models/llama/plan.h"

#include "colossal/core/error.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/sequence_parallel.h"

namespace colossal::models {

void check_tensor_parallel(const ModelConfig& cfg, int64_t tp) {
  COLOSSAL_CHECK_INPUT(tp >= 1, "tensor parallel size must be >= 1, got ", tp);
  auto divisible = [&](int64_t n, const char* what) {
    COLOSSAL_CHECK_INPUT(n % tp == 0, "tensor parallel size ", tp, " does not divide ", what, " = ",
                         n);
  };
  divisible(cfg.num_attention_heads, "num_attention_heads");
  // Fewer key/value heads than tp: each head is replicated on the tp / kv ranks whose query
  // heads read it (Linear's heads option); tp must then be a multiple of the kv heads.
  COLOSSAL_CHECK_INPUT(cfg.num_key_value_heads % tp == 0 || tp % cfg.num_key_value_heads == 0,
                       "tensor parallel size ", tp,
                       " and num_key_value_heads = ", cfg.num_key_value_heads,
                       ": one must divide the other (kv heads fewer than tp are replicated)");
  divisible(cfg.intermediate_size, "intermediate_size");
  // The vocabulary need not be divisible: the vocab-parallel layers pad it.
}

nn::ParallelPlan tensor_parallel_plan(const ModelConfig& cfg,
                                      const TensorParallelOptions& options) {
  using K = nn::ShardSpec::Kind;
  COLOSSAL_CHECK_INPUT(options.make_vocab_size_divisible_by >= 1,
                       "make_vocab_size_divisible_by must be >= 1, got ",
                       options.make_vocab_size_divisible_by);
  nn::ParallelPlan plan;
  // One weight when tied: the embedding's shard is also the head (Embedding::project), so its
  // rule carries the head's gather_output.
  nn::PlanRule embed{"model.embed_tokens", {}, K::Vocab};
  embed.pad_multiple = options.make_vocab_size_divisible_by;
  embed.gather_output = cfg.tie_word_embeddings && !options.parallel_output;
  plan.push_back(embed);
  if (!cfg.tie_word_embeddings) {
    nn::PlanRule head{"lm_head", {}, K::Column};
    head.pad_multiple = options.make_vocab_size_divisible_by;
    head.gather_output = !options.parallel_output;
    plan.push_back(head);
  }
  for (const char* p : {"q_proj", "k_proj", "v_proj"})
    plan.push_back({std::string("model.layers.*.self_attn.") + p, {}, K::Column});
  plan.push_back({"model.layers.*.self_attn.o_proj", {}, K::Row});
  for (const char* p : {"gate_proj", "up_proj"})
    plan.push_back({std::string("model.layers.*.mlp.") + p, {}, K::Column});
  plan.push_back({"model.layers.*.mlp.down_proj", {}, K::Row});
  return plan;
}

// ---- Sequence-parallel attention ------------------------------------------------------------
nn::ParallelPlan sequence_parallel_plan(const ModelConfig& cfg, dist::SequenceParallel mode,
                                        const dist::Communicator& sp, int64_t inner_ring_size) {
  using M = dist::SequenceParallel;
  const bool attn = mode == M::AllToAll || mode == M::RingAttn;
  COLOSSAL_CHECK_INPUT(mode == M::RingAttn || inner_ring_size == 0, "inner_ring_size ",
                       inner_ring_size, " applies to ring_attn only, not to sequence parallelism ",
                       dist::to_string(mode));
  if (!attn) return {};
  COLOSSAL_CHECK_INPUT(sp.valid(), "sequence parallelism ", dist::to_string(mode),
                       " needs a sequence parallel group");
  const int64_t n = sp.size();
  nn::LayerFactory make;
  if (mode == M::AllToAll) {
    COLOSSAL_CHECK_INPUT(
        cfg.num_attention_heads % n == 0,
        "sequence parallelism all_to_all: num_attention_heads = ", cfg.num_attention_heads,
        " is not divisible by the sequence parallel size sp = ", n);
    // A slot that --attn_backend own gave our kernels (nn::use_own_attention) keeps them as the
    // inner attention over the whole sequence; otherwise SDPA.
    make = [sp](const std::string&, const std::shared_ptr<torch::nn::Module>& current) {
      return std::make_shared<nn::AllToAllAttention>(
          sp, std::dynamic_pointer_cast<nn::OwnAttention>(current));
    };
  } else {
    nn::check_inner_ring_size(inner_ring_size, n);
    // A slot that held our kernels passes on their deterministic setting (--deterministic).
    make = [sp, inner_ring_size](const std::string&,
                                 const std::shared_ptr<torch::nn::Module>& current) {
      auto ring = std::make_shared<nn::RingAttention>(sp, inner_ring_size);
      if (auto own = std::dynamic_pointer_cast<nn::OwnAttention>(current))
        ring->set_deterministic(own->deterministic());
      return ring;
    };
  }
  return {{"model.layers.*.self_attn.core_attn", make, std::nullopt}};
}

}  // namespace colossal::models
