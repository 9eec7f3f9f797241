// Tensor-parallel FP8 (nn/fp8_linear.h; 2 and 4 ranks over Gloo, the CPU emulation of the FP8
// GEMMs): an Fp8Linear sharded as a column and as a row projection, without sequence
// parallelism and with split_gather, against the same layer in one process: the output, the
// input's gradient and the weight's and bias's (each rank's against its slice of the whole
// gradient). The operands split over the group are cast with the group's amax, so every element
// quantizes exactly as in the unsharded layer; what remains is the order of the fp32 sums (tp
// partial products and their reduction): 1e-5 relative to the tensor's largest entry. Had a
// shard used its own amax, the FP8 rounding (up to 2^-4 relative per element for e4m3) would
// show far above that. Also a Llama converted to FP8, then sharded by its tensor-parallel plan
// (2 ranks), against the whole FP8 one (loss and every gradient), and the named refusals (ring
// sequence mode, rowwise recipe, a vocab-parallel head, local sizes not divisible by 16).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/fp8_linear.h"
#include "colossal/nn/init.h"
#include "colossal/nn/plan.h"
#include "common/tiny_llama.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::nn;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// 64 features: 16 per rank over 4 ranks (the FP8 GEMMs' multiple).
constexpr int64_t kIn = 64, kOut = 64, kBatch = 2, kSeq = 8;

std::shared_ptr<Fp8Linear> make_layer() {
  at::manual_seed(11);
  Linear base(LinearOptions(kIn, kOut).bias(true));
  base.weight().set_data(at::randn({kOut, kIn}));
  base.param("bias").set_data(at::randn({kOut}));
  return std::make_shared<Fp8Linear>(base, Fp8Config{});
}

void check_layer(ShardSpec::Kind kind, SequenceParallelMode mode) {
  dist::Communicator g = dist::world();
  const int64_t r = g.rank(), w = g.size();
  SCOPED_TRACE(std::string(to_string(kind)) + " " + dist::to_string(mode) + " world " +
               std::to_string(w));
  at::manual_seed(21);
  // Inputs with a wide spread, so the shards' own amaxes would differ from the whole tensor's.
  const at::Tensor x = at::randn({kBatch, kSeq, kIn}) * at::linspace(0.1, 3.0, kIn),
                   gy = at::randn({kBatch, kSeq, kOut}) * at::linspace(3.0, 0.1, kOut);

  auto whole = make_layer();
  at::Tensor xw = x.clone().requires_grad_();
  at::Tensor yw = whole->forward(xw);
  (yw * gy).sum().backward();

  auto layer = make_layer();
  layer->shard(ShardSpec::over(kind, g, mode));
  const bool column = kind == ShardSpec::Kind::Column;
  const bool seq_split = mode != SequenceParallelMode::Off;
  const int64_t s = kSeq / w;
  at::Tensor xl =
      column ? (seq_split ? x.narrow(1, r * s, s) : x) : x.narrow(2, r * (kIn / w), kIn / w);
  auto local_out = [&](const at::Tensor& t) {
    if (column) return t.narrow(2, r * (kOut / w), kOut / w);
    return seq_split ? t.narrow(1, r * s, s) : t;
  };
  xl = xl.contiguous().requires_grad_();
  at::Tensor yl = layer->forward(xl);
  EXPECT_LT(max_rel(yl, local_out(yw.detach())), 1e-5);
  (yl * local_out(gy)).sum().backward();
  const at::Tensor dx = xw.grad();
  at::Tensor dx_local =
      column ? (seq_split ? dx.narrow(1, r * s, s) : dx) : dx.narrow(2, r * (kIn / w), kIn / w);
  EXPECT_LT(max_rel(xl.grad(), dx_local), 1e-5);
  EXPECT_LT(max_rel(layer->weight().grad(), layer->shard_slice("weight", whole->weight().grad())),
            1e-5);
  // A row layer's whole bias under split_gather sums over the rank's tokens only (the plugin
  // reduces such tp-whole gradients over the group); elsewhere the gradient is complete.
  if (column || !seq_split) {
    EXPECT_LT(max_rel(layer->param("bias").grad(),
                      layer->shard_slice("bias", whole->param("bias").grad())),
              1e-5);
  }
  EXPECT_FALSE(layer->fusable());
  EXPECT_FALSE(layer->fusable_column_shard());
  EXPECT_FALSE(layer->plain_storage());
}

