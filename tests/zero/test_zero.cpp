// The low_level_zero plugin (ZeRO-1/2) through the Booster on a plain LibTorch MLP, at the world
// size `colossal run` gives (2 and 4 in make test): per-step losses equal one process on the
// global batch and the ddp plugin; optimizer memory is 1/W; stage 2 keeps only its gradient
// slice; no_sync accumulation equals one step on the larger batch; full-shape checkpoints match
// plain AdamW's and load across plugins.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

#include "colossal/amp/grad_reducer.h"
#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/booster/plugins/low_level_zero_plugin.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/core/accelerator.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/layers.h"
#include "colossal/optim/adamw.h"
#include "colossal/zero/low_level_optim.h"
#include "common/adamw_groups.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;

// Odd sizes so parameters do not divide evenly by 2 or 4 (padding is exercised).
struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(7, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 5));
    unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(at::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, unused{nullptr};
};

std::shared_ptr<MLPImpl> make_mlp() {
  at::manual_seed(0);
  return std::make_shared<MLPImpl>();
}

std::shared_ptr<optim::AdamW> make_adamw(torch::nn::Module& m) {
  return tests::adamw_decay_groups(m, 1e-2, 0.05);
}

at::Tensor global_rows(int step, int micro, int64_t rows) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 * step + micro + 7));
  return at::randn({rows, 7}, gen);
}

at::Tensor target(const at::Tensor& x) {
  return at::sin(x.narrow(1, 0, 5) * 2.0);
}

double rel(double a, double b) {
  return std::abs(a - b) / std::max(1e-12, std::abs(b));
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() /
         std::max(1e-12, b.to(at::kFloat).abs().max().item<double>());
}

struct TrainRun {
  std::vector<double> losses;  // global (mean over ranks) loss per step
  std::vector<double> norms;   // global gradient norm before clipping, per step
  std::shared_ptr<MLPImpl> model;
  booster::Boosted boosted;
  std::unique_ptr<booster::Booster> booster;
};

// Trains `steps` steps of `accum` micro-steps with B rows per rank and micro-step, clipping the
// global norm at 0.5 (so clipping is active at the start).
std::shared_ptr<booster::Plugin> zero_plugin(int stage, const std::string& precision,
                                             bool overlap = true, double bucket_m = 12) {
  booster::ZeroOptions o;
  o.stage = stage;
  o.precision = precision;
  o.overlap_communication = overlap;
  o.reduce_bucket_size_in_m = bucket_m;
  return std::make_shared<booster::LowLevelZeroPlugin>(o);
}

std::shared_ptr<booster::Plugin> ddp_plugin(const std::string& precision) {
  booster::DDPOptions o;
  o.precision = precision;
  return std::make_shared<booster::DDPPlugin>(o);
}

// The model's output in fp32 for fp32 input rows, whatever its working dtype.
at::Tensor forward_f32(MLPImpl& model, const at::Tensor& x) {
  const at::Tensor& w = model.fc1->weight;
  return model.forward(x.to(w.device(), w.scalar_type())).to(at::kCPU, at::kFloat);
}

void train(TrainRun& run, int steps, int accum, int64_t B, int first_step = 0) {
  const int R = dist::world_size(), r = dist::rank();
  auto& b = run.boosted;
  for (int step = first_step; step < first_step + steps; ++step) {
    double loss_sum = 0.0;
    for (int a = 0; a < accum; ++a) {
      at::Tensor x = global_rows(step, a, B * R).narrow(0, r * B, B);
      at::Tensor y = target(x);
      std::unique_ptr<booster::NoSyncGuard> guard;
      if (a + 1 < accum) guard = run.booster->no_sync(*b.model);
      at::Tensor out = forward_f32(*run.model, x);
      at::Tensor loss = at::mse_loss(out, y) / accum;
      run.booster->backward(loss, *b.optimizer);
      at::Tensor l = loss.detach().clone();
      dist::world().all_reduce(l, dist::ReduceOp::Avg);
      loss_sum += l.item<double>();
    }
    run.norms.push_back(run.booster->clip_grad_by_norm(*b.optimizer, 0.5));
    EXPECT_TRUE(b.optimizer->step());
    b.optimizer->zero_grad();
    run.losses.push_back(loss_sum);
  }
}

TrainRun boosted_run(std::shared_ptr<booster::Plugin> plugin) {
  TrainRun run;
  run.model = make_mlp();
  run.booster = std::make_unique<booster::Booster>(std::move(plugin));
  run.boosted = run.booster->boost(run.model, make_adamw(*run.model));
  return run;
}

