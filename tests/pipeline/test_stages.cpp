// The model split into pipeline stages from outside, in one process on the CPU (fp32): copies of
// a CausalLM each keeping one rank's chunks (Loop and V placements, 1 and 2 chunks, 2 and 4
// stages; tied and untied heads, GQA), chained in virtual-stage order, give the whole model's
// logits, loss and every parameter's gradient (a tied embedding's as the sum of its first- and
// last-stage copies); activation checkpointing over a stage's chunks; the layer distribution
// rules (ColossalAI's default, a user's list, the cost-balanced split against brute force, the
// block ranges of each placement) and the named errors.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/models/llama/costs.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/init.h"
#include "colossal/nn/plan.h"
#include "colossal/pipeline/layers.h"

using namespace colossal;
using namespace colossal::models;
using colossal::pipeline::balance_layers;
using colossal::pipeline::check_layers_per_stage;
using colossal::pipeline::distribute_layers;
using colossal::pipeline::rank_block_ranges;
using colossal::pipeline::stage_block_ranges;
using Ranges = std::vector<std::pair<int64_t, int64_t>>;

namespace {

// Tiny tensors: intra-op threads only contend with each other on a shared machine.
class OneThread : public ::testing::Environment {
 public:
  void SetUp() override { at::set_num_threads(1); }
};
const bool one_thread_registered [[maybe_unused]] =
    (::testing::AddGlobalTestEnvironment(new OneThread), true);

ModelConfig tiny(int64_t layers, bool tied, bool gqa) {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = gqa ? 2 : 4;
  c.head_dim = 8;
  c.layer_sliding.assign(layers, false);
  c.tie_word_embeddings = tied;
  return c;
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& c, const at::Device& device = at::kCPU) {
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  nn::InitOptions io;
  io.seed = 7;
  io.std = 0.2;
  io.device = device;
  nn::init_parameters(*m, io);
  return m;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// {rank, chunk} of virtual stage v.
std::pair<int, int> holder(int v, int stages, bool v_placement) {
  if (!v_placement) return {v % stages, v / stages};
  return v < stages ? std::pair{v, 0} : std::pair{2 * stages - 1 - v, 1};
}

// One model copy per rank, each keeping that rank's chunks.
std::vector<std::shared_ptr<CausalLM>> split(const ModelConfig& c,
                                             const std::vector<int64_t>& layers, int stages,
                                             bool v_placement,
                                             const at::Device& device = at::kCPU) {
  std::vector<std::shared_ptr<CausalLM>> ranks;
  for (int r = 0; r < stages; ++r) {
    ranks.push_back(make_model(c, device));
    ranks.back()->keep_chunks(rank_block_ranges(layers, stages, r, v_placement));
  }
  return ranks;
}

struct Chain {
  at::Tensor logits, loss;
};

// Forward through the virtual stages in order (each stage's input detached, as a pipeline
// receives it), the loss at the last, then backward stage by stage with the received gradient.
Chain run_chain(std::vector<std::shared_ptr<CausalLM>>& ranks, int stages, int chunks,
                bool v_placement, const at::Tensor& ids, const at::Tensor& targets,
                const ForwardOptions& opts = {}) {
  const int V = stages * chunks;
  std::vector<at::Tensor> in(V), out(V);
  Chain res;
  at::Tensor x = ids;
  for (int v = 0; v < V; ++v) {
    auto [r, c] = holder(v, stages, v_placement);
    in[v] = v == 0 ? ids : x.detach().requires_grad_();
    if (v + 1 < V) {
      out[v] = ranks[r]->forward_chunk(c, in[v], opts);
      x = out[v];
    } else {
      {
        at::NoGradGuard ng;
        res.logits = ranks[r]->forward_chunk(c, in[v], opts);
      }
      res.loss = ranks[r]->forward_chunk_loss(c, in[v], targets, 7, opts);
    }
  }
  res.loss.backward();
  for (int v = V - 2; v >= 0; --v) torch::autograd::backward({out[v]}, {in[v + 1].grad()});
  return res;
}

// Every parameter of `whole` against the sum of the copies' gradients of the same name (one
// copy, or the first and last stages' copies of a tied embedding).
void expect_same_gradients(CausalLM& whole, const std::vector<std::shared_ptr<CausalLM>>& ranks,
                           const std::string& what) {
  for (const auto& p : whole.named_parameters()) {
    at::Tensor sum;
    int holders = 0;
    for (const auto& r : ranks) {
      auto params = r->named_parameters();
      if (!params.contains(p.key())) continue;
      ++holders;
      const at::Tensor g = params[p.key()].grad();
      ASSERT_TRUE(g.defined()) << what << " " << p.key();
      sum = sum.defined() ? sum + g : g;
    }
    const bool tied_embedding = whole.tied() && p.key() == "model.embed_tokens.weight";
    ASSERT_GE(holders, 1) << what << " " << p.key();
    if (!tied_embedding) {
      EXPECT_EQ(holders, 1) << what << " " << p.key();
    }
    EXPECT_LE(max_abs(sum, p.value().grad()), 1e-5) << what << " " << p.key();
  }
}

}  // namespace

TEST(Stages, ChainedChunksEqualTheWholeModel) {
  struct Model {
    bool tied, gqa;
  };
  const int64_t L = 9;
  for (Model mk : {Model{false, true}, Model{true, false}, Model{true, true}}) {
    const ModelConfig c = tiny(L, mk.tied, mk.gqa);
    auto whole = make_model(c);
    at::manual_seed(3);
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 10}, at::kLong);
    const at::Tensor targets = at::randint(0, c.vocab_size, {2, 10}, at::kLong);
    const at::Tensor logits = [&] {
      at::NoGradGuard ng;
      return whole->forward(ids);
    }();
    const at::Tensor loss = whole->forward_loss(ids, targets, 7);
    loss.backward();
    struct Layout {
      int stages, chunks;
      bool v;
    };
    for (Layout lay : {Layout{2, 1, false}, Layout{4, 1, false}, Layout{2, 2, false},
                       Layout{2, 2, true}, Layout{4, 2, false}, Layout{4, 2, true}}) {
      const std::string what = std::string(mk.tied ? "tied" : "untied") + (mk.gqa ? " gqa" : "") +
                               " stages " + std::to_string(lay.stages) + " chunks " +
                               std::to_string(lay.chunks) + (lay.v ? " V" : " loop");
      const auto layers = distribute_layers(L, lay.stages, lay.chunks);
      auto ranks = split(c, layers, lay.stages, lay.v);
      for (int r = 0; r < lay.stages; ++r) {
        EXPECT_EQ(ranks[r]->num_chunks(), lay.chunks) << what;
        // The last virtual stage's holder keeps the tied embedding unless it also holds v = 0.
        const bool last = r == holder(lay.stages * lay.chunks - 1, lay.stages, lay.v).first;
        EXPECT_EQ(ranks[r]->holds_tied_copy(), mk.tied && last && r != 0) << what;
        EXPECT_EQ(ranks[r]->owns_block(0), r == 0) << what;
      }
      Chain chain = run_chain(ranks, lay.stages, lay.chunks, lay.v, ids, targets);
      EXPECT_LE(max_abs(chain.logits, logits), 1e-6) << what;
      EXPECT_LE(std::abs(chain.loss.item<double>() - loss.item<double>()), 1e-6) << what;
      expect_same_gradients(*whole, ranks, what);
    }
  }
}

