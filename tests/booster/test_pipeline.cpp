// Pipeline parallelism through Booster::execute_pipeline against the single-process run (RANKS 2
// and RANKS 4 over Gloo; each case runs where the world size fits it): 1F1B at pp 2 and 4,
// GPipe, interleaved (2 chunks), ZB-H1 and ZB-V at pp 2, tp2 x pp2, dp2 x pp2 with ZeRO-1, tied
// and untied heads, 4 and 8 micro-batches, gradient accumulation. Every rank also runs the whole
// model in one process on the whole global batch (the reference). Checked: every step's loss
// and clipped gradient norm over 10 steps, every gradient this rank holds after step 1 (a tp
// shard against its slice; the last stage's copy of a tied embedding against the whole
// gradient, i.e. after the sum over the first and last stage), the final weights; the options'
// named errors.
//
// Tolerances (fp32): a stage boundary moves fp32 activations exactly; the micro-batch losses are
// means over equal token counts, summed with weight 1/M, which equals the one-process mean up to
// rounding (2^-24 relative per operation), as do the gradients accumulated over micro-batches.
// Hence 1e-5 relative for losses, norms and gradients (of the tensor's largest entry), as in
// test_hybrid.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/hybrid_plugin.h"
#include "colossal/core/error.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/nn/module.h"
#include "colossal/nn/plan.h"
#include "colossal/optim/adamw.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::booster;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kSeq = 8, kRowsPerDp = 8;

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

models::ModelConfig tiny_config(bool tied) {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.layer_sliding.assign(4, false);
  c.qkv_bias = true;
  c.tie_word_embeddings = tied;
  return c;
}

std::shared_ptr<models::CausalLM> build(const models::ModelConfig& c) {
  auto m = std::make_shared<models::CausalLM>(c);
  nn::InitOptions io;
  io.seed = 11;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

std::shared_ptr<optim::AdamW> adamw_of(models::CausalLM& m) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> params;
  for (auto& item : m.named_parameters(true)) params.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = 1e-3;
  g.weight_decay = 0.1;
  opt->add_param_group(params, g);
  return opt;
}

std::pair<at::Tensor, at::Tensor> global_batch(int step, int64_t rows, int64_t vocab) {
  at::manual_seed(1000 + step);
  at::Tensor ids = at::randint(0, vocab, {rows, kSeq + 1}, at::kLong);
  return {ids.narrow(1, 0, kSeq).contiguous(), ids.narrow(1, 1, kSeq).contiguous()};
}

at::Tensor slice_of(torch::nn::Module& root, const std::string& name, const at::Tensor& full) {
  auto* layer =
      dynamic_cast<nn::Module*>(nn::find_module(root, name.substr(0, name.rfind('.'))).get());
  COLOSSAL_CHECK(layer, "no layer for ", name);
  return layer->shard_slice(name.substr(name.rfind('.') + 1), full);
}

struct Case {
  int64_t pp = 2, tp = 1, zero = 0, microbatches = 4, chunks = 1, accumulation = 1;
  std::string style = "1f1b";
  bool tied = false;
  double max_norm = 1.0;
};

void run_case(const Case& k) {
  const int world = dist::world_size();
  HybridOptions o;
  o.pp_size = k.pp;
  o.tp_size = k.tp;
  o.zero_stage = k.zero;
  o.precision = "fp32";
  o.max_norm = k.max_norm;
  o.num_microbatches = k.microbatches;
  o.pp_style = k.style;
  o.num_model_chunks = k.chunks;
  o.zero_bucket_size_in_m = 0.001;  // several buckets
  o.ddp_bucket_cap_mb = 0.004;
  o.make_vocab_size_divisible_by = 8;
  auto plugin = std::make_shared<HybridParallelPlugin>(o);
  const int dp = plugin->dp_size(), dp_rank = plugin->dp_rank();
  ASSERT_EQ(dp * k.tp * k.pp, world);
  const models::ModelConfig cfg = tiny_config(k.tied);

  auto ref = build(cfg);
  auto ref_opt =
      std::make_shared<OptimizerWrapper>(adamw_of(*ref), Precision::FP32, LossScaleOptions{});
  auto model = build(cfg);
  Booster booster(plugin);
  Boosted b = booster.boost(model, adamw_of(*model));
  OptimizerWrapper& opt = *b.optimizer;
  auto ref_params = ref->named_parameters(true);

  // The stage holds only its blocks, names unchanged, values the whole model's.
  int64_t held = 0;
  for (auto& item : model->named_parameters(true)) {
    ASSERT_TRUE(ref_params.contains(item.key())) << item.key();
    EXPECT_TRUE(at::equal(item.value(), slice_of(*model, item.key(), ref_params[item.key()])))
        << item.key();
    ++held;
  }
  EXPECT_LT(held, static_cast<int64_t>(ref_params.size()));

  const int64_t A = k.accumulation;
  for (int step = 0; step < kSteps; ++step) {
    double ref_total = 0.0, total = 0.0;
    for (int64_t a = 0; a < A; ++a) {
      auto [ids, targets] =
          global_batch(step * 10 + static_cast<int>(a), kRowsPerDp * dp, cfg.vocab_size);
      at::Tensor ref_loss = ref->forward_loss(ids, targets) / static_cast<double>(A);
      ref_loss.backward();
      ref_total += ref_loss.item<double>();
      at::Tensor my_ids = ids.narrow(0, dp_rank * kRowsPerDp, kRowsPerDp);
      at::Tensor my_targets = targets.narrow(0, dp_rank * kRowsPerDp, kRowsPerDp);
      std::unique_ptr<NoSyncGuard> guard;
      if (a + 1 < A) guard = booster.no_sync(*b.model, &opt);
      PipelineStep ps;
      ps.loss_weight = 1.0 / static_cast<double>(A);
      PipelineOutput out = booster.execute_pipeline(
          [&] { return std::make_pair(my_ids, my_targets); }, *b.model, {}, &opt, true, false, ps);
      ASSERT_TRUE(out.loss.defined());
      at::Tensor mean = out.loss.detach().reshape({1}).to(at::kDouble).clone();
      dist::world().all_reduce(mean, dist::ReduceOp::Avg);
      total += mean.item<double>();
    }
    EXPECT_LE(std::abs(total - ref_total), 1e-5 * std::abs(ref_total)) << "step " << step;
    if (step == 0) {
      for (auto& item : model->named_parameters(true)) {
        const std::string& n = item.key();
        ASSERT_TRUE(item.value().grad().defined()) << n;
        EXPECT_LT(max_rel(item.value().grad(), slice_of(*model, n, ref_params[n].grad())), 1e-5)
            << n;
      }
    }
    const double ref_norm = ref_opt->clip_grad_by_norm(k.max_norm);
    const double norm = opt.clip_grad_by_norm(k.max_norm);
    EXPECT_LE(std::abs(norm - ref_norm), 1e-5 * ref_norm) << "step " << step;
    ASSERT_TRUE(ref_opt->step());
    ASSERT_TRUE(opt.step());
    ref_opt->zero_grad(true);
    opt.zero_grad(true);
  }
  for (auto& item : model->named_parameters(true)) {
    const std::string& n = item.key();
    if (n.find("k_proj.bias") != std::string::npos) continue;  // gradient is rounding noise
    at::Tensor expect = slice_of(*model, n, ref_params[n]);
    EXPECT_LE(((item.value() - expect).norm() / expect.norm()).item<double>(), 5e-5) << n;
  }
}

