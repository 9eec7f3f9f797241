// Tensor-parallel LoRA (nn/lora.h; 2 and 4 ranks over Gloo): a LoraLinear sharded as a column
// projection (B split like the base's output, A whole with its gradient summed over the group)
// and as a row projection (A split like the base's input, B whole), with no sequence
// parallelism, split_gather and ring, against the same layer in one process: the output, the
// input's gradient and the gradients of A and B (each rank's tensor against its slice of the
// whole gradient, from the layer's own shard_slice). Column bases with replicated GQA heads (2
// heads over 4 ranks) too. Also the adapter tensors' full shapes and replication (what the
// tensor-parallel checkpoint IO and the gradient norm read), a Llama with LoRA on every
// projection sharded by its tensor-parallel plan against the unsharded one (loss and every
// adapter gradient), and the named refusals of a vocabulary head's options and of a quantized
// base (QLoRA).
//
// Tolerance (fp32): the sharded GEMMs sum in tp partial products plus a reduction; 1e-5
// relative to the tensor's largest entry.
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
#include "colossal/nn/init.h"
#include "colossal/nn/lora.h"
#include "colossal/nn/plan.h"
#include "colossal/nn/quantized_linear.h"
#include "common/tiny_llama.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::nn;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

constexpr int64_t kIn = 8, kOut = 8, kR = 3, kBatch = 2, kSeq = 4;

// A LoraLinear over a base with a bias, B random (not zero) so both adapter gradients are
// non-trivial; the same values on every rank and for every call.
std::shared_ptr<LoraLinear> make_layer(int64_t heads) {
  at::manual_seed(11);
  Linear base(LinearOptions(kIn, kOut).bias(true).heads(heads));
  base.weight().set_data(at::randn({kOut, kIn}));
  base.param("bias").set_data(at::randn({kOut}));
  LoraConfig cfg;
  cfg.r = kR;
  cfg.lora_alpha = 6;
  cfg.target_modules = {"x"};
  auto l = std::make_shared<LoraLinear>(base, cfg, 5);
  l->lora_B->weight().set_data(at::randn({kOut, kR}));
  return l;
}

void check_layer(ShardSpec::Kind kind, SequenceParallelMode mode, int64_t heads) {
  dist::Communicator g = dist::world();
  const int64_t r = g.rank(), w = g.size();
  SCOPED_TRACE(std::string(to_string(kind)) + " " + dist::to_string(mode) + " heads " +
               std::to_string(heads) + " world " + std::to_string(w));
  at::manual_seed(21);
  const at::Tensor x = at::randn({kBatch, kSeq, kIn}), gy = at::randn({kBatch, kSeq, kOut});

  auto whole = make_layer(heads);
  at::Tensor xw = x.clone().requires_grad_();
  at::Tensor yw = whole->forward(xw);
  (yw * gy).sum().backward();

  auto layer = make_layer(heads);
  layer->shard(ShardSpec::over(kind, g, mode));
  const bool column = kind == ShardSpec::Kind::Column;
  const bool seq_split = mode != SequenceParallelMode::Off;
  const int64_t s = kSeq / w;
  // This rank's input, and the part of the whole output (and of its gradient) it computes.
  at::Tensor xl =
      column ? (seq_split ? x.narrow(1, r * s, s) : x) : x.narrow(2, r * (kIn / w), kIn / w);
  auto local_out = [&](const at::Tensor& t) {
    if (column)
      return layer->shard_slice("weight", t.reshape({-1, kOut}).t())
          .t()
          .reshape({kBatch, kSeq, -1});
    return seq_split ? t.narrow(1, r * s, s) : t;
  };
  xl = xl.clone().requires_grad_();
  at::Tensor yl = layer->forward(xl);
  EXPECT_LT(max_rel(yl, local_out(yw.detach())), 1e-5);
  // Each rank back-propagates its part of sum(y * gy); ranks that hold the same rows (a
  // replicated head) share it.
  const int64_t replicas = layer->shard_spec()->replicas;
  at::Tensor gl = local_out(gy);
  if (!column && !seq_split) {
    // Every rank holds the whole output: the loss is the same on each (not a sum over ranks).
  } else {
    gl = gl / static_cast<double>(replicas);
  }
  (yl * gl).sum().backward();
  const at::Tensor dx = xw.grad();
  at::Tensor dx_local =
      column ? (seq_split ? dx.narrow(1, r * s, s) : dx) : dx.narrow(2, r * (kIn / w), kIn / w);
  EXPECT_LT(max_rel(xl.grad(), dx_local), 1e-5);
  for (const char* name : {"lora_A.weight", "lora_B.weight"}) {
    const Linear& mine = name[5] == 'A' ? *layer->lora_A : *layer->lora_B;
    const Linear& ref = name[5] == 'A' ? *whole->lora_A : *whole->lora_B;
    ASSERT_TRUE(mine.weight().grad().defined()) << name;
    EXPECT_LT(max_rel(mine.weight().grad(), layer->shard_slice(name, ref.weight().grad())), 1e-5)
        << name;
    EXPECT_EQ(layer->full_shape(name), ref.weight().sizes().vec()) << name;
    EXPECT_TRUE(at::equal(mine.weight(), layer->shard_slice(name, ref.weight()))) << name;
  }
  EXPECT_FALSE(layer->weight().grad().defined());
  // Never folded into a sibling's GEMM or taken for a vocabulary head: the adapter always runs.
  EXPECT_FALSE(layer->fusable());
  EXPECT_FALSE(layer->fusable_column_shard());
  EXPECT_FALSE(layer->vocab_parallel_head());
  // The whole adapter matrix is held by every rank, the split one by `replicas` ranks.
  EXPECT_EQ(layer->replication("lora_A.weight"), column ? w : 1);
  EXPECT_EQ(layer->replication("lora_B.weight"), column ? replicas : w);
  EXPECT_EQ(layer->lora_A->weight().sizes().vec(),
            (std::vector<int64_t>{kR, column ? kIn : kIn / w}));
}

}  // namespace

