// LoRA layers on the CPU (nn/lora.h): a LoraLinear computes base(x) + B A x * scaling with the
// base frozen and shared (no copy), apply_lora freezes everything but the adapters, a model with
// adapters on every projection still runs (the fused q/k/v and gate/up GEMMs step aside for a
// layer of another kind), and bad configs are named. The same on CUDA with the fused kernels:
// tests/kernels/test_model_cuda.cpp. Parity with Python's peft: test_lora_peft.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
#include <string>

#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/nn/lora.h"
#include "common/error_of.h"
#include "common/tiny_llama.h"

using namespace colossal;
using colossal::tests::error_of;
using namespace colossal::nn;

namespace {

models::ModelConfig tiny() {
  return tests::tiny_llama();
}

}  // namespace

TEST(Lora, LayerIsBasePlusScaledAdapterWithTheBaseFrozenAndShared) {
  at::manual_seed(1);
  Linear base(LinearOptions(6, 5).bias(true));
  base.weight().set_data(at::randn({5, 6}));
  base.param("bias").set_data(at::randn({5}));
  LoraConfig cfg;
  cfg.r = 3;
  cfg.lora_alpha = 6;
  cfg.target_modules = {"x"};
  LoraLinear lora(base, cfg, 7);
  EXPECT_EQ(lora.weight().data_ptr(), base.weight().data_ptr());  // shared, not copied
  EXPECT_DOUBLE_EQ(lora.scaling(), 2.0);
  EXPECT_EQ(lora.lora_B->weight().abs().max().item<float>(), 0.0f);  // B starts at zero
  lora.lora_B->weight().set_data(at::randn({5, 3}));
  at::Tensor x = at::randn({2, 4, 6});
  at::Tensor y = lora.forward(x);
  at::Tensor want = at::linear(x, base.weight(), base.param("bias")) +
                    at::linear(at::linear(x, lora.lora_A->weight()), lora.lora_B->weight()) * 2.0;
  EXPECT_TRUE(at::allclose(y, want, 1e-5, 1e-6));
  y.sum().backward();
  EXPECT_FALSE(lora.weight().grad().defined());
  EXPECT_FALSE(lora.param("bias").grad().defined());
  EXPECT_TRUE(lora.lora_A->weight().grad().defined());
  EXPECT_TRUE(lora.lora_B->weight().grad().defined());
  cfg.use_rslora = true;
  EXPECT_DOUBLE_EQ(cfg.scaling(), 6.0 / std::sqrt(3.0));
}

TEST(Lora, ApplyToAModelFreezesTheBaseAndAdaptsEveryTarget) {
  auto model = std::make_shared<models::CausalLM>(tiny());
  InitOptions io;
  io.seed = 3;
  io.std = 0.2;
  init_parameters(*model, io);
  at::Tensor ids = at::randint(0, 64, {2, 7}, at::kLong);
  at::Tensor before = model->forward(ids);
  LoraConfig cfg;
  cfg.r = 2;
  cfg.target_modules = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"};
  auto paths = apply_lora(*model, cfg, 11);
  ASSERT_EQ(paths.size(), 10u);
  EXPECT_EQ(paths[0], "model.layers.0.self_attn.q_proj");
  // B = 0: the model's function is unchanged; the fused projections step aside.
  EXPECT_TRUE(at::allclose(model->forward(ids), before, 1e-5, 1e-6));
  int64_t trainable = 0;
  for (const auto& p : model->named_parameters()) {
    const bool lora = p.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), lora) << p.key();
    trainable += lora;
  }
  EXPECT_EQ(trainable, 20);
  // Random B: the output moves, and only the adapters get gradients.
  for (const auto& p : model->named_parameters())
    if (p.key().find(".lora_B") != std::string::npos) p.value().set_data(at::randn_like(p.value()));
  at::Tensor after = model->forward(ids);
  EXPECT_GT((after - before).abs().max().item<double>(), 1e-3);
  after.sum().backward();
  for (const auto& p : model->named_parameters())
    EXPECT_EQ(p.value().grad().defined(), p.key().find(".lora_") != std::string::npos) << p.key();
}

