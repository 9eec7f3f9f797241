// Quantized frozen linear layers on the CPU (nn/quantized_linear.h), the base of QLoRA: a
// QuantizedLinear computes x W^T + b with W the dequantization of its storage, bit for bit the
// same as a plain Linear holding the dequantized weight (forward and input gradient), has no
// weight parameter and trains nothing; LoRA over it equals LoRA over the dequantized plain layer
// (values and adapter gradients); a quantized model loads streaming from an HF folder and equals
// the plain model with dequantized weights; merge_lora folds an adapter into the dequantized
// base. The CUDA kernels against the reference: tests/kernels/test_kernels_cuda.cpp; whole QLoRA
// runs: tests/booster/test_qlora_train.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/nn/lora.h"
#include "colossal/nn/quantized_linear.h"
#include "common/error_of.h"
#include "common/temp_dir.h"
#include "common/tiny_llama.h"

using namespace colossal;
using colossal::tests::error_of;
using namespace colossal::nn;

namespace {

models::ModelConfig tiny() {
  models::ModelConfig c = tests::tiny_llama();
  c.tie_word_embeddings = false;
  return c;
}

QuantizeConfig kind(const std::string& k) {
  QuantizeConfig q;
  q.kind = k;
  return q;
}

// A plain model whose quantizable linear layers hold `quantized`'s dequantized weights.
std::shared_ptr<models::CausalLM> dequantized_copy(const models::CausalLM& plain,
                                                   torch::nn::Module& quantized) {
  auto copy = std::make_shared<models::CausalLM>(plain.config());
  at::NoGradGuard ng;
  auto src = plain.named_parameters(true);
  for (auto& p : copy->named_parameters(true)) p.value().copy_(src[p.key()]);
  for (const auto& item : quantized.named_modules("", false))
    if (auto q = std::dynamic_pointer_cast<QuantizedLinear>(item.value()))
      copy->named_parameters(true)[item.key() + ".weight"].copy_(q->dequantized_weight(at::kFloat));
  return copy;
}

}  // namespace

class QuantizedLinearKinds : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizedLinearKinds, EqualsAPlainLinearWithTheDequantizedWeight) {
  at::manual_seed(3);
  Linear base(LinearOptions(160, 24).bias(true));
  base.weight().set_data(at::randn({24, 160}) * 0.05);
  base.param("bias").set_data(at::randn({24}));
  auto q = std::make_shared<QuantizedLinear>(LinearOptions(160, 24).bias(true), kind(GetParam()));
  q->set_weight(base.weight());
  q->param("bias").set_data(base.param("bias").detach().clone());
  EXPECT_FALSE(q->has_param("weight"));
  EXPECT_FALSE(q->param("bias").requires_grad());
  for (const auto& p : q->parameters()) EXPECT_FALSE(p.requires_grad());
  const at::Tensor w = q->dequantized_weight(at::kFloat);
  ASSERT_EQ(w.sizes(), base.weight().sizes());
  // A real quantization: close to the weight, not equal to it.
  const double err = ((w - base.weight()).norm() / base.weight().norm()).item<double>();
  EXPECT_GT(err, 1e-4);
  EXPECT_LT(err, GetParam() == "nf4" ? 0.15 : 0.05);
  // Storage: nf4 about 4.13 bits per weight (codes, 8-bit constants, fp32 second level), fp8
  // 8 bits plus one fp32 scale per row.
  const int64_t n = 24 * 160;
  EXPECT_EQ(q->storage_bytes(), GetParam() == "nf4" ? n / 2 + n / 64 + 4 + 4 : n + 24 * 4);

  at::Tensor x = at::randn({3, 5, 160}).requires_grad_();
  at::Tensor x2 = x.detach().clone().requires_grad_();
  at::Tensor y = q->forward(x);
  at::Tensor yr = at::linear(x2, w, base.param("bias"));
  EXPECT_TRUE(at::equal(y, yr));
  at::Tensor dy = at::randn_like(y);
  y.backward(dy);
  yr.backward(dy);
  EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
  // The bf16 forward dequantizes into bf16: the plain layer's bf16 GEMM on that weight.
  at::Tensor xb = at::randn({4, 160}).to(at::kBFloat16);
  q->param("bias").set_data(q->param("bias").to(at::kBFloat16));
  EXPECT_TRUE(at::equal(q->forward(xb),
                        at::linear(xb, q->dequantized_weight(at::kBFloat16), q->param("bias"))));
}