TEST(LoraTp, ColumnAndRowBasesInEverySequenceMode) {
  for (auto kind : {ShardSpec::Kind::Column, ShardSpec::Kind::Row})
    for (auto mode :
         {SequenceParallelMode::Off, SequenceParallelMode::SplitGather, SequenceParallelMode::Ring})
      check_layer(kind, mode, 0);
}

TEST(LoraTp, ColumnBaseWithReplicatedHeads) {
  // 2 heads: split over 2 ranks, replicated on pairs of ranks over 4.
  for (auto mode :
       {SequenceParallelMode::Off, SequenceParallelMode::SplitGather, SequenceParallelMode::Ring})
    check_layer(ShardSpec::Kind::Column, mode, 2);
}

TEST(LoraTp, AVocabularyHeadsOptionsAreRefusedByName) {
  auto layer = make_layer(0);
  ShardSpec spec = ShardSpec::over(ShardSpec::Kind::Column, dist::world());
  spec.pad_multiple = 2;
  try {
    layer->shard(spec);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("vocabulary head's options (pad_multiple 2"),
              std::string::npos)
        << e.what();
  }
}

TEST(LoraTp, AQuantizedBaseIsRefusedByName) {
  at::manual_seed(11);
  Linear plain(LinearOptions(kIn, kOut).bias(false));
  plain.weight().set_data(at::randn({kOut, kIn}));
  auto q = QuantizedLinear::from(plain, QuantizeConfig{});
  LoraConfig cfg;
  cfg.r = kR;
  cfg.target_modules = {"x"};
  LoraLinear layer(*q, cfg, 5);
  try {
    layer.shard(ShardSpec::over(ShardSpec::Kind::Column, dist::world()));
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor-parallel QLoRA is not supported"),
              std::string::npos)
        << e.what();
  }
}

TEST(LoraTp, ALlamaShardedByItsPlanEqualsTheWholeOne) {
  dist::Communicator g = dist::world();
  for (auto mode : {SequenceParallelMode::Off, SequenceParallelMode::SplitGather}) {
    SCOPED_TRACE(dist::to_string(mode));
    models::ModelConfig c = tests::tiny_llama();
    auto build = [&] {
      auto m = std::make_shared<models::CausalLM>(c);
      InitOptions io;
      io.seed = 3;
      io.std = 0.2;
      init_parameters(*m, io);
      LoraConfig cfg;
      cfg.r = 4;
      cfg.lora_alpha = 8;
      cfg.target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                            "gate_proj", "up_proj", "down_proj"};
      apply_lora(*m, cfg, 9);
      at::manual_seed(4);
      at::NoGradGuard ng;
      for (auto& item : m->named_parameters(true))
        if (is_lora_parameter(item.key())) item.value().copy_(at::randn_like(item.value()) * 0.1);
      return m;
    };
    at::manual_seed(5);
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 8}, at::kLong);
    const at::Tensor targets = at::randint(0, c.vocab_size, {2, 8}, at::kLong);
    auto whole = build();
    whole->forward_loss(ids, targets).backward();
    auto model = build();
    PlanOptions po;
    po.tp = g;
    po.sequence_parallel = mode;
    apply_plan(*model, models::tensor_parallel_plan(c), po);
    models::ForwardOptions fo;
    at::Tensor local_targets = targets;
    const int64_t s = 8 / g.size();
    if (mode != SequenceParallelMode::Off)
      local_targets = targets.narrow(1, g.rank() * s, s).contiguous();
    at::Tensor loss = model->forward_loss(ids, local_targets);
    at::Tensor want = whole->forward_loss(ids, targets).detach();
    EXPECT_LT(max_rel(loss.detach(), want), 1e-5);
    loss.backward();
    std::map<std::string, at::Tensor> ref;
    for (auto& item : whole->named_parameters(true)) ref[item.key()] = item.value();
    int64_t adapters = 0;
    for (auto& item : model->named_parameters(true)) {
      const at::Tensor& p = item.value();
      if (!is_lora_parameter(item.key())) {
        EXPECT_FALSE(p.grad().defined()) << item.key();
        continue;
      }
      ++adapters;
      const std::string& n = item.key();
      const std::string path = n.substr(0, n.find(".lora_"));
      auto* layer = dynamic_cast<LoraLinear*>(find_module(*model, path).get());
      ASSERT_NE(layer, nullptr) << n;
      const std::string key = n.substr(path.size() + 1);
      EXPECT_LT(max_rel(p.grad(), layer->shard_slice(key, ref.at(n).grad())), 1e-5) << n;
    }
    EXPECT_EQ(adapters, 2 * 7 * c.num_hidden_layers);
  }
}