// One process on the whole global batch: plain AdamW, manual fp64 norm and clipping.
std::vector<double> reference_losses(int steps, int accum, int64_t B,
                                     std::shared_ptr<MLPImpl>* out_model = nullptr) {
  const int R = dist::world_size();
  auto model = make_mlp();
  auto opt = make_adamw(*model);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    double loss_sum = 0.0;
    for (int a = 0; a < accum; ++a) {
      at::Tensor x = global_rows(step, a, B * R);
      at::Tensor loss = at::mse_loss(model->forward(x), target(x)) / accum;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    double sq = 0.0;
    for (auto& p : model->parameters())
      if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    double norm = std::sqrt(sq), coef = 0.5 / (norm + 1e-6);
    opt->step(coef < 1.0 ? 1.0 / coef : 1.0);
    opt->zero_grad();
    losses.push_back(loss_sum);
  }
  if (out_model) *out_model = model;
  return losses;
}

class Zero : public ::testing::TestWithParam<int> {};

TEST_P(Zero, Fp32LossesMatchSingleProcessAndDdp) {
  const int stage = GetParam();
  const int64_t B = 3;
  std::shared_ptr<MLPImpl> ref_model;
  auto ref = reference_losses(10, 1, B, &ref_model);
  TrainRun ddp = boosted_run(ddp_plugin("fp32"));
  train(ddp, 10, 1, B);
  // Tiny buckets (a few elements): many buckets, launched in order, each parameter alone.
  for (double bucket_m : {12.0, 1e-4}) {
    for (bool overlap : {true, false}) {
      TrainRun z = boosted_run(zero_plugin(stage, "fp32", overlap, bucket_m));
      train(z, 10, 1, B);
      for (int s = 0; s < 10; ++s) {
        EXPECT_LT(rel(z.losses[s], ref[s]), 1e-5) << "stage " << stage << " step " << s;
        EXPECT_LT(rel(z.losses[s], ddp.losses[s]), 1e-5) << "stage " << stage << " step " << s;
      }
      auto zp = z.model->named_parameters(true);
      auto rp = ref_model->named_parameters(true);
      for (auto& item : zp) EXPECT_LT(max_rel(item.value(), rp[item.key()]), 1e-5) << item.key();
      // The unused layer never got a gradient: untouched, no state.
      EXPECT_TRUE(z.model->unused->weight.equal(make_mlp()->unused->weight));
    }
  }
  // The losses moved: the comparison is not between two frozen runs.
  EXPECT_LT(ref.back(), 0.9 * ref.front());
}

TEST_P(Zero, Bf16LossesTrackFp32AndDdp) {
  // bf16 working weights carry 8 significant bits (relative rounding 2^-9 ~ 0.2%) and bf16
  // gradients are reduced in bf16; over 10 steps of lr 1e-2 the loss of a run with fp32 masters
  // stays within a few percent of fp32 (3e-2 allows ~15 rounding steps of 0.2%), and within 1e-2
  // of ddp in bf16, whose masters see the same rounded gradients up to the order of the sum.
  const int stage = GetParam();
  const int64_t B = 3;
  auto ref = reference_losses(10, 1, B);
  TrainRun ddp = boosted_run(ddp_plugin("bf16"));
  train(ddp, 10, 1, B);
  TrainRun z = boosted_run(zero_plugin(stage, "bf16"));
  train(z, 10, 1, B);
  EXPECT_EQ(z.model->fc1->weight.scalar_type(), at::kBFloat16);
  for (int s = 0; s < 10; ++s) {
    EXPECT_LT(rel(z.losses[s], ref[s]), 3e-2) << "step " << s;
    EXPECT_LT(rel(z.losses[s], ddp.losses[s]), 1e-2) << "step " << s;
  }
}