TEST_P(QuantizedLinearKinds, LoraOverTheQuantizedBaseEqualsLoraOverTheDequantizedOne) {
  at::manual_seed(4);
  auto base = std::make_shared<Linear>(LinearOptions(64, 40).bias(false));
  base->weight().set_data(at::randn({40, 64}) * 0.05);
  auto q = QuantizedLinear::from(*base, kind(GetParam()));
  auto plain = std::make_shared<Linear>(LinearOptions(64, 40).bias(false));
  plain->weight().set_data(q->dequantized_weight(at::kFloat));
  LoraConfig cfg;
  cfg.r = 4;
  cfg.lora_alpha = 8;
  cfg.target_modules = {"x"};
  LoraLinear lq(*q, cfg, 5), lp(*plain, cfg, 5);
  EXPECT_FALSE(lq.has_param("weight"));
  EXPECT_EQ(lq.quantized_base(), q);
  {
    at::NoGradGuard ng;
    lq.lora_B->weight().copy_(at::randn({40, 4}));
    lp.lora_B->weight().copy_(lq.lora_B->weight());
  }
  EXPECT_TRUE(at::equal(lq.lora_A->weight(), lp.lora_A->weight()));  // the same init
  at::Tensor x = at::randn({6, 64}).requires_grad_();
  at::Tensor x2 = x.detach().clone().requires_grad_();
  at::Tensor y = lq.forward(x), yp = lp.forward(x2);
  EXPECT_TRUE(at::allclose(y, yp, 1e-6, 1e-6));
  at::Tensor dy = at::randn_like(y);
  y.backward(dy);
  yp.backward(dy);
  EXPECT_TRUE(at::allclose(lq.lora_A->weight().grad(), lp.lora_A->weight().grad(), 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(lq.lora_B->weight().grad(), lp.lora_B->weight().grad(), 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-6, 1e-6));
  // Neither the quantized layer nor LoRA over it joins a sibling's concatenated GEMM.
  auto sibling = std::make_shared<Linear>(LinearOptions(64, 40).bias(false));
  sibling->weight().set_data(at::randn({40, 64}));
  at::Tensor xs = at::randn({3, 64});
  EXPECT_FALSE(fused_projections(xs, {&lq, sibling.get()}, /*any_device=*/true).has_value());
  EXPECT_FALSE(fused_projections(xs, {q.get(), sibling.get()}, /*any_device=*/true).has_value());
  EXPECT_TRUE(fused_projections(xs, {plain.get(), sibling.get()}, /*any_device=*/true).has_value());
}

INSTANTIATE_TEST_SUITE_P(Kinds, QuantizedLinearKinds, ::testing::Values("nf4", "fp8"));

TEST(QuantizedModel, QuantizeLinearsKeepsTheHeadAndEqualsTheDequantizedModel) {
  auto plain = std::make_shared<models::CausalLM>(tiny());
  InitOptions io;
  io.seed = 9;
  init_parameters(*plain, io);
  auto q = std::make_shared<models::CausalLM>(tiny());
  {
    at::NoGradGuard ng;
    auto src = plain->named_parameters(true);
    for (auto& p : q->named_parameters(true)) p.value().copy_(src[p.key()]);
  }
  const auto paths = quantize_linears(*q, kind("nf4"));
  EXPECT_EQ(paths.size(), 14u);  // 7 projections x 2 layers; lm_head stays
  for (const auto& p : paths) EXPECT_EQ(p.find("lm_head"), std::string::npos);
  EXPECT_TRUE(q->named_parameters(true).contains("lm_head.weight"));
  EXPECT_FALSE(q->named_parameters(true).contains("model.layers.0.self_attn.q_proj.weight"));
  auto ref = dequantized_copy(*plain, *q);
  at::Tensor ids = at::randint(0, 64, {2, 7});
  at::Tensor lq = q->forward(ids), lr = ref->forward(ids);
  EXPECT_TRUE(at::allclose(lq, lr, 1e-6, 1e-6));
  EXPECT_GT((lq - plain->forward(ids)).abs().max().item<float>(), 1e-4);
  // skip_modules keeps more layers in full precision.
  auto q2 = std::make_shared<models::CausalLM>(tiny());
  QuantizeConfig skip = kind("fp8");
  skip.skip_modules = {"down_proj", "o_proj"};
  EXPECT_EQ(quantize_linears(*q2, skip).size(), 10u);

  // LoRA over it, then merged: the merged plain model computes the adapted one.
  LoraConfig cfg;
  cfg.r = 2;
  cfg.lora_alpha = 4;
  cfg.target_modules = {"q_proj", "v_proj", "up_proj"};
  apply_lora(*q, cfg, 1);
  for (const auto& item : q->named_modules("", false))
    if (auto l = std::dynamic_pointer_cast<LoraLinear>(item.value())) {
      at::NoGradGuard ng;
      l->lora_B->weight().normal_(0, 0.1);
      EXPECT_TRUE(l->quantized_base() != nullptr) << item.key();
    }
  at::Tensor adapted = q->forward(ids);
  EXPECT_GT((adapted - lq).abs().max().item<float>(), 1e-4);
  EXPECT_EQ(merge_lora(*q).size(), 6u);
  EXPECT_TRUE(q->named_parameters(true).contains("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(at::allclose(q->forward(ids), adapted, 1e-5, 1e-5));
}

TEST(QuantizedModel, InitGivesTheQuantizationOfThePlainInit) {
  auto plain = std::make_shared<models::CausalLM>(tiny());
  InitOptions io;
  io.seed = 11;
  init_parameters(*plain, io);
  auto q = std::make_shared<models::CausalLM>(tiny(), at::TensorOptions().device(at::kMeta));
  quantize_linears(*q, kind("nf4"));
  init_parameters(*q, io);
  EXPECT_GT(init_quantized_weights(*q, io, at::Device(at::kCPU)), 0);
  EXPECT_FALSE(has_meta_parameters(*q));
  auto want = plain->named_parameters(true);
  for (const auto& item : q->named_modules("", false))
    if (auto ql = std::dynamic_pointer_cast<QuantizedLinear>(item.value())) {
      at::Tensor w = want[item.key() + ".weight"];
      EXPECT_TRUE(at::equal(ql->dequantized_weight(at::kFloat), dequantize_nf4(quantize_nf4(w))))
          << item.key();
    }
}

TEST(QuantizedModel, LoadsStreamingFromAnHfFolderAndNamesWhatDoesNotFit) {
  tests::TempDir dir("qlora_load");
  auto plain = std::make_shared<models::CausalLM>(tiny());
  InitOptions io;
  io.seed = 12;
  init_parameters(*plain, io);
  checkpoint::save_pretrained(*plain, dir.path().string());
  checkpoint::PretrainedOptions po;
  po.quantize = kind("nf4");
  auto q = checkpoint::load_pretrained(dir.path().string(), po);
  EXPECT_FALSE(has_meta_parameters(*q));
  auto ref = dequantized_copy(*plain, *q);
  at::Tensor ids = at::randint(0, 64, {2, 5});
  EXPECT_TRUE(at::allclose(q->forward(ids), ref->forward(ids), 1e-6, 1e-6));
  // The same codes as quantizing the loaded plain model.
  auto q2 = std::make_shared<models::CausalLM>(tiny());
  {
    at::NoGradGuard ng;
    auto src = plain->named_parameters(true);
    for (auto& p : q2->named_parameters(true)) p.value().copy_(src[p.key()]);
  }
  quantize_linears(*q2, kind("nf4"));
  EXPECT_TRUE(at::equal(q2->forward(ids), q->forward(ids)));

  // A folder without one projection, or with one of another shape: named.
  auto tensors = checkpoint::load_state_dict(dir.path().string());
  checkpoint::TensorList less, wrong;
  for (const auto& [n, t] : tensors) {
    if (n != "model.layers.1.mlp.up_proj.weight") less.emplace_back(n, t.clone());
    wrong.emplace_back(n, n == "model.norm.weight" ? at::ones({7}) : t.clone());
  }
  checkpoint::save_state_dict(dir.path().string(), less);
  EXPECT_NE(error_of([&] {
              checkpoint::load_pretrained(dir.path().string(), po);
            }).find("missing: model.layers.1.mlp.up_proj.weight"),
            std::string::npos);
  checkpoint::save_state_dict(dir.path().string(), wrong);
  EXPECT_NE(error_of([&] {
              checkpoint::load_pretrained(dir.path().string(), po);
            }).find("wrong shape: model.norm.weight"),
            std::string::npos);
}

TEST(QuantizedModel, BadUseIsNamed) {
  QuantizeConfig bad = kind("int3");
  EXPECT_NE(error_of([&] { bad.validate(); }).find("kind 'int3' is not supported"),
            std::string::npos);
  QuantizeConfig odd = kind("nf4");
  odd.blocksize = 63;
  EXPECT_NE(error_of([&] { odd.validate(); }).find("blocksize"), std::string::npos);
  auto q = std::make_shared<QuantizedLinear>(LinearOptions(8, 4).bias(false), kind("nf4"));
  EXPECT_NE(error_of([&] {
              q->forward(at::randn({2, 8}));
            }).find("holds no weight"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              q->set_weight(at::randn({8, 4}));
            }).find("expected [4, 8]"),
            std::string::npos);
  q->set_weight(at::randn({4, 8}));
  EXPECT_NE(error_of([&] {
              q->shard(ShardSpec(ShardSpec::Kind::Column, 0, 2));
            }).find("tensor-parallel QLoRA is not supported"),
            std::string::npos);
}
