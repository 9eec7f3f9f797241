// The ddp plugin through the Booster on a plain LibTorch module (not one of our models), at the
// world size `colossal run` gives (2 in make test): gradients averaged exactly like a single
// process on the global batch, no_sync accumulation, parameter broadcast at boost, fp16 overflow
// agreed across ranks, small buckets with an unused parameter.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <limits>
#include <map>

#include "colossal/booster/booster.h"
#include "colossal/booster/grad_sync.h"
#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/data/dataloader.h"
#include "colossal/data/token_file.h"
#include "colossal/dist/fp8_collectives.h"
#include "colossal/optim/adamw.h"

#include <unistd.h>
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;

struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    unused = register_module("unused", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(at::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, unused{nullptr};
};

std::shared_ptr<MLPImpl> make_mlp() {
  at::manual_seed(0);
  return std::make_shared<MLPImpl>();
}

std::shared_ptr<optim::AdamW> make_adamw(torch::nn::Module& m) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> ps;
  for (auto& item : m.named_parameters(true)) ps.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = 1e-2;
  g.weight_decay = 0.01;
  opt->add_param_group(ps, g);
  return opt;
}

// The global batch: 4 rows per rank per micro-step, for every step and micro-step.
at::Tensor global_rows(int step, int micro, int64_t rows) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 * step + micro + 7));
  return at::randn({rows, 8}, gen);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

// Trains `steps` steps with `accum` micro-steps of B rows per rank under ddp, and the same
// data as one process (a reference MLP, plain AdamW, one pass on the whole global batch per
// step); losses and parameters must agree.
void check_against_single_process(int accum, double bucket_cap_mb) {
  const int R = dist::world_size(), r = dist::rank();
  const int64_t B = 4;
  auto model = make_mlp();
  auto ref = make_mlp();
  booster::DDPOptions o;
  o.bucket_cap_mb = bucket_cap_mb;
  booster::Booster booster(std::make_shared<booster::DDPPlugin>(o));
  auto b = booster.boost(model, make_adamw(*model));
  auto ref_opt = make_adamw(*ref);
  for (int step = 0; step < 5; ++step) {
    double ref_loss = 0.0;
    for (int a = 0; a < accum; ++a) {
      at::Tensor x = global_rows(step, a, B * R);
      at::Tensor y = at::sin(x.narrow(1, 0, 4));
      {
        std::unique_ptr<booster::NoSyncGuard> guard;
        if (a + 1 < accum) guard = booster.no_sync(*b.model);
        at::Tensor mine = x.narrow(0, r * B, B);
        at::Tensor loss = at::mse_loss(model->forward(mine), y.narrow(0, r * B, B)) / accum;
        booster.backward(loss, *b.optimizer);
      }
      at::Tensor rl = at::mse_loss(ref->forward(x), y) / accum;
      rl.backward();
      ref_loss += rl.item<double>();
    }
    b.optimizer->step();
    b.optimizer->zero_grad();
    ref_opt->step();
    ref_opt->zero_grad();
  }
  auto mp = model->named_parameters(true);
  auto rp = ref->named_parameters(true);
  for (auto& item : mp) {
    // fp32 sums of R partial gradients vs one sum over all rows: rounding only.
    EXPECT_LT(max_rel(item.value(), rp[item.key()]), 1e-5) << item.key() << " rank " << r;
  }
}

TEST(DDP, MatchesSingleProcess) {
  check_against_single_process(/*accum=*/1, 25.0);
}

TEST(DDP, NoSyncAccumulationMatchesBigBatch) {
  check_against_single_process(/*accum=*/4, 25.0);
}

TEST(DDP, SmallBucketsAndUnusedParameter) {
  // 1 KB buckets: several buckets; `unused` gets no gradient and must not break the ordering.
  check_against_single_process(/*accum=*/2, 0.001);
}