std::string error_of_shard(Fp8Linear& l, const ShardSpec& spec) {
  try {
    l.shard(spec);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Fp8Tp, ColumnAndRowLayersEqualTheWholeLayer) {
  for (auto kind : {ShardSpec::Kind::Column, ShardSpec::Kind::Row})
    for (auto mode : {SequenceParallelMode::Off, SequenceParallelMode::SplitGather})
      check_layer(kind, mode);
}

TEST(Fp8Tp, WhatIsNotCoveredIsRefusedByName) {
  dist::Communicator g = dist::world();
  auto ring = make_layer();
  EXPECT_NE(
      error_of_shard(*ring, ShardSpec::over(ShardSpec::Kind::Column, g, SequenceParallelMode::Ring))
          .find("sequence_parallelism_mode ring"),
      std::string::npos);
  Linear base(LinearOptions(kIn, kOut));
  Fp8Config rowwise;
  rowwise.recipe = "rowwise";
  Fp8Linear rw(base, rowwise);
  EXPECT_NE(error_of_shard(rw, ShardSpec::over(ShardSpec::Kind::Row, g)).find("rowwise recipe"),
            std::string::npos);
  auto head = make_layer();
  ShardSpec vocab = ShardSpec::over(ShardSpec::Kind::Column, g);
  vocab.pad_multiple = 64;
  EXPECT_NE(error_of_shard(*head, vocab).find("vocabulary head"), std::string::npos);
  Linear narrow(LinearOptions(kIn, 16 * g.size() / 2));  // 8 output features per rank
  Fp8Linear n(narrow, Fp8Config{});
  EXPECT_NE(error_of_shard(n, ShardSpec::over(ShardSpec::Kind::Column, g)).find("divisible by 16"),
            std::string::npos);
}

TEST(Fp8Tp, ALlamaConvertedThenShardedEqualsTheWholeOne) {
  dist::Communicator g = dist::world();
  if (g.size() != 2) GTEST_SKIP() << "2 ranks: over 4 the 2 key/value heads are replicated";
  for (auto mode : {SequenceParallelMode::Off, SequenceParallelMode::SplitGather}) {
    SCOPED_TRACE(dist::to_string(mode));
    // Every projection's local sizes divisible by 16 at tp 2.
    models::ModelConfig c = tests::tiny_llama();
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.head_dim = 16;
    auto build = [&] {
      auto m = std::make_shared<models::CausalLM>(c);
      InitOptions io;
      io.seed = 3;
      io.std = 0.2;
      init_parameters(*m, io);
      EXPECT_EQ(convert_to_fp8(*m, Fp8Config{}, at::Device(at::kCPU)).size(),
                size_t(7 * c.num_hidden_layers));
      return m;
    };
    at::manual_seed(5);
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, at::kLong);
    const at::Tensor targets = at::randint(0, c.vocab_size, {2, 16}, at::kLong);
    auto whole = build();
    at::Tensor want = whole->forward_loss(ids, targets);
    want.backward();
    auto model = build();
    PlanOptions po;
    po.tp = g;
    po.sequence_parallel = mode;
    apply_plan(*model, models::tensor_parallel_plan(c), po);
    at::Tensor local_targets = targets;
    const int64_t s = 16 / g.size();
    if (mode != SequenceParallelMode::Off)
      local_targets = targets.narrow(1, g.rank() * s, s).contiguous();
    at::Tensor loss = model->forward_loss(ids, local_targets);
    EXPECT_LT(max_rel(loss.detach(), want.detach()), 1e-5);
    loss.backward();
    // The FP8 layers' gradients, each rank's against its slice of the whole one (the layers
    // that stay whole, norms and embeddings, are the plugin's to reduce under split_gather).
    int64_t fp8_layers = 0;
    for (const auto& item : model->named_modules("", false)) {
      auto* mine = dynamic_cast<Fp8Linear*>(item.value().get());
      if (mine == nullptr) continue;
      ++fp8_layers;
      auto* ref = dynamic_cast<Fp8Linear*>(find_module(*whole, item.key()).get());
      ASSERT_NE(ref, nullptr) << item.key();
      ASSERT_TRUE(mine->shard_spec().has_value()) << item.key();
      ASSERT_TRUE(mine->weight().grad().defined()) << item.key();
      EXPECT_LT(max_rel(mine->weight().grad(), mine->shard_slice("weight", ref->weight().grad())),
                1e-5)
          << item.key();
    }
    EXPECT_EQ(fp8_layers, 7 * c.num_hidden_layers);
  }
}