// Rotary tables and masks built by a chunk starting mid-model: position_ids, a padding mask and
// sliding-window layers; and `positions` (a sequence shard's global positions).
TEST(Stages, ChunksBuildTheWholeStepsContext) {
  ModelConfig c = tiny(4, false, true);
  c.model_type = "mistral";
  c.sliding_window = 3;
  c.layer_sliding.assign(4, true);
  auto whole = make_model(c);
  at::manual_seed(5);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 8}, at::kLong);
  const at::Tensor targets = at::randint(0, c.vocab_size, {2, 8}, at::kLong);
  ForwardOptions padded;
  padded.attention_mask = at::ones({2, 8}, at::kLong);
  padded.attention_mask.index_put_({0, at::indexing::Slice(0, 3)}, 0);
  padded.position_ids = at::arange(4, 12, at::kLong).unsqueeze(0).expand({2, 8});
  ForwardOptions shard;
  shard.positions = at::arange(8, at::kLong) * 2 + 1;
  for (const ForwardOptions* opts : {&padded, &shard}) {
    whole->zero_grad();
    at::Tensor logits;
    {
      at::NoGradGuard ng;
      logits = whole->forward(ids, *opts);
    }
    const at::Tensor loss = whole->forward_loss(ids, targets, 4096, *opts);
    loss.backward();
    const auto layers = distribute_layers(4, 2, 2);
    auto ranks = split(c, layers, 2, true);
    Chain chain = run_chain(ranks, 2, 2, true, ids, targets, *opts);
    EXPECT_LE(max_abs(chain.logits, logits), 1e-6);
    EXPECT_LE(std::abs(chain.loss.item<double>() - loss.item<double>()), 1e-6);
    expect_same_gradients(*whole, ranks, opts == &padded ? "padded" : "positions");
  }
}