TEST(DDP, BroadcastsRankZeroWeightsAtBoost) {
  auto model = make_mlp();
  if (dist::rank() != 0) {
    at::NoGradGuard g;
    for (auto& p : model->parameters()) p.add_(1.0);
  }
  auto expected = make_mlp();
  booster::Booster booster(std::make_shared<booster::DDPPlugin>());
  auto b = booster.boost(model, make_adamw(*model));
  auto e = expected->named_parameters(true);
  for (auto& item : model->named_parameters(true))
    EXPECT_TRUE(item.value().equal(e[item.key()])) << item.key();
}

TEST(DDP, BucketsFollowReverseOrder) {
  auto model = make_mlp();
  std::vector<std::pair<std::string, at::Tensor>> ps;
  for (auto& item : model->named_parameters(true)) ps.emplace_back(item.key(), item.value());
  booster::GradSync::Options o;
  o.bucket_cap_mb = 64.0 / (1024 * 1024);  // 64 bytes: at most 16 fp32 values per bucket
  booster::GradSync sync(ps, dist::world(), o);
  EXPECT_GT(sync.num_buckets(), 3u);
  EXPECT_EQ(sync.bucket_names(0).front(), "unused.bias");
}

// fp8_communication's wiring: a bucket (q then p: reverse registration order) goes through
// dist::all_reduce_fp8 / reduce_scatter_fp8 (avg, e5m2) as one flat tensor, whose results (checked
// bit for bit in tests/dist/test_fp8_collectives.cpp) land in .grad / the shard callback as they
// are.
TEST(DDP, Fp8GradSyncReducesBucketsThroughTheFp8Collectives) {
  const int W = dist::world_size(), me = dist::rank();
  if (W == 1) GTEST_SKIP() << "one rank communicates nothing";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 + me));
  const at::Tensor c = at::randn({7}, gen), d = at::randn({3, 5}, gen) * 1e-3;
  for (bool scatter : {false, true}) {
    SCOPED_TRACE(scatter);
    at::Tensor p = at::zeros({7}).requires_grad_(true), q = at::zeros({3, 5}).requires_grad_(true);
    booster::GradSync::Options o;
    o.fp8 = at::kFloat8_e5m2;
    std::map<size_t, at::Tensor> shards;
    if (scatter) o.on_shard = [&](size_t k, const at::Tensor& slice) { shards[k] = slice.clone(); };
    booster::GradSync sync({{"p", p}, {"q", q}}, dist::world(), o);
    ((p * c).sum() + (q * d).sum()).backward();
    if (!scatter) {
      at::Tensor flat = at::cat({d.reshape({-1}), c});
      dist::all_reduce_fp8(dist::world(), flat, at::kFloat8_e5m2, dist::ReduceOp::Avg);
      EXPECT_TRUE(q.grad().equal(flat.narrow(0, 0, 15).view({3, 5})));
      EXPECT_TRUE(p.grad().equal(flat.narrow(0, 15, 7)));
      EXPECT_FALSE(p.grad().equal(c));
      continue;
    }
    const int64_t sq = (15 + W - 1) / W, sp = (7 + W - 1) / W;
    at::Tensor in = at::zeros({W, sq + sp});
    at::Tensor qp = at::zeros({W * sq}), pp = at::zeros({W * sp});
    qp.narrow(0, 0, 15).copy_(d.reshape({-1}));
    pp.narrow(0, 0, 7).copy_(c);
    in.narrow(1, 0, sq).copy_(qp.view({W, sq}));
    in.narrow(1, sq, sp).copy_(pp.view({W, sp}));
    at::Tensor out = at::empty({sq + sp});
    dist::reduce_scatter_fp8(dist::world(), out, in.view({-1}), at::kFloat8_e5m2,
                             dist::ReduceOp::Avg);
    ASSERT_EQ(shards.size(), 2u);
    EXPECT_TRUE(shards[1].equal(out.narrow(0, 0, sq)));
    EXPECT_TRUE(shards[0].equal(out.narrow(0, sq, sp)));
  }
}

