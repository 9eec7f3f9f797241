// Pipeline stages of a tensor-parallel Llama over 2 CPU ranks (Gloo): on every rank, two stage
// copies (2 chunks each under the V placement, or one chunk each) with the whole model's
// tensor-parallel plan applied per stage (rules of other stages' blocks accepted through
// PlanOptions::absent_modules) chained in virtual-stage order equal the whole model under the
// same plan: sharded logits, the vocab-parallel loss, and every shard's gradient (the tied
// embedding's vocab-sharded copies summed over the first and last stage).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/init.h"
#include "colossal/nn/plan.h"
#include "colossal/pipeline/layers.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::models;

namespace {

ModelConfig tiny(bool tied) {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 37;  // padded to 40 over 2 ranks (pad multiple 4)
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.layer_sliding.assign(4, false);
  c.tie_word_embeddings = tied;
  return c;
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// A model under the tensor-parallel plan over the world, keeping `ranges` (empty: whole).
std::shared_ptr<CausalLM> build(const ModelConfig& c,
                                const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  if (!ranges.empty()) m->keep_chunks(ranges);
  nn::PlanOptions po;
  po.tp = dist::world();
  po.absent_modules = m->dropped_blocks();
  TensorParallelOptions tpo;
  tpo.make_vocab_size_divisible_by = 4;
  nn::apply_plan(*m, tensor_parallel_plan(c, tpo), po);
  nn::InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

void check(bool tied, bool v_placement) {
  SCOPED_TRACE(std::string(tied ? "tied" : "untied") + (v_placement ? " V" : " loop 1 chunk"));
  const ModelConfig c = tiny(tied);
  const int stages = 2, chunks = v_placement ? 2 : 1, V = stages * chunks;
  auto whole = build(c, {});
  const auto layers = pipeline::distribute_layers(c.num_hidden_layers, stages, chunks);
  std::vector<std::shared_ptr<CausalLM>> ranks;
  for (int r = 0; r < stages; ++r)
    ranks.push_back(build(c, pipeline::rank_block_ranges(layers, stages, r, v_placement)));
  at::manual_seed(3);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
  const at::Tensor targets = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
  at::Tensor logits;
  {
    at::NoGradGuard ng;
    logits = whole->forward(ids);
  }
  const at::Tensor loss = whole->forward_loss(ids, targets, 7);
  loss.backward();
  // The chain: virtual stage v on copy holder(v), each input detached as a pipeline receives it.
  auto holder = [&](int v) {
    if (!v_placement) return std::pair{v % stages, v / stages};
    return v < stages ? std::pair{v, 0} : std::pair{2 * stages - 1 - v, 1};
  };
  std::vector<at::Tensor> in(V), out(V);
  at::Tensor x = ids, chain_logits, chain_loss;
  for (int v = 0; v < V; ++v) {
    auto [r, ch] = holder(v);
    in[v] = v == 0 ? ids : x.detach().requires_grad_();
    if (v + 1 < V) {
      x = out[v] = ranks[r]->forward_chunk(ch, in[v]);
    } else {
      {
        at::NoGradGuard ng;
        chain_logits = ranks[r]->forward_chunk(ch, in[v]);
      }
      chain_loss = ranks[r]->forward_chunk_loss(ch, in[v], targets, 7);
    }
  }
  ASSERT_EQ(chain_logits.sizes(), logits.sizes());
  EXPECT_EQ(chain_logits.size(-1), 20);  // this rank's columns of the padded vocabulary
  EXPECT_LT(max_rel(chain_logits, logits), 1e-6);
  EXPECT_LT(std::abs(chain_loss.item<double>() / loss.item<double>() - 1), 1e-6);
  chain_loss.backward();
  for (int v = V - 2; v >= 0; --v) torch::autograd::backward({out[v]}, {in[v + 1].grad()});
  int64_t compared = 0;
  for (const auto& p : whole->named_parameters()) {
    at::Tensor sum;
    int holders = 0;
    for (const auto& r : ranks) {
      auto params = r->named_parameters();
      if (!params.contains(p.key())) continue;
      ++holders;
      EXPECT_EQ(params[p.key()].sizes(), p.value().sizes()) << p.key();
      sum = sum.defined() ? sum + params[p.key()].grad() : params[p.key()].grad();
    }
    const bool copies = tied && !v_placement && p.key() == "model.embed_tokens.weight";
    EXPECT_EQ(holders, copies ? 2 : 1) << p.key();
    ASSERT_TRUE(sum.defined()) << p.key();
    EXPECT_LT(max_rel(sum, p.value().grad()), 1e-5) << p.key();
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(whole->named_parameters().size()));
}

}  // namespace

TEST(StagesTensorParallel, StagesOfAShardedModelEqualTheWholeOne) {
  for (bool tied : {false, true})
    for (bool v : {false, true}) check(tied, v);
}