TEST_P(Zero, StateIsShardedAndStage2KeepsOnlyItsSlice) {
  const int stage = GetParam();
  const int R = dist::world_size();
  TrainRun z = boosted_run(zero_plugin(stage, "fp32"));
  auto& w = dynamic_cast<booster::ZeroOptimizerWrapper&>(*z.boosted.optimizer);
  auto& zo = w.zero();
  // Before any step: only the fp32 master shards.
  const int64_t padded = zo.padded_numel(), total = zo.total_numel();
  EXPECT_EQ(total, 7 * 13 + 13 + 13 * 5 + 5 + 3 * 3 + 3);
  EXPECT_LT(padded - total, static_cast<int64_t>(R * zo.num_params()));
  EXPECT_EQ(zo.state_bytes(), 4 * padded / R);
  const int64_t B = 3;
  at::Tensor x = global_rows(0, 0, B * R).narrow(0, dist::rank() * B, B);
  z.booster->backward(at::mse_loss(z.model->forward(x), target(x)), *z.boosted.optimizer);
  if (stage == 2) {
    // Right after backward: no full gradient anywhere, only this rank's slices.
    for (auto& p : z.model->parameters()) EXPECT_FALSE(p.grad().defined());
    // One rank holds each gradient as backward made it (no fp32 shard; `unused` has none).
    int64_t unused_numel = 0;
    for (auto& p : z.model->unused->parameters()) unused_numel += p.numel();
    EXPECT_EQ(zo.grad_shard_bytes(), R == 1 ? 4 * (total - unused_numel) : 4 * padded / R);
  } else {
    EXPECT_TRUE(z.model->fc1->weight.grad().defined());
  }
  ASSERT_TRUE(z.boosted.optimizer->step());
  // Masters + exp_avg + exp_avg_sq of the parameters that stepped (all but `unused`).
  int64_t unused_shard = 0;
  for (auto& p : z.model->unused->parameters()) unused_shard += (p.numel() + R - 1) / R;
  EXPECT_EQ(zo.state_bytes(), 4 * padded / R + 8 * (padded / R - unused_shard));
  // What one unsharded AdamW holds for the same model, divided by R, within the padding.
  auto plain = make_mlp();
  auto popt = make_adamw(*plain);
  for (auto& p : plain->parameters()) p.mutable_grad() = at::ones_like(p);
  popt->step();
  int64_t plain_state = 4 * total;  // fp32 masters = the parameters themselves
  for (auto& [n, t] : popt->state_dict().tensors) plain_state += t.numel() * 4;
  for (auto& p : z.model->unused->parameters()) plain_state -= 8 * p.numel();  // never stepped
  EXPECT_LE(std::abs(zo.state_bytes() * R - plain_state),
            12 * R * static_cast<int64_t>(zo.num_params()));
}

TEST_P(Zero, AccumulationEqualsOneStepOnTheLargerBatch) {
  // 4 micro-steps of B rows (no_sync on the first 3) == one step on 4B rows per rank. Under
  // stage 2 every micro-step is reduce-scattered and its slice accumulated in fp32.
  const int stage = GetParam();
  const int R = dist::world_size(), r = dist::rank();
  const int64_t B = 2;
  TrainRun acc = boosted_run(zero_plugin(stage, "fp32"));
  TrainRun big = boosted_run(zero_plugin(stage, "fp32"));
  for (int step = 0; step < 3; ++step) {
    // Rank r's 4B rows: the micro-batches' rows of rank r, in micro order.
    std::vector<at::Tensor> parts;
    for (int a = 0; a < 4; ++a) {
      at::Tensor x = global_rows(step, a, B * R).narrow(0, r * B, B);
      parts.push_back(x);
      std::unique_ptr<booster::NoSyncGuard> guard;
      if (a < 3) guard = acc.booster->no_sync(*acc.boosted.model);
      acc.booster->backward(at::mse_loss(forward_f32(*acc.model, x), target(x)) / 4,
                            *acc.boosted.optimizer);
    }
    at::Tensor xb = at::cat(parts);
    big.booster->backward(at::mse_loss(forward_f32(*big.model, xb), target(xb)),
                          *big.boosted.optimizer);
    for (TrainRun* run : {&acc, &big}) {
      run->booster->clip_grad_by_norm(*run->boosted.optimizer, 0.5);
      ASSERT_TRUE(run->boosted.optimizer->step());
      run->boosted.optimizer->zero_grad();
    }
  }
  auto bp = big.model->named_parameters(true);
  for (auto& item : acc.model->named_parameters(true))
    EXPECT_LT(max_rel(item.value(), bp[item.key()]), 1e-5) << item.key();
}

