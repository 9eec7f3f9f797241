// The seams of the layer family on the CPU: a replaced projection, core attention, FFN or head
// runs its own forward (the model's output unchanged when it computes the same function), typed
// members follow replace_child, wrong replacements are refused by name, plan rules match and
// apply, option setters, and the sequence-shard arguments of the model. The same replacement on
// CUDA, where the fused q/k/v and gate/up GEMMs run, is in tests/kernels/test_model_cuda.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/init.h"
#include "colossal/nn/plan.h"
#include "common/tiny_llama.h"
#include "nn/recording_layers.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;
using colossal::testing::record_linear;
using colossal::testing::RecordingAttention;
using colossal::testing::RecordingFFN;
using colossal::testing::RecordingLinear;

namespace {

ModelConfig small_config(bool tied = false) {
  ModelConfig c = tests::tiny_llama(2, 96);
  c.tie_word_embeddings = tied;
  return c;
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& c) {
  auto m = std::make_shared<CausalLM>(c);
  InitOptions io;
  io.seed = 7;
  io.std = 0.2;
  init_parameters(*m, io);
  return m;
}

at::Tensor ids_for(const ModelConfig& c) {
  at::manual_seed(11);
  return at::randint(0, c.vocab_size, {2, 10}, at::kLong);
}

}  // namespace

TEST(LayerOptions, NamedSettersAsLibTorch) {
  Linear a(LinearOptions(6, 4));  // bias defaults to true, as torch::nn::LinearOptions
  EXPECT_TRUE(a.has_bias());
  Linear b(LinearOptions(6, 4).bias(false).tensor_options(at::kDouble));
  EXPECT_FALSE(b.has_bias());
  EXPECT_EQ(b.weight().scalar_type(), at::kDouble);
  EXPECT_EQ(b.weight().sizes(), (std::vector<int64_t>{4, 6}));
  Embedding e(EmbeddingOptions(10, 3).padding_idx(2));
  EXPECT_EQ(e.padding_idx(), 2);
  EXPECT_THROW(Linear(LinearOptions(0, 4)), InputError);
  EXPECT_THROW(Embedding(EmbeddingOptions(10, 3).padding_idx(10)), InputError);
}

TEST(LayerSlots, ReplacedProjectionsRunTheirOwnForward) {
  const ModelConfig c = small_config();
  auto m = make_model(c);
  const at::Tensor ids = ids_for(c);
  const at::Tensor before = m->forward(ids);
  auto k = record_linear(*m, "model.layers.0.self_attn.k_proj");
  auto up = record_linear(*m, "model.layers.1.mlp.up_proj");
  auto o = record_linear(*m, "model.layers.1.self_attn.o_proj");
  // The typed members follow the replacement: the parent's forward calls the new layer.
  EXPECT_EQ(m->model->layers->layers[0]->self_attn->k_proj.get(), k.get());
  EXPECT_EQ(m->model->layers->layers[1]->dense_mlp().up_proj.get(), up.get());
  EXPECT_FALSE(k->fusable());  // a derived kind is never fused unless it opts in
  EXPECT_TRUE(m->model->layers->layers[0]->self_attn->q_proj->fusable());
  const at::Tensor after = m->forward(ids);
  EXPECT_EQ(k->calls, 1);
  EXPECT_EQ(up->calls, 1);
  EXPECT_EQ(o->calls, 1);
  EXPECT_TRUE(at::equal(before, after));  // same function, same parameters
  // Parameter names and identities are unchanged: checkpoints and optimizers see no difference.
  EXPECT_TRUE(m->named_parameters().contains("model.layers.0.self_attn.k_proj.weight"));
  EXPECT_TRUE(m->named_parameters()["model.layers.0.self_attn.k_proj.weight"].is_same(k->weight()));
}

