// The model on the GPU with the fused kernels (kernels/ layer: RMSNorm, rotary, concatenated
// q/k/v and gate/up GEMMs, packed SwiGLU; the fused cross-entropy's fp32 weight-gradient
// accumulation) against the same model with them switched off (ATen composites, separate
// projections): loss and every parameter gradient. Skipped without a GPU; runs on the H200 with
// the kernel tests (scripts/device_bench.sh ktests).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/causal_lm.h"
#include "colossal/nn/config.h"
#include "colossal/nn/init.h"

using namespace colossal;

namespace {

struct StepResult {
  double loss = 0;
  std::map<std::string, at::Tensor> grads;
};

StepResult run(at::ScalarType dtype, bool fused, int64_t batch) {
  kernels::set_enabled(fused);
  nn::ModelConfig cfg = nn::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = std::make_shared<nn::CausalLM>(cfg, at::TensorOptions().device(at::kMeta));
  nn::InitOptions io;
  io.seed = 3;
  io.std = cfg.initializer_range;
  io.device = dev;
  nn::init_parameters(*model, io);
  for (auto& p : model->parameters()) p.set_data(p.data().to(dtype));
  at::manual_seed(4);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {batch, 96}, at::kLong).to(dev);
  at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, 95), {0, 1}, -100);
  at::Tensor loss = model->forward_loss(ids, targets, 64);
  loss.backward();
  StepResult r;
  r.loss = loss.item<double>();
  for (auto& item : model->named_parameters(true))
    r.grads[item.key()] = item.value().grad().to(at::kFloat).cpu();
  kernels::set_enabled(true);
  return r;
}

}  // namespace

TEST(ModelCuda, FusedKernelsMatchTheComposites) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  // fp32: the fused ops equal the composites to float rounding (kernels/fused.h); the GEMMs of
  // different shapes sum in other orders: 1e-4 of each gradient's scale.
  // bf16: every op rounds to 8 bits, the two paths at different points: 3 % of the scale.
  for (auto [dtype, rtol] : {std::pair{at::kFloat, 1e-4}, std::pair{at::kBFloat16, 3e-2}}) {
    for (int64_t batch : {1, 3}) {  // batch 1 and a batch sharing one rotary table
      StepResult on = run(dtype, true, batch), off = run(dtype, false, batch);
      const std::string what =
          std::string(c10::toString(dtype)) + " batch " + std::to_string(batch);
      EXPECT_NEAR(on.loss, off.loss, rtol * std::abs(off.loss)) << what;
      ASSERT_EQ(on.grads.size(), off.grads.size());
      for (auto& [name, g] : off.grads) {
        const at::Tensor& f = on.grads.at(name);
        const double scale = g.abs().max().item<double>();
        const double err = (f - g).abs().max().item<double>();
        EXPECT_LE(err, rtol * scale + 1e-12) << what << " " << name;
      }
    }
  }
}