TEST_P(Zero, FullStateMatchesPlainAdamWAndLoadsAcrossPlugins) {
  const int stage = GetParam();
  const int64_t B = 3;
  TrainRun z = boosted_run(zero_plugin(stage, "bf16"));
  train(z, 4, 1, B);
  TrainRun d = boosted_run(ddp_plugin("bf16"));
  train(d, 4, 1, B);
  optim::StateDict zs = z.boosted.optimizer->full_state_dict();
  optim::StateDict ds = d.boosted.optimizer->full_state_dict();
  // Same names, shapes and (up to bf16 reduction order) values as the unsharded optimizer.
  ASSERT_EQ(zs.tensors.size(), ds.tensors.size());
  std::map<std::string, at::Tensor> dmap(ds.tensors.begin(), ds.tensors.end());
  for (auto& [n, t] : zs.tensors) {
    ASSERT_TRUE(dmap.count(n)) << n;
    ASSERT_EQ(t.sizes(), dmap[n].sizes()) << n;
    EXPECT_LT(max_rel(t, dmap[n]), n.find("exp_avg_sq") != std::string::npos ? 5e-2 : 2e-2) << n;
  }
  EXPECT_EQ(zs.scalars.at("steps").dump(), ds.scalars.at("steps").dump());
  // ZeRO state -> ddp optimizer and ddp state -> ZeRO: continuing gives the same losses as the
  // run that produced the state.
  TrainRun d2 = boosted_run(ddp_plugin("bf16"));
  TrainRun z2 = boosted_run(zero_plugin(stage, "bf16"));
  for (auto& item : z.model->named_parameters(true)) {
    d2.model->named_parameters(true)[item.key()].detach().copy_(item.value());
    z2.model->named_parameters(true)[item.key()].detach().copy_(item.value());
  }
  d2.boosted.optimizer->load_full_state_dict(zs);
  z2.boosted.optimizer->load_full_state_dict(zs);
  train(z, 3, 1, B, 4);
  train(z2, 3, 1, B, 4);
  train(d2, 3, 1, B, 4);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(z2.losses[s], z.losses[4 + s]) << "step " << s;  // ZeRO -> ZeRO is exact
    EXPECT_LT(rel(d2.losses[s], z.losses[4 + s]), 1e-2) << "step " << s;
  }
}

TEST_P(Zero, Fp16OverflowIsSkippedOnEveryRank) {
  const int stage = GetParam();
  booster::ZeroOptions o;
  o.stage = stage;
  o.precision = "fp16";
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.hysteresis = 1;
  TrainRun z = boosted_run(std::make_shared<booster::LowLevelZeroPlugin>(o));
  at::Tensor before = z.model->fc1->weight.detach().clone();
  at::Tensor x = global_rows(0, 0, 3).to(at::kHalf);
  at::Tensor loss = at::mse_loss(z.model->forward(x).to(at::kFloat), target(x.to(at::kFloat)));
  // Only the last rank's loss is poisoned: the overflow must be agreed by all.
  if (dist::rank() == dist::world_size() - 1) loss = loss * std::numeric_limits<float>::infinity();
  z.booster->backward(loss, *z.boosted.optimizer);
  EXPECT_FALSE(z.boosted.optimizer->step());
  EXPECT_EQ(z.boosted.optimizer->loss_scale(), 512);
  EXPECT_TRUE(z.model->fc1->weight.equal(before));
  // The next clean step updates.
  z.boosted.optimizer->zero_grad();
  loss = at::mse_loss(z.model->forward(x).to(at::kFloat), target(x.to(at::kFloat)));
  z.booster->backward(loss, *z.boosted.optimizer);
  EXPECT_TRUE(z.boosted.optimizer->step());
  EXPECT_FALSE(z.model->fc1->weight.equal(before));
}

TEST_P(Zero, CpuOffloadMatchesOnDevice) {
  // cpu_offload runs the SIMD CPU Adam on the CPU shards and writes the working-dtype shard in
  // the same pass. fp32: equal to one process within 1e-5 (CPU Adam matches AdamW within 1e-6
  // per step). bf16: equal to the run without offload up to CPU Adam's own rounding (its
  // bf16 cast is round-to-nearest-even like at::Tensor::to, so the working weights agree to
  // the last bf16 bit or one bf16 ulp: 1e-2 on the loss covers it with margin).
  const int stage = GetParam();
  const int64_t B = 3;
  auto ref = reference_losses(10, 1, B);
  booster::ZeroOptions o;
  o.stage = stage;
  o.precision = "fp32";
  o.cpu_offload = true;
  TrainRun z = boosted_run(std::make_shared<booster::LowLevelZeroPlugin>(o));
  train(z, 10, 1, B);
  for (int s = 0; s < 10; ++s) EXPECT_LT(rel(z.losses[s], ref[s]), 1e-5) << "step " << s;
  o.precision = "bf16";
  TrainRun zb = boosted_run(std::make_shared<booster::LowLevelZeroPlugin>(o));
  train(zb, 10, 1, B);
  TrainRun nb = boosted_run(zero_plugin(stage, "bf16"));
  train(nb, 10, 1, B);
  for (int s = 0; s < 10; ++s) EXPECT_LT(rel(zb.losses[s], nb.losses[s]), 1e-2) << "step " << s;
}