// ColossalAI's num_ckpt_layers_per_stage over a rank of two chunks: the first n owned layers in
// block order recompute, and the gradients do not change.
TEST(Stages, CheckpointingCountsLayersOverChunks) {
  const ModelConfig c = tiny(8, true, true);
  const auto layers = distribute_layers(8, 2, 2);  // 2 2 2 2
  at::manual_seed(9);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 6}, at::kLong);
  const at::Tensor targets = at::randint(0, c.vocab_size, {2, 6}, at::kLong);
  auto plain = split(c, layers, 2, false);
  run_chain(plain, 2, 2, false, ids, targets);
  for (auto mode : {CheckpointMode::Full, CheckpointMode::Attention}) {
    auto ckpt = split(c, layers, 2, false);
    // Rank 0 owns layers 0, 1 (chunk 0) and 4, 5 (chunk 1): 3 = both of chunk 0 and layer 4.
    ckpt[0]->set_activation_checkpointing(mode, 3);
    ckpt[1]->set_activation_checkpointing(mode);
    const auto& l0 = ckpt[0]->model->layers->layers;
    EXPECT_EQ(l0[0]->checkpointing, mode);
    EXPECT_EQ(l0[1]->checkpointing, mode);
    EXPECT_EQ(l0[4]->checkpointing, mode);
    EXPECT_EQ(l0[5]->checkpointing, CheckpointMode::None);
    EXPECT_THROW(ckpt[0]->set_activation_checkpointing(mode, 5), InputError);
    // Per chunk (ColossalAI's per-virtual-stage list): chunk 0 none, chunk 1 its first layer.
    ckpt[1]->set_activation_checkpointing(mode, std::vector<int64_t>{0, 1});
    const auto& l1 = ckpt[1]->model->layers->layers;
    EXPECT_EQ(l1[2]->checkpointing, CheckpointMode::None);
    EXPECT_EQ(l1[3]->checkpointing, CheckpointMode::None);
    EXPECT_EQ(l1[6]->checkpointing, mode);
    EXPECT_EQ(l1[7]->checkpointing, CheckpointMode::None);
    EXPECT_THROW(ckpt[1]->set_activation_checkpointing(mode, std::vector<int64_t>{3, 0}),
                 InputError);
    EXPECT_THROW(ckpt[1]->set_activation_checkpointing(mode, std::vector<int64_t>{1}), InputError);
    run_chain(ckpt, 2, 2, false, ids, targets);
    for (int r = 0; r < 2; ++r) {
      auto want = plain[r]->named_parameters();
      for (const auto& p : ckpt[r]->named_parameters())
        EXPECT_LE(max_abs(p.value().grad(), want[p.key()].grad()), 1e-6) << p.key();
    }
  }
}

