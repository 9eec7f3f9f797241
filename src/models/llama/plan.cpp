// Llama's tensor-parallel plan.
#include "colossal/models/llama/plan.h"

#include "colossal/core/error.h"

namespace colossal::models {

void check_tensor_parallel(const ModelConfig& cfg, int64_t tp) {
  COLOSSAL_CHECK_INPUT(tp >= 1, "tensor parallel size must be >= 1, got ", tp);
  auto divisible = [&](int64_t n, const char* what) {
    COLOSSAL_CHECK_INPUT(n % tp == 0, "tensor parallel size ", tp, " does not divide ", what, " = ",
                         n);
  };
  divisible(cfg.num_attention_heads, "num_attention_heads");
  divisible(cfg.num_key_value_heads, "num_key_value_heads");
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

}  // namespace colossal::models
