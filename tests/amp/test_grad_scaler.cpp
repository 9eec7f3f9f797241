// DynamicGradScaler: backoff after `hysteresis` overflows, growth after growth_interval clean
// steps, min/max caps, the fixed hysteresis quirk, save/load; overflow detection and the
// cross-rank reducer hooks of unscale_and_clip.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "colossal/amp/grad_scaler.h"
#include "colossal/core/error.h"

using namespace colossal;
using namespace colossal::amp;

namespace {
DynamicGradScalerOptions opts() {
  DynamicGradScalerOptions o;
  o.initial_scale = 1024;
  o.growth_interval = 3;
  o.hysteresis = 2;
  o.min_scale = 64;
  o.max_scale = 4096;
  return o;
}
}  // namespace

TEST(GradScaler, BackoffNeedsHysteresisOverflows) {
  DynamicGradScaler s(opts());
  s.update(true);
  EXPECT_EQ(s.scale(), 1024);  // first overflow: skipped step, no backoff yet
  s.update(true);
  EXPECT_EQ(s.scale(), 512);
}

TEST(GradScaler, FixedQuirkEachBackoffNeedsHysteresisAgain) {
  // ColossalAI keeps its hysteresis counter after a backoff, so the third overflow would back
  // off at once (scale 256). Here the counter resets: the third overflow alone does not.
  DynamicGradScaler s(opts());
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.hysteresis_step(), 0);
  s.update(true);
  EXPECT_EQ(s.scale(), 512);
  s.update(true);
  EXPECT_EQ(s.scale(), 256);
}

TEST(GradScaler, GrowthAfterIntervalAndCounterResets) {
  DynamicGradScaler s(opts());
  s.update(false);
  s.update(true);  // resets the growth counter, hysteresis 1
  EXPECT_EQ(s.growth_step(), 0);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 1024);
  s.update(false);  // third consecutive clean step
  EXPECT_EQ(s.scale(), 2048);
  EXPECT_EQ(s.hysteresis_step(), 0);  // growth resets hysteresis too
  EXPECT_EQ(s.growth_step(), 0);
}

TEST(GradScaler, MinAndMaxCaps) {
  DynamicGradScaler s(opts());
  for (int i = 0; i < 20; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 64);
  DynamicGradScaler g(opts());
  for (int i = 0; i < 30; ++i) g.update(false);
  EXPECT_EQ(g.scale(), 4096);
}

TEST(GradScaler, SaveLoad) {
  DynamicGradScaler a(opts());
  a.update(false);
  a.update(true);
  a.update(true);
  a.update(false);
  DynamicGradScaler b(opts());
  b.load_state_dict(json::parse(a.state_dict().dump()));
  for (bool ov : {false, true, false, false, false, true, true}) {
    a.update(ov);
    b.update(ov);
    EXPECT_EQ(a.scale(), b.scale());
    EXPECT_EQ(a.growth_step(), b.growth_step());
    EXPECT_EQ(a.hysteresis_step(), b.hysteresis_step());
  }
  json::Value bad = json::Value::object();
  bad.set("scale", -1.0);
  bad.set("growth_step", 0);
  bad.set("hysteresis_step", 0);
  EXPECT_THROW(b.load_state_dict(bad), InputError);
}

TEST(GradScaler, BadOptionsAreInputErrors) {
  auto o = opts();
  o.backoff_factor = 1.5;
  EXPECT_THROW(DynamicGradScaler{o}, InputError);
  o = opts();
  o.initial_scale = 1e9;
  EXPECT_THROW(DynamicGradScaler{o}, InputError);
  o = opts();
  o.hysteresis = 0;
  EXPECT_THROW(DynamicGradScaler{o}, InputError);
}

TEST(GradScaler, OverflowDetection) {
  std::vector<at::Tensor> g = {at::ones({4}), at::ones({3}, at::kHalf)};
  EXPECT_FALSE(grads_overflow(g));
  g[1][2] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(grads_overflow(g));
  g[1][2] = std::nanf("");
  EXPECT_TRUE(grads_overflow(g));
  // Another rank overflowed: the MAX reducer makes this rank agree.
  std::vector<at::Tensor> clean = {at::ones({4})};
  GradReducer r;
  r.all_reduce_max = [](at::Tensor& t) { t.fill_(1.0); };
  EXPECT_TRUE(grads_overflow(clean, r));
  // Overflow leaves the grads untouched and reports it.
  at::Tensor before = g[0].clone();
  auto res = unscale_and_clip(g, 8.0, 1.0);
  EXPECT_TRUE(res.overflow);
  EXPECT_TRUE(at::equal(g[0], before));
}

TEST(GradScaler, NormSumsAcrossRanks) {
  // A reducer standing in for two identical ranks doubles the sum of squares.
  at::manual_seed(0);
  std::vector<at::Tensor> g = {at::randn({100}), at::randn({7, 3})};
  double local = global_grad_norm(g, 4.0);
  GradReducer r;
  r.all_reduce_sum = [](at::Tensor& t) { t.mul_(2); };
  double global = global_grad_norm(g, 4.0, r);
  EXPECT_NEAR(global, local * std::sqrt(2.0), 1e-12 * global);
  double ref = std::sqrt(
      (g[0].to(at::kDouble).square().sum() + g[1].to(at::kDouble).square().sum()).item<double>());
  EXPECT_NEAR(local, ref / 4.0, 1e-12 * ref);
  auto res = unscale_and_clip(g, 4.0, 0.5, r, /*apply=*/false);
  EXPECT_FALSE(res.overflow);
  EXPECT_NEAR(res.norm, global, 1e-12 * global);
  EXPECT_NEAR(res.divisor, 4.0 / (0.5 / (global + 1e-6)), 1e-9 * res.divisor);
}

// On a CUDA machine (skipped elsewhere): norm, overflow and clipping over grads split between
// the GPU and the CPU (offloaded shards) equal the all-CPU result.
TEST(GradScaler, CudaAndMixedDevices) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(1);
  std::vector<at::Tensor> cpu = {at::randn({1000}) * 64, at::randn({17, 5}).to(at::kHalf) * 64};
  std::vector<at::Tensor> mixed = {cpu[0].to(at::kCUDA), cpu[1].clone()};
  auto rc = unscale_and_clip(cpu, 64.0, 1.0);
  auto rm = unscale_and_clip(mixed, 64.0, 1.0);
  EXPECT_NEAR(rc.norm, rm.norm, 1e-12 * rc.norm);
  EXPECT_TRUE(at::allclose(cpu[0], mixed[0].cpu(), 1e-6, 1e-7));
  EXPECT_TRUE(at::equal(cpu[1], mixed[1]));
  mixed[0][3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(grads_overflow(mixed));
}
