// Sharded layers that communicate (2 ranks over Gloo): the region operations against their
// local definitions, a vocab-sharded embedding against the whole one, and a Llama with the
// tensor-parallel plan applied from outside against the same model unsharded (logits, loss and
// every gradient, each rank's shard against its slice of the whole gradient).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/embedding.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/parallel_ops.h"
#include "colossal/nn/plan.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// The same values on every rank.
at::Tensor shared_randn(at::IntArrayRef shape, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(shape);
}

}  // namespace

TEST(RegionOps, ForwardAndBackwardAreAdjoint) {
  dist::Communicator g = dist::world();
  const int r = g.rank(), w = g.size();
  // Rank-dependent inputs and output gradients, which every rank can rebuild.
  auto x_of = [](int rank) { return shared_randn({2, 4, 3}, 100 + rank); };
  auto dy_of = [](int rank, at::IntArrayRef shape) { return shared_randn(shape, 200 + rank); };
  at::Tensor x_sum = at::zeros({2, 4, 3}), dy_sum = at::zeros({2, 4, 3});
  for (int i = 0; i < w; ++i) {
    x_sum += x_of(i);
    dy_sum += dy_of(i, {2, 4, 3});
  }
  {  // copy: identity forward, summed gradient
    at::Tensor x = x_of(r).requires_grad_();
    at::Tensor y = copy_to_region(x, g);
    EXPECT_TRUE(at::equal(y, x));
    y.backward(dy_of(r, {2, 4, 3}));
    EXPECT_LT(max_rel(x.grad(), dy_sum), 1e-6);
  }
  {  // reduce: summed forward, identity gradient
    at::Tensor x = x_of(r).requires_grad_();
    at::Tensor y = reduce_from_region(x, g);
    EXPECT_LT(max_rel(y, x_sum), 1e-6);
    y.backward(dy_of(r, {2, 4, 3}));
    EXPECT_TRUE(at::equal(x.grad(), dy_of(r, {2, 4, 3})));
  }
  {  // gather over dim 1: concatenation forward, the own slice of the summed gradient back
    at::Tensor x = x_of(r).requires_grad_();
    at::Tensor y = gather_from_sequence(x, g, 1);
    std::vector<at::Tensor> parts;
    for (int i = 0; i < w; ++i) parts.push_back(x_of(i));
    EXPECT_TRUE(at::equal(y, at::cat(parts, 1)));
    at::Tensor dsum = at::zeros({2, 4 * w, 3});
    for (int i = 0; i < w; ++i) dsum += dy_of(i, {2, 4 * w, 3});
    y.backward(dy_of(r, {2, 4 * w, 3}));
    EXPECT_LT(max_rel(x.grad(), dsum.narrow(1, 4 * r, 4)), 1e-6);
  }
  {  // reduce-scatter over dim 1: own slice of the sum forward, gathered gradient back
    at::Tensor x = x_of(r).requires_grad_();
    at::Tensor y = reduce_scatter_sequence(x, g, 1);
    const int64_t n = 4 / w;
    EXPECT_LT(max_rel(y, x_sum.narrow(1, n * r, n)), 1e-6);
    std::vector<at::Tensor> parts;
    for (int i = 0; i < w; ++i) parts.push_back(dy_of(i, {2, n, 3}));
    y.backward(dy_of(r, {2, n, 3}));
    EXPECT_TRUE(at::equal(x.grad(), at::cat(parts, 1)));
  }
  {  // split: own slice forward, gathered gradient back
    at::Tensor x = x_sum.clone().requires_grad_();
    at::Tensor y = split_sequence(x, g, 1);
    const int64_t n = 4 / w;
    EXPECT_TRUE(at::equal(y, x_sum.narrow(1, n * r, n)));
    std::vector<at::Tensor> parts;
    for (int i = 0; i < w; ++i) parts.push_back(dy_of(i, {2, n, 3}));
    y.backward(dy_of(r, {2, n, 3}));
    EXPECT_TRUE(at::equal(x.grad(), at::cat(parts, 1)));
  }
}

TEST(VocabParallel, ShardedEmbeddingEqualsTheWholeOne) {
  dist::Communicator g = dist::world();
  Embedding whole(EmbeddingOptions(12, 5).padding_idx(3));
  Embedding part(EmbeddingOptions(12, 5).padding_idx(3));
  part.shard(ShardSpec::over(ShardSpec::Kind::Vocab, g));
  InitOptions io;
  io.seed = 9;
  init_parameters(whole, io);
  init_parameters(part, io);  // name-keyed: the shard gets its rows of the same values
  at::manual_seed(1);
  const at::Tensor ids = at::randint(0, 12, {3, 7}, at::kLong);
  const at::Tensor dy = shared_randn({3, 7, 5}, 2);
  at::Tensor y_whole = whole.forward(ids), y_part = part.forward(ids);
  // Each row is one rank's lookup plus zeros: the sum is exact.
  EXPECT_TRUE(at::equal(y_part, y_whole));
  y_whole.backward(dy);
  y_part.backward(dy);
  EXPECT_TRUE(at::equal(part.weight().grad(), part.shard_slice("weight", whole.weight().grad())));
  // Without a group the shard returns its partial sums (storage-only spec).
  Embedding raw(EmbeddingOptions(12, 5));
  raw.shard({ShardSpec::Kind::Vocab, g.rank(), g.size()});
  init_parameters(raw, io);
  EXPECT_FALSE(at::equal(raw.forward(ids), whole.forward(ids)));
}