TEST(DDP, Fp16OverflowOnOneRankSkipsEverywhere) {
  auto model = make_mlp();
  booster::DDPOptions o;
  o.precision = "fp16";
  o.loss_scale.hysteresis = 1;
  o.loss_scale.initial_scale = 1024;
  booster::Booster booster(std::make_shared<booster::DDPPlugin>(o));
  auto b = booster.boost(model, make_adamw(*model));
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kHalf);
  auto before = model->fc1->weight.detach().clone();
  at::Tensor x = global_rows(0, 0, 4).to(at::kHalf);
  at::Tensor loss = model->forward(x).to(at::kFloat).pow(2).mean();
  // Rank 1 (or the only rank) injects an infinite gradient.
  if (dist::rank() == dist::world_size() - 1) loss = loss * std::numeric_limits<float>::infinity();
  booster.backward(loss, *b.optimizer);
  EXPECT_FALSE(b.optimizer->step());
  EXPECT_TRUE(b.optimizer->last_step_skipped());
  EXPECT_DOUBLE_EQ(b.optimizer->loss_scale(), 512.0);
  EXPECT_TRUE(model->fc1->weight.detach().equal(before));
  // A clean step afterwards updates the weights.
  b.optimizer->zero_grad();
  loss = model->forward(x).to(at::kFloat).pow(2).mean();
  booster.backward(loss, *b.optimizer);
  EXPECT_TRUE(b.optimizer->step());
  EXPECT_FALSE(model->fc1->weight.detach().equal(before));
  EXPECT_TRUE(std::isfinite(b.optimizer->last_grad_norm()));
}

TEST(DDP, PrepareDataloaderSplitsTheGlobalBatch) {
  // Rank 0 writes a token file; every rank's rows of a step, gathered, are exactly what one
  // process with the whole global batch reads (same samples, rank-major order).
  std::string path = "/tmp/colossal_test_ddp_tokens_" + std::to_string(::getppid()) + ".bin";
  if (dist::rank() == 0) {
    std::vector<int64_t> toks(4001);
    for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int64_t>((i * 7919) % 50000);
    data::write_token_file(path, toks, data::TokenFormat::RawU16);
  }
  dist::world().barrier();
  auto ds = std::make_shared<data::TokenDataset>(std::make_shared<data::TokenFile>(path), 16);
  booster::DDPPlugin plugin;
  const int64_t B = 3;
  auto mine = plugin.prepare_dataloader(ds, B, /*shuffle=*/true, /*seed=*/5, /*accumulation=*/2);
  data::SamplerOptions all;
  all.micro_batch = B * dist::world_size();
  all.accum = 2;
  all.shuffle = true;
  all.seed = 5;
  data::DataLoader whole(ds, all);
  for (int micro = 0; micro < 6; ++micro) {
    auto [x, y] = mine->next();
    auto [wx, wy] = whole.next();
    at::Tensor gathered = at::empty({B * dist::world_size(), 16}, at::kLong);
    dist::world().all_gather(gathered, x.contiguous());
    EXPECT_TRUE(gathered.equal(wx)) << "micro-step " << micro;
    EXPECT_TRUE(x.narrow(1, 1, 15).equal(y.narrow(1, 0, 15)));
  }
  EXPECT_THROW(plugin.prepare_dataloader(ds, 0), colossal::InputError);
  dist::world().barrier();
  if (dist::rank() == 0) ::unlink(path.c_str());
}

TEST(DDP, RejectsBadOptions) {
  booster::DDPOptions o;
  o.precision = "fp8";
  EXPECT_THROW(booster::DDPPlugin{o}, colossal::InputError);
  booster::DDPOptions c;
  c.device = "tpu";
  EXPECT_THROW(booster::DDPPlugin{c}, colossal::InputError);
}

}  // namespace