#define NEED_WORLD(n) \
  if (dist::world_size() != (n)) GTEST_SKIP() << "needs " << (n) << " ranks"

template <class F>
void expect_input_error(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning: " << fragment;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Pipeline, Pp2OneFOneB) {
  NEED_WORLD(2);
  run_case({.pp = 2, .microbatches = 4});
}
TEST(Pipeline, Pp2OneFOneBEightMicrobatchesTied) {
  NEED_WORLD(2);
  run_case({.pp = 2, .microbatches = 8, .tied = true});
}
TEST(Pipeline, Pp2GPipeAccumulation) {
  NEED_WORLD(2);
  run_case({.pp = 2, .microbatches = 4, .accumulation = 2, .style = "gpipe"});
}
TEST(Pipeline, Pp2InterleavedTied) {
  NEED_WORLD(2);
  run_case({.pp = 2, .microbatches = 4, .chunks = 2, .style = "interleaved", .tied = true});
}
TEST(Pipeline, Pp2ZBH1) {
  NEED_WORLD(2);
  run_case({.pp = 2, .microbatches = 4, .style = "zbh1"});
}
TEST(Pipeline, Pp2ZBVTied) {
  NEED_WORLD(2);
  run_case({.pp = 2, .microbatches = 8, .chunks = 2, .style = "zbv", .tied = true});
}
TEST(Pipeline, Pp4OneFOneB) {
  NEED_WORLD(4);
  run_case({.pp = 4, .microbatches = 8, .tied = true});
}
TEST(Pipeline, Tp2Pp2) {
  NEED_WORLD(4);
  run_case({.pp = 2, .tp = 2, .microbatches = 4});
}
TEST(Pipeline, Dp2Pp2Zero1) {
  NEED_WORLD(4);
  run_case({.pp = 2, .zero = 1, .microbatches = 4, .tied = true});
}

TEST(Pipeline, NamedErrors) {
  NEED_WORLD(2);
  auto opts = [] {
    HybridOptions o;
    o.pp_size = 2;
    o.precision = "fp32";
    o.num_microbatches = 4;
    return o;
  };
  {
    HybridOptions o = opts();
    o.zero_stage = 2;
    expect_input_error([&] { o.validate(); }, "zero_stage=2 with pp_size=2");
  }
  {
    HybridOptions o = opts();
    o.pp_style = "zbv";
    expect_input_error([&] { o.validate(); }, "pp_style zbv with num_model_chunks=1");
  }
  {
    HybridOptions o = opts();
    o.num_microbatches = 0;
    expect_input_error([&] { o.validate(); },
                       "exactly one of num_microbatches and microbatch_size");
  }
  {
    HybridOptions o = opts();
    o.num_layers_per_stage = "2,x";
    expect_input_error([&] { o.validate(); }, "'x' is not a non-negative integer");
  }
  // More stages than layers.
  {
    HybridOptions o = opts();
    o.pp_style = "interleaved";
    o.num_model_chunks = 4;
    auto plugin = std::make_shared<HybridParallelPlugin>(o);
    Booster booster(plugin);
    auto model = build(tiny_config(false));
    expect_input_error([&] { booster.boost(model, adamw_of(*model)); }, "need at least 8");
  }
  // Fewer micro-batches than 1F1B needs; a batch that does not split.
  for (auto [mb, rows, fragment] : std::vector<std::tuple<int64_t, int64_t, std::string>>{
           {1, 4, "microbatches"}, {4, 6, "does not split"}}) {
    HybridOptions o = opts();
    o.num_microbatches = mb;
    auto plugin = std::make_shared<HybridParallelPlugin>(o);
    Booster booster(plugin);
    auto model = build(tiny_config(false));
    Boosted b = booster.boost(model, adamw_of(*model));
    auto [ids, targets] = global_batch(0, rows, 96);
    expect_input_error(
        [&] {
          booster.execute_pipeline([&] { return std::make_pair(ids, targets); }, *b.model, {},
                                   b.optimizer.get());
        },
        fragment);
  }
}