// One rank (no communicator): the first bf16 gradient is held as given, a second one moves the
// sum to an fp32 shard, and the fused AdamW writes the bf16 weight itself. The sum of two bf16
// values is exact in fp32, so the norm is the fp64 norm of that sum (to summation order) and the
// update equals the reference AdamW on it (kernel vs ATen ops: 1e-6 relative on the master).
TEST(ZeroOneRank, HeldGradientsAccumulateInFp32AndWriteTheWeight) {
  for (int micro : {1, 2}) {
    SCOPED_TRACE(micro);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(11 + micro));
    at::Tensor master0 = at::randn({5, 7}, gen);
    at::Tensor w = master0.to(at::kBFloat16).requires_grad_(true);
    auto inner = std::make_shared<optim::AdamW>();
    optim::GroupOptions g;
    g.lr = 1e-2;
    g.weight_decay = 0.05;
    inner->add_param_group({{"w", w}}, g);
    zero::LowLevelZeroOptimizer zo(inner, dist::Communicator(), {{"w", master0}});
    ASSERT_EQ(zo.world(), 1);
    EXPECT_EQ(zo.grad_shard_bytes(), 0);  // nothing allocated for gradients up front
    at::Tensor sum = at::zeros({35}, at::kFloat);
    for (int k = 0; k < micro; ++k) {
      at::Tensor gk = at::randn({35}, gen).to(at::kBFloat16);
      zo.add_grad_shard(0, gk);
      sum += gk.to(at::kFloat);
      EXPECT_EQ(zo.grad_shard_bytes(), k == 0 ? 2 * 35 : 4 * 35);  // held bf16, then fp32
    }
    const double want = sum.to(at::kDouble).norm().item<double>();
    EXPECT_NEAR(zo.grad_norm(1.0), want, 1e-12 * want);
    zo.step(2.0);
    at::Tensor ref = master0.reshape({-1}).clone(), m = at::zeros_like(ref),
               v = at::zeros_like(ref);
    kernels::AdamWStep h{g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, 1, 2.0};
    kernels::fused_adamw_reference({ref}, {sum}, {m}, {v}, {}, h);
    const optim::StateDict sd = zo.state_dict();
    at::Tensor got;
    for (auto& [n, t] : sd.tensors)
      if (n == "w.master") got = t.reshape({-1});
    ASSERT_TRUE(got.defined());
    EXPECT_LT(max_rel(got, ref), 1e-6);
    EXPECT_TRUE(at::equal(w.detach().reshape({-1}), got.to(at::kBFloat16)));
    EXPECT_EQ(zo.grad_shard_bytes(), micro == 1 ? 0 : 4 * 35);  // the held gradient is dropped
  }
}