TEST(LayerSlots, CoreAttentionFeedForwardAndHeadSlots) {
  const ModelConfig c = small_config();
  auto m = make_model(c);
  const at::Tensor ids = ids_for(c);
  const at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, 9), {0, 1}, -100);
  const at::Tensor logits = m->forward(ids);
  const at::Tensor loss = m->forward_loss(ids, targets);
  auto attn = std::make_shared<RecordingAttention>();
  replace_module(*m, "model.layers.1.self_attn.core_attn", attn);
  auto ffn = std::make_shared<RecordingFFN>(m->model->layers->layers[0]->mlp);
  replace_module(*m, "model.layers.0.mlp", ffn);
  EXPECT_THROW(m->model->layers->layers[0]->dense_mlp(), Error);
  // A head of another kind: forward_loss takes its logits instead of the fused loss over the
  // head's weight, which would bypass it.
  auto head = record_linear(*m, "lm_head");
  EXPECT_TRUE(at::equal(m->forward(ids), logits));
  EXPECT_EQ(attn->calls, 1);
  EXPECT_EQ(ffn->calls, 1);
  EXPECT_EQ(head->calls, 1);
  // fp32: the chunked fused loss and the plain one differ by summation order only.
  EXPECT_NEAR(m->forward_loss(ids, targets).item<double>(), loss.item<double>(), 1e-5);
  EXPECT_EQ(head->calls, 2);
  EXPECT_EQ(ffn->calls, 2);
  // The wrapper FFN registers the MLP it wraps under "inner": names follow the module tree.
  EXPECT_TRUE(m->named_parameters().contains("model.layers.0.mlp.inner.up_proj.weight"));
}

TEST(LayerSlots, WrongReplacementsAreRefusedByName) {
  auto m = make_model(small_config());
  auto norm = std::make_shared<RMSNorm>(32, 1e-6, at::TensorOptions());
  try {
    replace_module(*m, "model.layers.0.self_attn.q_proj", norm);
    FAIL() << "an RMSNorm replaced a Linear";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("colossal::nn::Linear"), std::string::npos) << e.what();
  }
  EXPECT_THROW(replace_module(*m, "model.layers.7.self_attn.q_proj", norm), InputError);
  EXPECT_THROW(replace_module(*m, "model.layers.0.self_attn.nope", norm), InputError);
  // The model still runs with its own layers.
  EXPECT_EQ(m->forward(ids_for(small_config())).size(2), 96);
}

TEST(LayerSlots, PipelineStageDropsBlocksThroughTheSlots) {
  const ModelConfig c = small_config();
  CausalLM stage(c, at::TensorOptions().device(at::kMeta));
  stage.keep_blocks(1, 3);  // layers 0 and 1 only
  EXPECT_EQ(stage.model->embed_tokens, nullptr);
  EXPECT_EQ(stage.lm_head, nullptr);
  EXPECT_FALSE(stage.model->named_children().contains("embed_tokens"));
  EXPECT_FALSE(stage.model->has_slot("embed_tokens"));
  EXPECT_THROW(replace_module(stage, "model.embed_tokens",
                              std::make_shared<Embedding>(EmbeddingOptions(96, 32))),
               InputError);
}

TEST(ParallelPlan, PatternsMatchWholeComponents) {
  EXPECT_TRUE(plan_matches("model.layers.*.mlp.up_proj", "model.layers.12.mlp.up_proj"));
  EXPECT_FALSE(plan_matches("model.layers.*.mlp.up_proj", "model.layers.12.mlp.up_proj.x"));
  EXPECT_FALSE(plan_matches("model.layers.*.mlp.up_proj", "model.layers.mlp.up_proj"));
  EXPECT_FALSE(plan_matches("model.layers.*.mlp.up", "model.layers.1.mlp.up_proj"));
  EXPECT_TRUE(plan_matches("lm_head", "lm_head"));
}