// On the GPU the decoder layers defer their residual adds into the next norm (fused kernels):
// every chunk boundary after a layer resolves it (the chunk returns x + delta), so the chain
// equals the whole model run with the same kernels. fp32: within float rounding (the fused add
// inside the next norm against a plain add).
TEST(Stages, ChunkBoundariesResolveTheDeferredResidualCuda) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  kernels::set_enabled(true);
  const ModelConfig c = tiny(8, true, true);
  auto whole = make_model(c, dev);
  at::manual_seed(6);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, at::kLong).to(dev);
  const at::Tensor targets = at::randint(0, c.vocab_size, {2, 16}, at::kLong).to(dev);
  at::Tensor logits;
  {
    at::NoGradGuard ng;
    logits = whole->forward(ids);
  }
  const at::Tensor loss = whole->forward_loss(ids, targets, 7);
  loss.backward();
  for (bool v : {false, true}) {
    auto ranks = split(c, distribute_layers(8, 2, 2), 2, v, dev);
    Chain chain = run_chain(ranks, 2, 2, v, ids, targets);
    EXPECT_LE(max_abs(chain.logits, logits), 1e-5 * logits.abs().max().item<double>());
    EXPECT_NEAR(chain.loss.item<double>(), loss.item<double>(), 1e-5 * loss.item<double>());
    for (const auto& p : whole->named_parameters()) {
      at::Tensor sum;
      for (const auto& r : ranks) {
        auto params = r->named_parameters();
        if (!params.contains(p.key())) continue;
        const at::Tensor g = params[p.key()].grad();
        sum = sum.defined() ? sum + g : g;
      }
      ASSERT_TRUE(sum.defined()) << p.key();
      const at::Tensor want = p.value().grad();
      EXPECT_LE(max_abs(sum, want), 1e-4 * want.abs().max().item<double>() + 1e-12) << p.key();
    }
  }
}

TEST(Stages, KeepChunksNamesBlocksAndTheTiedCopy) {
  const ModelConfig c = tiny(4, true, true);  // blocks 0..6
  CausalLM m(c, at::TensorOptions().device(at::kMeta));
  m.keep_chunks({{1, 3}, {4, 7}});
  EXPECT_EQ(m.num_chunks(), 2);
  EXPECT_EQ(m.chunk_blocks(1), (std::pair<int64_t, int64_t>{4, 7}));
  EXPECT_EQ(m.first_block(), 1);
  EXPECT_EQ(m.end_block(), 7);
  EXPECT_FALSE(m.whole());
  EXPECT_FALSE(m.owns_block(0));
  EXPECT_FALSE(m.owns_block(3));
  EXPECT_TRUE(m.owns_block(6));
  EXPECT_TRUE(m.holds_tied_copy());
  std::vector<std::string> names;
  for (const auto& b : m.blocks()) names.push_back(b.name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.layers.0", "model.layers.1", "model.layers.3",
                                             "model.norm", "lm_head"}));
  EXPECT_EQ(m.dropped_blocks(), (std::vector<std::string>{"model.layers.2"}));
  auto params = m.named_parameters();
  EXPECT_TRUE(params.contains("model.embed_tokens.weight"));
  EXPECT_FALSE(params.contains("model.layers.2.mlp.up_proj.weight"));
  EXPECT_EQ(m.head_weight().sizes(), (std::vector<int64_t>{96, 32}));
  // Narrowing to the head's chunk alone keeps the copy; dropping the head drops it.
  m.keep_chunks({{5, 7}});
  EXPECT_TRUE(m.holds_tied_copy());
  CausalLM n(c, at::TensorOptions().device(at::kMeta));
  n.keep_chunks({{2, 4}});
  EXPECT_FALSE(n.holds_tied_copy());
  EXPECT_EQ(n.model->embed_tokens, nullptr);
  // keep_blocks is one chunk.
  CausalLM k(c, at::TensorOptions().device(at::kMeta));
  k.keep_blocks(0, 7);
  EXPECT_TRUE(k.whole());
  EXPECT_FALSE(k.holds_tied_copy());
}