// Column shards of one group fuse into one GEMM with the region entered once (what q/k/v and
// gate/up run on CUDA; any_device reaches the same path on the CPU's fused loops): equal to each
// projection's own forward, in value and in every gradient, for both region entries.
TEST(TensorParallel, FusedColumnShardsEqualTheirOwnForwards) {
  dist::Communicator g = dist::world();
  for (auto mode : {SequenceParallelMode::Off, SequenceParallelMode::SplitGather}) {
    std::vector<std::shared_ptr<Linear>> ls;
    for (int64_t out : {8, 4, 4}) {
      auto l = std::make_shared<Linear>(LinearOptions(6, out).bias(true));
      ShardSpec spec = ShardSpec::over(ShardSpec::Kind::Column, g);
      spec.sequence_parallel = mode;
      InitOptions io;
      io.seed = 30 + out;
      init_parameters(*l, io);
      l->shard(spec);
      ls.push_back(l);
    }
    ASSERT_TRUE(ls[0]->fusable_column_shard());
    ASSERT_FALSE(ls[0]->fusable());
    // Under split_gather each rank holds its sequence shard [2, 3, 6] of [2, 3*world, 6].
    const at::Tensor x0 = shared_randn({2, 3, 6}, 40 + g.rank());
    std::vector<Linear*> ps = {ls[0].get(), ls[1].get(), ls[2].get()};
    at::Tensor xa = x0.clone().requires_grad_(), xb = x0.clone().requires_grad_();
    std::optional<at::Tensor> fused = fused_projections(xa, ps, /*any_device=*/true);
    ASSERT_TRUE(fused.has_value());
    at::Tensor each = at::cat({ls[0]->forward(xb), ls[1]->forward(xb), ls[2]->forward(xb)}, -1);
    EXPECT_LT(max_rel(*fused, each.detach()), 1e-6);
    const at::Tensor dy = shared_randn(each.sizes(), 50 + g.rank());
    std::vector<at::Tensor> grads_each;
    each.backward(dy);
    for (auto& l : ls) {
      grads_each.push_back(l->weight().grad().clone());
      grads_each.push_back(l->param("bias").grad().clone());
      l->zero_grad();
    }
    fused->backward(dy);
    EXPECT_LT(max_rel(xa.grad(), xb.grad()), 1e-6) << to_string(mode);
    for (size_t i = 0; i < ls.size(); ++i) {
      EXPECT_LT(max_rel(ls[i]->weight().grad(), grads_each[2 * i]), 1e-6);
      EXPECT_LT(max_rel(ls[i]->param("bias").grad(), grads_each[2 * i + 1]), 1e-6);
    }
  }
  // Not alike: a plain projection next to a column shard is never fused.
  auto plain = std::make_shared<Linear>(LinearOptions(6, 4));
  auto col = std::make_shared<Linear>(LinearOptions(6, 4));
  col->shard(ShardSpec::over(ShardSpec::Kind::Column, g));
  EXPECT_FALSE(fused_projections(at::zeros({1, 2, 6}), {col.get(), plain.get()}, true).has_value());
}

TEST(TensorParallel, LlamaPlanEqualsTheWholeModel) {
  dist::Communicator g = dist::world();
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.layer_sliding.assign(2, false);
  c.qkv_bias = true;  // column bias split, row bias added once after the reduce
  c.o_bias = true;
  InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  auto whole = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  init_parameters(*whole, io);
  auto tp = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  check_tensor_parallel(c, g.size());
  PlanOptions po;
  po.tp = g;
  // parallel_output=false: the head gathers its logits, so forward returns the whole ones.
  TensorParallelOptions tpo;
  tpo.parallel_output = false;
  EXPECT_EQ(apply_plan(*tp, tensor_parallel_plan(c, tpo), po), 2 + 7 * c.num_hidden_layers);
  init_parameters(*tp, io);
  // The fused q/k/v and gate/up GEMMs never take a layer that communicates.
  EXPECT_FALSE(tp->model->layers->layers[0]->self_attn->q_proj->fusable());
  at::manual_seed(3);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
  const at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, 11), {0, 1}, -100);
  // fp32: the sharded GEMMs sum the hidden dim in two partial products then an all-reduce,
  // the whole model in one; both round at 2^-24 relative, so 1e-5 of the scale is ample.
  EXPECT_LT(max_rel(tp->forward(ids), whole->forward(ids)), 1e-5);
  at::Tensor loss_tp = tp->forward_loss(ids, targets),
             loss_whole = whole->forward_loss(ids, targets);
  EXPECT_NEAR(loss_tp.item<double>(), loss_whole.item<double>(), 1e-5);
  loss_tp.backward();
  loss_whole.backward();
  auto whole_params = whole->named_parameters();
  int64_t compared = 0;
  for (const auto& item : tp->named_parameters()) {
    const std::string& name = item.key();
    const size_t dot = name.rfind('.');
    auto* layer = dynamic_cast<Module*>(find_module(*tp, name.substr(0, dot)).get());
    ASSERT_NE(layer, nullptr) << name;
    at::Tensor expect = layer->shard_slice(name.substr(dot + 1), whole_params[name].grad());
    // Gradients pass through every layer backwards (a longer chain of fp32 roundings): 1e-4.
    EXPECT_LT(max_rel(item.value().grad(), expect), 1e-4) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(whole_params.size()));
}