TEST(ParallelPlan, ReplaceRulesApplyFromOutsideTheModel) {
  const ModelConfig c = small_config();
  auto m = make_model(c);
  const at::Tensor ids = ids_for(c);
  const at::Tensor before = m->forward(ids);
  std::vector<std::shared_ptr<RecordingLinear>> made;
  ParallelPlan plan{
      {"model.layers.*.mlp.down_proj",
       [&](const std::string&, const std::shared_ptr<torch::nn::Module>& cur) {
         made.push_back(std::make_shared<RecordingLinear>(*std::dynamic_pointer_cast<Linear>(cur)));
         return made.back();
       },
       std::nullopt}};
  EXPECT_EQ(apply_plan(*m, plan, {}), 2);
  EXPECT_TRUE(at::equal(m->forward(ids), before));
  ASSERT_EQ(made.size(), 2u);
  for (auto& r : made) EXPECT_EQ(r->calls, 1);
  // A rule for another model does not half-apply silently.
  EXPECT_THROW(apply_plan(*m, {{"model.layers.*.mlp.w1", {}, ShardSpec::Kind::Column}}, {}),
               InputError);
  PlanOptions lenient;
  lenient.every_rule_matches = false;
  EXPECT_EQ(apply_plan(*m, {{"model.layers.*.mlp.w1", {}, ShardSpec::Kind::Column}}, lenient), 0);
  // Without a tensor-parallel group the shard rules of the Llama plan change nothing.
  EXPECT_EQ(apply_plan(*m, tensor_parallel_plan(c), {}), 0);
  EXPECT_TRUE(at::equal(m->forward(ids), before));
}

TEST(ParallelPlan, LlamaPlanChecksTheSizes) {
  ModelConfig c = small_config();
  check_tensor_parallel(c, 2);
  try {
    check_tensor_parallel(c, 3);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads = 4"), std::string::npos) << e.what();
  }
  check_tensor_parallel(c, 4);  // 2 kv heads, each replicated on 2 of the 4 ranks
  c.num_attention_heads = 12;
  c.num_key_value_heads = 3;
  c.intermediate_size = 96;
  try {
    check_tensor_parallel(c, 4);  // 3 kv heads over 4 ranks: neither divides the other
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads = 3"), std::string::npos) << e.what();
  }
  c = small_config();
  EXPECT_THROW(check_tensor_parallel(c, 0), InputError);
  // A tied head is the embedding's shard: the plan shards the embedding and has no lm_head
  // rule; an untied head is column-sharded over the padded vocabulary.
  int64_t embed = 0;
  for (const auto& r : tensor_parallel_plan(small_config(true))) {
    EXPECT_NE(r.pattern, "lm_head");
    if (r.pattern == "model.embed_tokens") ++embed;
  }
  EXPECT_EQ(embed, 1);
  TensorParallelOptions tpo;
  tpo.make_vocab_size_divisible_by = 8;
  int64_t head = 0;
  for (const auto& r : tensor_parallel_plan(c, tpo)) {
    if (r.pattern != "lm_head") continue;
    ++head;
    EXPECT_EQ(r.shard, ShardSpec::Kind::Column);
    EXPECT_EQ(r.pad_multiple, 8);
    EXPECT_FALSE(r.gather_output);
  }
  EXPECT_EQ(head, 1);
  tpo.make_vocab_size_divisible_by = 0;
  EXPECT_THROW(tensor_parallel_plan(c, tpo), InputError);
}

TEST(SequenceShard, ArgumentsAreChecked) {
  const ModelConfig c = small_config();
  auto m = make_model(c);
  const at::Tensor ids = ids_for(c);
  ForwardOptions whole;
  whole.global_seq_len = 10;  // the whole step, stated: the same as the default
  EXPECT_TRUE(at::equal(m->forward(ids, whole), m->forward(ids)));
  ForwardOptions bad;
  bad.seq_offset = 6;
  bad.global_seq_len = 12;  // 10 tokens at 6 overrun 12
  EXPECT_THROW(m->forward(ids, bad), InputError);
  KVCache cache(2);
  ForwardOptions cached;
  cached.global_seq_len = 20;
  cached.cache = &cache;
  EXPECT_THROW(m->forward(ids, cached), InputError);
}