// A plan written for the whole model applied to a stage: rules of other stages' blocks are
// accepted through absent_modules; a rule matching nothing anywhere is still refused.
TEST(Stages, WholeModelPlanAppliesToAStage) {
  const ModelConfig c = tiny(4, false, true);
  CausalLM m(c, at::TensorOptions().device(at::kMeta));
  m.keep_chunks({{2, 4}});
  nn::ParallelPlan plan = tensor_parallel_plan(c);
  EXPECT_THROW(nn::apply_plan(m, plan, {}), InputError);  // embed_tokens and lm_head: elsewhere
  nn::PlanOptions po;
  po.absent_modules = m.dropped_blocks();
  EXPECT_NO_THROW(nn::apply_plan(m, plan, po));
  // Rules of a dropped layer are accepted; one its owned layers show wrong is not.
  plan.push_back({"model.layers.0.mlp.up_proj", {}, nn::ShardSpec::Kind::Column});
  EXPECT_NO_THROW(nn::apply_plan(m, plan, po));
  plan.push_back({"model.layers.*.mlp.nope", {}, nn::ShardSpec::Kind::Column});
  EXPECT_THROW(nn::apply_plan(m, plan, po), InputError);
  EXPECT_THROW(nn::apply_plan(m, {{"modle.norm", {}, nn::ShardSpec::Kind::Column}}, po),
               InputError);
  // The tied head's holder keeps model.embed_tokens: its rule matches there.
  const ModelConfig t = tiny(4, true, true);
  CausalLM last(t, at::TensorOptions().device(at::kMeta));
  last.keep_chunks({{3, 7}});
  nn::PlanOptions lo;
  lo.absent_modules = last.dropped_blocks();
  EXPECT_NO_THROW(nn::apply_plan(last, tensor_parallel_plan(t), lo));
}

TEST(Stages, NamedErrors) {
  const ModelConfig c = tiny(4, false, false);
  CausalLM m(c, at::TensorOptions().device(at::kMeta));
  EXPECT_THROW(m.keep_chunks({}), InputError);
  EXPECT_THROW(m.keep_chunks({{2, 2}}), InputError);
  EXPECT_THROW(m.keep_chunks({{0, 8}}), InputError);
  EXPECT_THROW(m.keep_chunks({{0, 3}, {2, 5}}), InputError);
  EXPECT_THROW(m.keep_chunks({{4, 6}, {1, 5}}), InputError);
  EXPECT_THROW(m.chunk_blocks(1), InputError);
  m.keep_chunks({{0, 2}, {4, 7}});
  EXPECT_THROW(m.keep_chunks({{1, 3}}), InputError);  // block 2 was dropped
  at::Tensor ids = at::zeros({1, 4}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
  EXPECT_THROW(m.forward(ids), InputError);
  EXPECT_THROW(m.forward_loss(ids, ids), InputError);
  EXPECT_THROW(m.forward_chunk_loss(0, ids, ids), Error);  // chunk 0 has no head
  try {
    m.keep_chunks({{0, 1}, {0, 2}});
    FAIL() << "overlapping ranges";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("overlap"), std::string::npos) << e.what();
  }
  try {
    distribute_layers(3, 2, 2);
    FAIL() << "3 layers over 4 virtual stages";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("4 virtual stages"), std::string::npos) << e.what();
  }
  EXPECT_THROW(distribute_layers(4, 0), InputError);
  EXPECT_THROW(check_layers_per_stage({2, 2}, 4, 3), InputError);     // size
  EXPECT_THROW(check_layers_per_stage({4, 0, 1}, 5, 3), InputError);  // an empty stage
  EXPECT_THROW(check_layers_per_stage({2, 2, 1}, 6, 3), InputError);  // sum
  EXPECT_NO_THROW(check_layers_per_stage({2, 3, 1}, 6, 3));
  EXPECT_THROW(balance_layers(2, 3, 1, 0, 0), InputError);
  EXPECT_THROW(balance_layers(6, 3, 0, 0, 0), InputError);
  EXPECT_THROW(balance_layers(6, 3, 1, -1, 0), InputError);
  EXPECT_THROW(stage_block_ranges({2, 0}), InputError);
  EXPECT_THROW(rank_block_ranges({1, 1, 1}, 2, 0, false), InputError);          // 3 % 2
  EXPECT_THROW(rank_block_ranges({1, 1, 1, 1}, 2, 2, false), InputError);       // rank
  EXPECT_THROW(rank_block_ranges({1, 1, 1, 1, 1, 1}, 2, 0, true), InputError);  // V: 2 chunks
  EXPECT_THROW(block_costs(c, 0), InputError);
}