TEST(Lora, BadConfigsAreNamed) {
  auto model = std::make_shared<models::CausalLM>(tiny());
  LoraConfig cfg;
  cfg.target_modules = {"q_proj", "qkv"};
  EXPECT_NE(error_of([&] { apply_lora(*model, cfg); }).find("'qkv' matches no linear layer"),
            std::string::npos);
  cfg.target_modules = {"q_proj"};
  cfg.r = 0;
  EXPECT_NE(error_of([&] { apply_lora(*model, cfg); }).find("r must be > 0"), std::string::npos);
  cfg.r = 4;
  cfg.lora_dropout = 1.0;
  EXPECT_NE(error_of([&] { apply_lora(*model, cfg); }).find("lora_dropout"), std::string::npos);
  cfg.lora_dropout = 0;
  cfg.bias = "all";
  EXPECT_NE(error_of([&] { apply_lora(*model, cfg); }).find("bias 'all'"), std::string::npos);
  cfg.bias = "none";
  cfg.target_modules = {};
  EXPECT_NE(error_of([&] { apply_lora(*model, cfg); }).find("target_modules is empty"),
            std::string::npos);
  cfg.target_modules = {"o_proj"};
  apply_lora(*model, cfg);
  EXPECT_NE(error_of([&] { apply_lora(*model, cfg); }).find("already has a LoRA adapter"),
            std::string::npos);
}

// fused_projections over a mix of LoRA and plain projections (the CPU loops of the fused kernels,
// any_device): the bases in one concatenated GEMM, the adapters added after it, equal to each
// projection's own forward in value and in every gradient; with dropout the LoRA layer keeps
// its own forward (the group is not fused).
TEST(Lora, FusedProjectionsTakeAdaptersAlong) {
  at::manual_seed(2);
  auto make = [](int64_t out) {
    auto l = std::make_shared<Linear>(LinearOptions(8, out).bias(false));
    l->weight().set_data(at::randn({out, 8}) * 0.3);
    return l;
  };
  auto q = make(6), k = make(4), v = make(4);
  LoraConfig cfg;
  cfg.r = 2;
  cfg.lora_alpha = 3;
  cfg.target_modules = {"x"};
  auto lq = std::make_shared<LoraLinear>(*q, cfg, 1);
  cfg.r = 3;
  auto lv = std::make_shared<LoraLinear>(*v, cfg, 2);
  lq->lora_B->weight().set_data(at::randn({6, 2}));
  lv->lora_B->weight().set_data(at::randn({4, 3}));
  for (auto* l : {lq.get(), lv.get()}) l->lora_B->weight().set_requires_grad(true);
  at::Tensor x = at::randn({2, 5, 8}).requires_grad_(true);
  auto fused = fused_projections(x, {lq.get(), k.get(), lv.get()}, /*any_device=*/true);
  ASSERT_TRUE(fused.has_value());
  at::Tensor ref = at::cat({lq->forward(x), k->forward(x), lv->forward(x)}, -1);
  EXPECT_TRUE(at::allclose(*fused, ref, 1e-5, 1e-6));
  at::Tensor g = at::randn_like(ref);
  auto grads = [&](const at::Tensor& y) {
    std::vector<at::Tensor> params{x,
                                   lq->lora_A->weight(),
                                   lq->lora_B->weight(),
                                   lv->lora_A->weight(),
                                   lv->lora_B->weight(),
                                   k->weight()};
    return torch::autograd::grad({y}, params, {g});
  };
  auto gf = grads(*fused), gr = grads(ref);
  for (size_t i = 0; i < gf.size(); ++i) EXPECT_TRUE(at::allclose(gf[i], gr[i], 1e-5, 1e-6)) << i;
  cfg.lora_dropout = 0.1;
  auto ld = std::make_shared<LoraLinear>(*v, cfg, 3);
  EXPECT_FALSE(fused_projections(x, {lq.get(), k.get(), ld.get()}, true).has_value());
}