// On the GPU at one rank: without offload the gradients are held and the fused AdamW writes
// the bf16 weights; with offload the squares of each gradient are summed on the GPU before it
// goes down and the CPU Adam updates. Both must train alike: the norm is compared on its own,
// since Adam hides a wrong clip coefficient from the loss. 1e-2: the two Adams round bf16
// weights independently (see CpuOffloadMatchesOnDevice).
// The injected norm reducer (obstacle 7): over the sharding group plus a stand-in second "tp"
// rank whose contribution is added by hand. "a" is replicated over tp (counted on tp rank 0
// only), "b" is split over tp (the peer holds a different part of the same size and norm), so
// from either tp rank the composed norm is |a|^2 + 2|b|^2, where the default reducer (dp only)
// gives |a|^2 + |b|^2.
TEST(ZeroNormReducer, ComposedOverAxesCountsReplicatedParametersOnce) {
  const int R = dist::world_size();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t{29});
  const at::Tensor ga = at::randn({9}, gen), gb = at::randn({4, 5}, gen);
  const double a2 = ga.to(at::kDouble).square().sum().item<double>();
  const double b2 = gb.to(at::kDouble).square().sum().item<double>();
  for (int tp_rank : {-1, 0, 1}) {  // -1: the default reducer
    SCOPED_TRACE(tp_rank);
    at::Tensor a = at::zeros({9}).requires_grad_(true), b = at::zeros({4, 5}).requires_grad_(true);
    auto inner = std::make_shared<optim::AdamW>();
    inner->add_param_group({{"a", a}, {"b", b}}, optim::GroupOptions{});
    zero::LowLevelZeroOptimizer zo(inner, R > 1 ? dist::world() : dist::Communicator(), {});
    if (tp_rank >= 0) {
      amp::GradReducer peer;  // the other tp rank: b's other half, and a when it is tp rank 0
      peer.axes.push_back({"tp", tp_rank, 2});
      const double theirs = b2 + (tp_rank == 1 ? a2 : 0.0);
      peer.all_reduce_sum = [theirs](at::Tensor& t) { t.add_(theirs); };
      peer.all_reduce_max = [](at::Tensor&) {};
      zo.set_norm_reducer(
          amp::compose(
              {amp::over(R > 1 ? dist::world() : dist::Communicator(), at::kCPU, "dp"), peer}),
          [](const std::string& name) {
            return name == "a" ? std::vector<std::string>{"tp"} : std::vector<std::string>{};
          });
    }
    a.mutable_grad() = ga.clone();
    b.mutable_grad() = gb.clone();
    zo.take_full_grads();
    const double want = std::sqrt(tp_rank < 0 ? a2 + b2 : a2 + 2 * b2);
    EXPECT_NEAR(zo.grad_norm(2.0), want / 2.0, 1e-12 * want);
  }
}

// fp8_communication's weight all-gather: after a step every rank's working parameters are the
// all-gather of the updated fp32 master shards quantized per rank with one e4m3 scale over the
// rank's whole bucket (its slices of every parameter, zero padding included), bit for bit. The
// exact masters come from the same optimizer without FP8 (identical shards and AdamW math).
// exact_weights() (what checkpoint saves read) then gathers them again exactly.
TEST(ZeroFp8, WeightAllGatherIsEachRanksDequantizedBucket) {
  const int R = dist::world_size();
  if (R == 1) GTEST_SKIP() << "one rank gathers nothing";
  auto run = [&](bool fp8, bool exact_after) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t{41});
    at::Tensor a = at::randn({9}, gen).requires_grad_(true);
    at::Tensor b = (at::randn({4, 5}, gen) * 0.01).requires_grad_(true);
    auto inner = std::make_shared<optim::AdamW>();
    inner->add_param_group({{"a", a}, {"b", b}}, optim::GroupOptions{});
    zero::ZeroOptimizerOptions zo_opts;
    if (fp8) zo_opts.fp8_allgather = at::kFloat8_e4m3fn;
    zero::LowLevelZeroOptimizer zo(inner, dist::world(), {}, zo_opts);
    a.mutable_grad() = at::randn({9}, gen);
    b.mutable_grad() = at::randn({4, 5}, gen);
    zo.take_full_grads();
    zo.step(1.0);
    if (exact_after) zo.exact_weights();
    return std::vector<at::Tensor>{a.detach().clone(), b.detach().clone()};
  };
  const auto exact = run(false, false), got = run(true, false), regathered = run(true, true);
  std::vector<int64_t> s;
  for (const auto& t : exact) s.push_back((t.numel() + R - 1) / R);
  std::vector<at::Tensor> want = {at::zeros({s[0] * R}), at::zeros({s[1] * R})};
  for (int r = 0; r < R; ++r) {
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < exact.size(); ++i) {
      at::Tensor padded = at::zeros({s[i] * R});
      padded.narrow(0, 0, exact[i].numel()).copy_(exact[i].reshape({-1}));
      parts.push_back(padded.narrow(0, r * s[i], s[i]));
    }
    at::Tensor local = at::cat(parts);
    const at::Tensor amax = local.abs().amax().clamp_min(1e-12);
    const at::Tensor scale = at::full_like(amax, 448.0) / amax;
    at::Tensor deq = (local * scale).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn).to(at::kFloat) *
                     scale.reciprocal();
    int64_t off = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      want[i].narrow(0, r * s[i], s[i]).copy_(deq.narrow(0, off, s[i]));
      off += s[i];
    }
  }
  for (size_t i = 0; i < exact.size(); ++i) {
    at::Tensor w = want[i].narrow(0, 0, exact[i].numel()).view(exact[i].sizes());
    EXPECT_TRUE(at::equal(got[i], w)) << "parameter " << i << "\ngot\n"
                                      << got[i] << "\nwant\n"
                                      << w;
    EXPECT_FALSE(at::equal(got[i], exact[i])) << "parameter " << i << ": FP8 was not used";
    EXPECT_TRUE(at::equal(regathered[i], exact[i])) << "parameter " << i << " after exact_weights";
  }
}