// ColossalAI's PipelineStageManager.distribute_layers outputs.
TEST(Layers, DistributeLayersFollowsColossalAI) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(distribute_layers(32, 4), (V{8, 8, 8, 8}));
  EXPECT_EQ(distribute_layers(30, 4), (V{7, 8, 8, 7}));
  EXPECT_EQ(distribute_layers(9, 4), (V{2, 2, 3, 2}));  // r = 1 at V/2 = 2
  EXPECT_EQ(distribute_layers(10, 4), (V{2, 3, 3, 2}));
  EXPECT_EQ(distribute_layers(11, 4), (V{2, 3, 3, 3}));  // r = 3 from 2 - 1 = 1
  // L = 7 over 2 stages x 2 chunks: V = 4, 1 each, r = 3 from 4/2 - 3/2 = 1: 1 2 2 2.
  EXPECT_EQ(distribute_layers(7, 2, 2), (V{1, 2, 2, 2}));
  EXPECT_EQ(distribute_layers(24, 4, 2), (V(8, 3)));
  EXPECT_EQ(distribute_layers(4, 4), (V{1, 1, 1, 1}));
  EXPECT_EQ(distribute_layers(5, 1), (V{5}));
}

TEST(Layers, BlockRangesOfEachPlacement) {
  using R = Ranges;
  const std::vector<int64_t> layers{1, 2, 2, 2};  // L = 7: blocks 0..9
  EXPECT_EQ(stage_block_ranges(layers), (R{{0, 2}, {2, 4}, {4, 6}, {6, 10}}));
  EXPECT_EQ(stage_block_ranges({3}), (R{{0, 6}}));
  EXPECT_EQ(rank_block_ranges(layers, 2, 0, false), (R{{0, 2}, {4, 6}}));   // v 0, 2
  EXPECT_EQ(rank_block_ranges(layers, 2, 1, false), (R{{2, 4}, {6, 10}}));  // v 1, 3
  EXPECT_EQ(rank_block_ranges(layers, 2, 0, true), (R{{0, 2}, {6, 10}}));   // v 0, 3
  EXPECT_EQ(rank_block_ranges(layers, 2, 1, true), (R{{2, 4}, {4, 6}}));    // v 1, 2
  EXPECT_EQ(rank_block_ranges(layers, 4, 3, false), (R{{6, 10}}));
  using pipeline::rank_virtual_stages;
  EXPECT_EQ(rank_virtual_stages(8, 4, 1, false), (std::vector<int>{1, 5}));
  EXPECT_EQ(rank_virtual_stages(8, 4, 1, true), (std::vector<int>{1, 6}));
  EXPECT_EQ(rank_virtual_stages(8, 4, 3, true), (std::vector<int>{3, 4}));
  EXPECT_EQ(rank_virtual_stages(12, 4, 2, false), (std::vector<int>{2, 6, 10}));
}

namespace {

// The least largest stage cost over every contiguous split (each stage >= 1 layer).
double brute_force(int64_t L, int64_t V, double layer, double first, double last) {
  double best = INFINITY;
  std::vector<int64_t> n(V);
  std::function<void(int64_t, int64_t)> go = [&](int64_t v, int64_t left) {
    if (v == V - 1) {
      n[v] = left;
      double worst = 0;
      for (int64_t i = 0; i < V; ++i)
        worst = std::max(worst, n[i] * layer + (i == 0 ? first : 0) + (i == V - 1 ? last : 0));
      best = std::min(best, worst);
      return;
    }
    for (int64_t k = 1; k <= left - (V - 1 - v); ++k) {
      n[v] = k;
      go(v + 1, left - k);
    }
  };
  go(0, L);
  return best;
}

}  // namespace

TEST(Layers, BalanceLayersIsTheOptimum) {
  at::manual_seed(2);
  for (int64_t V = 1; V <= 5; ++V) {
    for (int64_t L = V; L <= 11; ++L) {
      for (int trial = 0; trial < 4; ++trial) {
        const at::Tensor r = at::rand({3}, at::kDouble);
        const double layer = 0.5 + r[0].item<double>(), first = 3 * r[1].item<double>(),
                     last = 6 * r[2].item<double>();
        const auto n = balance_layers(L, static_cast<int>(V), layer, first, last);
        ASSERT_NO_THROW(check_layers_per_stage(n, L, static_cast<int>(V)));
        double worst = 0;
        for (int64_t i = 0; i < V; ++i)
          worst = std::max(worst, n[i] * layer + (i == 0 ? first : 0) + (i == V - 1 ? last : 0));
        EXPECT_NEAR(worst, brute_force(L, V, layer, first, last), 1e-9) << "L " << L << " V " << V;
      }
      // No extras: the optimum closest to the default split is the default split.
      EXPECT_EQ(balance_layers(L, static_cast<int>(V), 1.0, 0, 0),
                distribute_layers(L, static_cast<int>(V)));
    }
  }
  // A heavy head: the last stage gets fewer layers.
  EXPECT_EQ(balance_layers(16, 4, 1.0, 0.0, 4.0), (std::vector<int64_t>{5, 5, 5, 1}));
}

TEST(Layers, BlockCostsFromTheConfig) {
  ModelConfig c = ModelConfig::preset("7b");
  const BlockCosts k = block_costs(c, 4096);
  const double h = 4096, f = 11008, v = 32000, s = 4096;
  EXPECT_DOUBLE_EQ(k.embedding, 2 * h);
  EXPECT_DOUBLE_EQ(k.layer, 2 * h * 4 * h + 4 * h * (s + 1) / 2 + 6 * h * f);
  EXPECT_DOUBLE_EQ(k.head, 2 * h * v + 5 * v);
  // A sliding window caps the keys a query sees.
  c.model_type = "mistral";
  c.sliding_window = 1024;
  c.layer_sliding.assign(c.num_hidden_layers, true);
  EXPECT_LT(block_costs(c, 4096).layer, k.layer);
  EXPECT_DOUBLE_EQ(block_costs(c, 512).layer, block_costs(ModelConfig::preset("7b"), 512).layer);
  // With the costs of a 7B model at 4096 tokens over 32 layers and 4 stages the head weighs
  // less than a layer: the default split is optimal.
  const auto n = balance_layers(32, 4, k.layer, k.embedding, k.head);
  EXPECT_EQ(n, distribute_layers(32, 4));
}