TEST(ZeroCuda, OffloadedAndHeldGradientsTrainAlike) {
  if (!Accelerator::cuda().available() || dist::world_size() != 1)
    GTEST_SKIP() << "needs CUDA and one rank";
  for (int stage : {1, 2}) {
    SCOPED_TRACE(stage);
    auto run = [&](bool offload) {
      booster::ZeroOptions o;
      o.stage = stage;
      o.precision = "bf16";
      o.device = "cuda";
      o.cpu_offload = offload;
      TrainRun z = boosted_run(std::make_shared<booster::LowLevelZeroPlugin>(o));
      EXPECT_TRUE(z.model->fc1->weight.is_cuda());
      train(z, 6, 1, 3);
      return z;
    };
    TrainRun on = run(false), off = run(true);
    EXPECT_LT(on.losses.back(), on.losses.front());
    for (size_t s = 0; s < on.losses.size(); ++s) {
      EXPECT_LT(rel(off.losses[s], on.losses[s]), 1e-2) << "step " << s;
      EXPECT_LT(rel(off.norms[s], on.norms[s]), 1e-2) << "step " << s;
    }
  }
}

TEST(ZeroOptions, BadInputIsRejected) {
  booster::ZeroOptions o;
  o.stage = 3;
  EXPECT_THROW(booster::LowLevelZeroPlugin{o}, InputError);
  o.stage = 2;
  o.reduce_bucket_size_in_m = 0;
  EXPECT_THROW(booster::LowLevelZeroPlugin{o}, InputError);
}

// ---- overlap_allgather -------------------------------------------------------------------------

// The same MLP built from colossal::nn layers (forward pre hooks), with a plain torch::nn::Linear
// inside a colossal layer (covered by that layer's hook) and one directly under the root
// (covered by the root's hook). The plain MLP above has no hook at all.
struct Wrapped : nn::Module {
  Wrapped() : inner(register_module("inner", torch::nn::Linear(13, 13))) {}
  at::Tensor forward(const at::Tensor& x) {
    ForwardScope scope(*this);
    return inner->forward(x);
  }
  torch::nn::Linear inner;
};

struct HookedMLP : nn::Module {
  HookedMLP() {
    fc1 = register_module(
        "fc1", std::make_shared<nn::Linear>(nn::LinearOptions(7, 13).tensor_options(at::kFloat)));
    mid = register_module("mid", std::make_shared<Wrapped>());
    fc2 = register_module(
        "fc2", std::make_shared<nn::Linear>(nn::LinearOptions(13, 5).tensor_options(at::kFloat)));
    tail = register_module("tail", torch::nn::Linear(5, 5));
    at::manual_seed(1);
    c10::NoGradGuard g;
    for (auto& p : parameters()) p.copy_(at::randn(p.sizes()) * 0.3);
  }
  at::Tensor forward(const at::Tensor& x) {
    ForwardScope scope(*this);
    return tail->forward(fc2->forward(at::tanh(mid->forward(at::tanh(fc1->forward(x))))));
  }
  std::shared_ptr<nn::Linear> fc1, fc2;
  std::shared_ptr<Wrapped> mid;
  torch::nn::Linear tail{nullptr};
};

struct OverlapRun {
  std::shared_ptr<torch::nn::Module> model;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::unique_ptr<booster::Booster> booster;
  booster::Boosted boosted;
  zero::LowLevelZeroOptimizer& zero() {
    return dynamic_cast<booster::ZeroOptimizerWrapper&>(*boosted.optimizer).zero();
  }
};

OverlapRun overlap_run(bool hooked, int stage, bool overlap, double bucket_m) {
  OverlapRun r;
  if (hooked) {
    auto m = std::make_shared<HookedMLP>();
    r.model = m;
    r.forward = [m](const at::Tensor& x) { return m->forward(x); };
  } else {
    auto m = make_mlp();
    r.model = m;
    r.forward = [m](const at::Tensor& x) { return m->forward(x); };
  }
  booster::ZeroOptions o;
  o.stage = stage;
  o.precision = "fp32";
  o.reduce_bucket_size_in_m = bucket_m;
  o.overlap_allgather = overlap;
  r.booster = std::make_unique<booster::Booster>(std::make_shared<booster::LowLevelZeroPlugin>(o));
  r.boosted = r.booster->boost(r.model, make_adamw(*r.model));
  return r;
}

void expect_same_params(torch::nn::Module& a, torch::nn::Module& b, const std::string& when) {
  auto pb = b.named_parameters(true);
  for (auto& item : a.named_parameters(true))
    EXPECT_TRUE(item.value().equal(pb[item.key()])) << item.key() << " " << when;
}

// Overlapped and synchronous all-gathers do the same arithmetic: losses and weights must be
// bitwise equal. The overlapped run is checked at every point a stale weight could be read: the
// next forward (hooks), right after step() through wait_weights(), a model checkpoint written
// right after step(), and the optimizer state.
TEST_P(Zero, OverlapAllgatherEqualsSynchronousBitwise) {
  const int stage = GetParam();
  const int R = dist::world_size(), rk = dist::rank();
  const int64_t B = 3;
  for (bool hooked : {true, false}) {
    for (double bucket_m : {12.0, 1e-5}) {
      SCOPED_TRACE(std::string(hooked ? "hooked" : "plain") + " bucket " +
                   std::to_string(bucket_m));
      OverlapRun sync = overlap_run(hooked, stage, false, bucket_m);
      OverlapRun ovl = overlap_run(hooked, stage, true, bucket_m);
      for (int step = 0; step < 6; ++step) {
        at::Tensor x = global_rows(step, 0, B * R).narrow(0, rk * B, B);
        at::Tensor y = target(x);
        at::Tensor loss_sync = at::mse_loss(sync.forward(x), y);
        at::Tensor loss_ovl = at::mse_loss(ovl.forward(x), y);
        // What forward read: the synchronous run's weights (each hook waited for its bucket).
        EXPECT_EQ(ovl.zero().gathers_in_flight(), 0u);
        expect_same_params(*ovl.model, *sync.model, "after forward " + std::to_string(step));
        std::vector<double> losses{loss_sync.item<double>(), loss_ovl.item<double>()};
        for (auto [r, loss] : {std::pair{&sync, loss_sync}, std::pair{&ovl, loss_ovl}}) {
          r->booster->backward(loss, *r->boosted.optimizer);
          r->booster->clip_grad_by_norm(*r->boosted.optimizer, 0.5);
          EXPECT_TRUE(r->boosted.optimizer->step());
        }
        EXPECT_EQ(losses[0], losses[1]) << "step " << step;
        if (R > 1 && hooked) {  // every hooked parameter's bucket is still in flight
          EXPECT_GT(ovl.zero().gathers_in_flight(), 0u) << "step " << step;
        } else {
          EXPECT_EQ(ovl.zero().gathers_in_flight(), 0u) << "step " << step;
        }
        if (step == 2) {  // a checkpoint right after step() waits for the gathers
          const std::string dir = ::testing::TempDir() + "zero_ovl_" + std::to_string(stage) +
                                  (hooked ? "h" : "p") + std::to_string(R);
          ovl.booster->save_model(*ovl.boosted.model, dir + "/model", false);
          if (dist::rank() == 0) {
            auto saved = checkpoint::load_state_dict(dir + "/model");
            auto mine = sync.model->named_parameters(true);
            for (auto& [name, t] : saved) EXPECT_TRUE(t.equal(mine[name])) << name;
          }
          dist::world().barrier();
        }
        if (step == 4) {  // optimizer export waits too, and equals the synchronous one
          auto a = sync.boosted.optimizer->full_state_dict();
          auto b = ovl.boosted.optimizer->full_state_dict();
          ASSERT_EQ(a.tensors.size(), b.tensors.size());
          for (size_t k = 0; k < a.tensors.size(); ++k)
            EXPECT_TRUE(a.tensors[k].second.equal(b.tensors[k].second)) << a.tensors[k].first;
          EXPECT_EQ(ovl.zero().gathers_in_flight(), 0u);
        }
        if (step % 2 == 1) {  // read right after step(), after the documented wait
          ovl.boosted.model->wait_weights();
          EXPECT_EQ(ovl.zero().gathers_in_flight(), 0u);
          expect_same_params(*ovl.model, *sync.model, "after step " + std::to_string(step));
        }
        sync.boosted.optimizer->zero_grad();  // does not touch weights: need not wait
        ovl.boosted.optimizer->zero_grad();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, Zero, ::testing::Values(1, 2),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

}  // namespace
