// The model on the GPU with the fused kernels (kernels/ layer: RMSNorm, rotary, concatenated
// q/k/v and gate/up GEMMs, packed SwiGLU; the fused cross-entropy's fp32 weight-gradient
// accumulation) against the same model with them switched off (ATen composites, separate
// projections): loss and every parameter gradient. And the seam that the fused paths must
// respect: projections of another kind (recording subclasses) put into a model on the GPU run
// their own forward even where the fused q/k/v and gate/up GEMMs would otherwise take them.
// Skipped without a GPU; runs on the H200 with the kernel tests (scripts/device_bench.sh ktests).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/adamw.h"
#include "colossal/kernels/attention.h"
#include "colossal/kernels/fp8.h"
#include "colossal/kernels/fused.h"
#include "colossal/kernels/quant.h"
#include "colossal/models/llama/config.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/fp8_linear.h"
#include "colossal/nn/init.h"
#include "colossal/nn/lora.h"
#include "colossal/nn/nf4.h"
#include "colossal/nn/quantized_linear.h"
#include "nn/recording_layers.h"

using namespace colossal;

namespace {

// The "tiny" preset on the current GPU, initialised by name from seed 3 (the same weights in every
// test), in fp32 or `dtype`.
std::shared_ptr<models::CausalLM> tiny_on_gpu(
    std::optional<at::ScalarType> dtype = std::nullopt,
    const models::ModelConfig& cfg = models::ModelConfig::preset("tiny")) {
  auto model = std::make_shared<models::CausalLM>(cfg, at::TensorOptions().device(at::kMeta));
  nn::InitOptions io;
  io.seed = 3;
  io.std = cfg.initializer_range;
  io.device = Accelerator::cuda().device();
  io.dtype = dtype;
  nn::init_parameters(*model, io);
  return model;
}

struct StepResult {
  double loss = 0;
  std::map<std::string, at::Tensor> grads;
};

StepResult run(at::ScalarType dtype, bool fused, int64_t batch) {
  kernels::set_enabled(fused);
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = tiny_on_gpu();
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

// After a launch that a hung wait stopped (our attention kernels trap instead of hanging), say
// which wait.
class HangReport : public ::testing::Environment {
 public:
  void TearDown() override {
    const std::string hang = kernels::attention_hang_report();
    if (!hang.empty()) ADD_FAILURE() << hang;
  }
};
const auto* const hang_report = ::testing::AddGlobalTestEnvironment(new HangReport);

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

// On the GPU the plain projections are fused (q/k/v in one GEMM, gate/up in one GEMM with the
// packed SwiGLU). A projection of another kind must never be swallowed by that GEMM: with one
// projection of each group replaced, the replaced ones run their own forward, their plain
// siblings fall back to their own forwards too, and the model computes the same function.
TEST(ModelCuda, ReplacedProjectionsRunTheirOwnForwardUnderFusion) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kernels::enabled());
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = tiny_on_gpu(at::kBFloat16);
  at::manual_seed(4);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 64}, at::kLong).to(dev);
  at::Tensor fused = model->forward(ids).to(at::kFloat);
  ASSERT_TRUE(model->model->layers->layers[0]->self_attn->k_proj->fusable());
  auto k = colossal::testing::record_linear(*model, "model.layers.0.self_attn.k_proj");
  auto up = colossal::testing::record_linear(*model, "model.layers.0.mlp.up_proj");
  at::Tensor replaced = model->forward(ids).to(at::kFloat);
  EXPECT_EQ(k->calls, 1);
  EXPECT_EQ(up->calls, 1);
  // bf16: the fused and separate GEMMs round at different points (3 % of the scale, as above).
  const double scale = fused.abs().max().item<double>();
  EXPECT_LE((replaced - fused).abs().max().item<double>(), 3e-2 * scale);
  // Backward through the replaced layers reaches their (shared) parameters.
  model->forward_loss(ids, at::constant_pad_nd(ids.narrow(1, 1, 63), {0, 1}, -100)).backward();
  EXPECT_TRUE(k->weight().grad().defined());
  EXPECT_TRUE(up->weight().grad().defined());
}

// Packed documents (--doc_mask) on the GPU in bf16 take the variable-length flash kernel: the
// logits of each document and the parameter gradients of a summed loss equal those of each
// document run alone (plain SDPA, is_causal). Documents of 1..70 tokens, some rows one document.
// bf16: the two kernels and the GEMMs of different row counts round at different points; 3 % of
// the scale as above (logits), and 3 % of each gradient's norm.
TEST(ModelCuda, PackedDocumentsTakeTheVariableLengthKernel) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = tiny_on_gpu(at::kBFloat16);
  const int64_t S = 128;
  const std::vector<std::vector<int64_t>> lens{{40, 1, 70, 17}, {128}, {64, 64}};
  const int64_t B = static_cast<int64_t>(lens.size());
  at::manual_seed(9);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {B, S}, at::kLong);
  at::Tensor targets = at::randint(0, cfg.vocab_size, {B, S}, at::kLong);
  at::Tensor doc = at::empty({B, S}, at::kLong), pos = at::empty({B, S}, at::kLong);
  for (int64_t r = 0; r < B; ++r) {
    int64_t j = 0;
    for (size_t d = 0; d < lens[r].size(); ++d)
      for (int64_t i = 0; i < lens[r][d]; ++i, ++j)
        doc[r][j] = static_cast<int64_t>(d), pos[r][j] = i;
  }
  // The kernel choice itself.
  nn::AttentionMask am;
  am.documents = nn::make_documents(doc, dev);
  EXPECT_TRUE(nn::varlen_attention_applies(
      at::empty({B, 4, S, 64}, at::TensorOptions().device(dev).dtype(at::kBFloat16)), am));
  EXPECT_FALSE(
      nn::varlen_attention_applies(at::empty({B, 4, S, 64}, at::TensorOptions().device(dev)), am));

  models::ForwardOptions fo;
  fo.document_ids = doc;
  fo.position_ids = pos.to(dev);
  at::Tensor packed = model->forward(ids.to(dev), fo).to(at::kFloat);
  fo.loss_divisor = 100.0;
  model->zero_grad();
  model->forward_loss(ids.to(dev), targets.to(dev), 64, fo).backward();
  std::vector<at::Tensor> packed_grads;
  for (auto& p : model->parameters()) packed_grads.push_back(p.grad().to(at::kFloat).clone());
  model->zero_grad();
  const double scale = packed.abs().max().item<double>();
  for (int64_t r = 0; r < B; ++r) {
    int64_t j = 0;
    for (int64_t len : lens[r]) {
      at::Tensor in = ids[r].narrow(0, j, len).unsqueeze(0).to(dev);
      at::Tensor alone = model->forward(in).to(at::kFloat);
      EXPECT_LE((packed[r].narrow(0, j, len) - alone[0]).abs().max().item<double>(), 3e-2 * scale)
          << "row " << r << " document at " << j;
      models::ForwardOptions so;
      so.loss_divisor = 100.0;
      model->forward_loss(in, targets[r].narrow(0, j, len).unsqueeze(0).to(dev), 64, so).backward();
      j += len;
    }
  }
  size_t i = 0;
  for (auto& p : model->parameters()) {
    at::Tensor g = p.grad().to(at::kFloat);
    EXPECT_LE((packed_grads[i] - g).norm().item<double>(), 3e-2 * g.norm().item<double>() + 1e-6)
        << "parameter " << i;
    ++i;
  }
}

// LoRA adapters on the q/k/v and gate/up projections, which the fused kernels would otherwise
// compute as one concatenated GEMM each: with the fused kernels on, the adapted model computes
// what it computes with them off (every projection's own forward), and that differs from the
// base model by the adapters' contribution. fp32: the paths differ only by kernel rounding.
TEST(ModelCuda, LoraProjectionsAreNeverFusedAway) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = tiny_on_gpu();
  at::manual_seed(4);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 64}, at::kLong).to(dev);
  kernels::set_enabled(true);
  at::Tensor base = model->forward(ids);
  nn::LoraConfig lc;
  lc.r = 4;
  lc.target_modules = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"};
  nn::apply_lora(*model, lc, 1);
  for (const auto& p : model->named_parameters())
    if (p.key().find(".lora_B") != std::string::npos)
      p.value().set_data(at::randn_like(p.value()) * 0.05);
  at::Tensor fused = model->forward(ids);
  kernels::set_enabled(false);
  at::Tensor plain = model->forward(ids);
  kernels::set_enabled(true);
  const double scale = plain.abs().max().item<double>();
  EXPECT_LE((fused - plain).abs().max().item<double>(), 1e-4 * scale);
  EXPECT_GT((fused - base).abs().max().item<double>(), 1e-3 * scale);
}

// QLoRA's dequantisation kernels (kernels/quant.h) against the ATen reference on the same GPU
// storage, bit for bit: NF4 with and without double quantisation, block sizes 64 and 128, the
// 16-byte path and the scalar one (an odd count, a partial block), every output dtype; FP8 rows.
TEST(ModelCuda, DequantizationKernelsEqualTheReference) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  at::manual_seed(6);
  const std::vector<std::vector<int64_t>> shapes{{96, 160}, {7, 37}, {300, 256}, {4096, 1024}};
  for (const auto& shape : shapes) {
    at::Tensor w = (at::randn(shape) * 0.05).to(dev);
    for (int64_t bs : {64, 128})
      for (bool dq : {true, false}) {
        nn::NF4Tensor q = nn::quantize_nf4(w, bs, dq);
        for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
          at::Tensor k = nn::dequantize_nf4(q, dt), r = nn::dequantize_nf4_reference(q, dt);
          ASSERT_EQ(k.scalar_type(), dt);
          EXPECT_TRUE(at::equal(k, r)) << "nf4 " << shape[0] << "x" << shape[1] << " blocksize "
                                       << bs << " double " << dq << " " << dt;
        }
      }
    nn::QuantizeConfig fp8;
    fp8.kind = "fp8";
    nn::QuantizedLinear ql(nn::LinearOptions(shape[1], shape[0]).bias(false), fp8);
    ql.set_weight(w);
    // Quantizing on the GPU stores what quantizing on the CPU stores (scales and codes).
    nn::QuantizedLinear cpu(nn::LinearOptions(shape[1], shape[0]).bias(false), fp8);
    cpu.set_weight(w.cpu());
    const auto [gcodes, gscale] = ql.fp8_storage();
    const auto [ccodes, cscale] = cpu.fp8_storage();
    EXPECT_TRUE(at::equal(gscale.cpu(), cscale)) << "fp8 scales of " << shape[0] << "x" << shape[1];
    EXPECT_TRUE(at::equal(gcodes.cpu().view(at::kByte), ccodes.view(at::kByte)))
        << "fp8 codes of " << shape[0] << "x" << shape[1];
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      // The layer's storage through the kernel, and the reference on the same storage.
      at::Tensor k = ql.dequantized_weight(dt);
      EXPECT_TRUE(at::equal(k, kernels::dequantize_fp8_rows_reference(gcodes, gscale, dt)))
          << "fp8 kernel " << shape[0] << "x" << shape[1] << " " << dt;
      EXPECT_TRUE(at::equal(k.cpu(), cpu.dequantized_weight(dt)))
          << "fp8 across devices " << shape[0] << "x" << shape[1] << " " << dt;
    }
  }
}

// A QLoRA model on the GPU: quantized bases (nf4) with adapters on q/k/v and gate/up compute the
// same with the fused kernels on and off, equal the plain model holding the dequantized weights,
// and differ from the unquantized base: neither the quantized layer nor its adapter is fused away.
TEST(ModelCuda, QuantizedBasesUnderLoraAreNeverFusedAway) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = tiny_on_gpu(), plain = tiny_on_gpu(), original = tiny_on_gpu();
  at::manual_seed(4);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 64}, at::kLong).to(dev);
  kernels::set_enabled(true);
  at::Tensor unquantized = original->forward(ids);
  nn::QuantizeConfig qc;
  nn::quantize_linears(*model, qc);
  {
    at::NoGradGuard ng;
    for (const auto& item : model->named_modules("", false))
      if (auto q = std::dynamic_pointer_cast<nn::QuantizedLinear>(item.value()))
        plain->named_parameters(true)[item.key() + ".weight"].copy_(
            q->dequantized_weight(at::kFloat));
  }
  nn::LoraConfig lc;
  lc.r = 4;
  lc.target_modules = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"};
  nn::apply_lora(*model, lc, 1);
  nn::apply_lora(*plain, lc, 1);
  {
    at::NoGradGuard ng;
    auto pp = plain->named_parameters(true);
    for (const auto& p : model->named_parameters())
      if (p.key().find(".lora_B") != std::string::npos) {
        p.value().copy_(at::randn_like(p.value()) * 0.05);
        pp[p.key()].copy_(p.value());
      }
  }
  at::Tensor fused = model->forward(ids);
  at::Tensor reference = plain->forward(ids);
  kernels::set_enabled(false);
  at::Tensor composite = model->forward(ids);
  kernels::set_enabled(true);
  const double scale = composite.abs().max().item<double>();
  EXPECT_LE((fused - composite).abs().max().item<double>(), 1e-4 * scale);
  EXPECT_LE((fused - reference).abs().max().item<double>(), 1e-4 * scale);
  EXPECT_GT((fused - unquantized).abs().max().item<double>(), 1e-3 * scale);
}

namespace {
// Freed caching-allocator blocks filled with NaN bytes, so outputs allocated next that a kernel
// leaves unwritten differ from the reference.
void poison_gpu(const at::Device& dev) {
  std::vector<at::Tensor> keep;
  for (int i = 0; i < 32; ++i)
    keep.push_back(at::full({1 << 18}, NAN, at::TensorOptions().device(dev)));
  keep.push_back(at::full({int64_t(1) << 25}, NAN, at::TensorOptions().device(dev)));
  Accelerator::cuda().synchronize();
}
}  // namespace

// FP8 casts (kernels/fp8.h): our kernels against the ATen reference on the same GPU tensor, bit
// for bit (data, transpose, inverse scales), both formats, per tensor and per row, every input
// dtype, tile-aligned and ragged shapes, outputs over NaN-poisoned memory.
TEST(ModelCuda, Fp8CastKernelsEqualTheReference) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  at::manual_seed(8);
  // The wide kernel (sizes multiples of 8): whole tiles, partial tiles (200 x 136), one small
  // tile (8 x 8), a single row without transpose (1 x 16, rowwise); the tile kernel otherwise.
  const std::vector<std::vector<int64_t>> shapes{{4096, 1024}, {200, 136}, {8, 8},
                                                 {77, 130},    {1, 16},    {33, 2049}};
  for (const auto& shape : shapes)
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      at::Tensor x = (at::randn(shape) * 3).to(dt).to(dev);
      for (auto fmt : {at::kFloat8_e4m3fn, at::kFloat8_e5m2})
        for (bool rowwise : {false, true}) {
          poison_gpu(dev);
          kernels::Fp8Tensor k = kernels::cast_to_fp8(x, fmt, rowwise, !rowwise);
          kernels::Fp8Tensor r = kernels::cast_to_fp8_reference(x, fmt, rowwise, !rowwise);
          const std::string what = std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + " " +
                                   c10::toString(dt) + " " + c10::toString(fmt) +
                                   (rowwise ? " rowwise" : " tensorwise");
          EXPECT_TRUE(at::equal(k.data.view(at::kByte), r.data.view(at::kByte))) << what;
          EXPECT_TRUE(at::equal(k.inv_scale.reshape(-1), r.inv_scale.reshape(-1))) << what;
          if (!rowwise) {
            EXPECT_TRUE(at::equal(k.data_t.view(at::kByte), r.data_t.view(at::kByte))) << what;
          }
        }
    }
}

// The cast of several tensors as their row concatenation (a fused FP8 projection group's
// weights) against at::cat then the reference, bit for bit: the wide kernel's parts (sizes and
// offsets multiples of 8, the transpose's row stride the total), the tile kernel's (odd columns).
TEST(ModelCuda, Fp8ConcatCastEqualsTheCastOfTheConcatenation) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  at::manual_seed(12);
  const std::vector<std::vector<std::vector<int64_t>>> groups{
      {{64, 256}, {16, 256}, {16, 256}}, {{24, 40}, {8, 40}}, {{5, 36}, {7, 36}, {1, 36}}};
  for (const auto& group : groups)
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      std::vector<at::Tensor> xs;
      for (const auto& shape : group) xs.push_back((at::randn(shape) * 2).to(dt).to(dev));
      for (auto fmt : {at::kFloat8_e4m3fn, at::kFloat8_e5m2})
        for (bool t : {true, false}) {
          poison_gpu(dev);
          kernels::Fp8Tensor k = kernels::cast_to_fp8_concat(xs, fmt, t);
          kernels::Fp8Tensor r = kernels::cast_to_fp8_concat_reference(xs, fmt, t);
          const std::string what = std::to_string(group.size()) + " parts of " +
                                   std::to_string(group[0][1]) + " columns " + c10::toString(dt) +
                                   " " + c10::toString(fmt) + (t ? " transposed" : "");
          EXPECT_TRUE(at::equal(k.data.view(at::kByte), r.data.view(at::kByte))) << what;
          EXPECT_TRUE(at::equal(k.inv_scale.reshape(-1), r.inv_scale.reshape(-1))) << what;
          if (t) {
            EXPECT_TRUE(at::equal(k.data_t.view(at::kByte), r.data_t.view(at::kByte))) << what;
          }
        }
    }
}

// The FP8 layer on CUDA (at::_scaled_mm over our casts) against its CPU emulation on the same
// bf16 tensors: the casts are bitwise the same (above), so only the GEMMs' accumulation order
// and the bf16 rounding of their outputs differ: 4e-3 norm-wise (bf16's half ulp is 2^-9 = 2e-3).
TEST(ModelCuda, Fp8LinearEqualsItsEmulation) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  for (const std::string recipe : {"tensorwise", "rowwise"}) {
    at::manual_seed(9);
    auto make = [&](const at::Device& d) {
      auto base =
          std::make_shared<nn::Linear>(nn::LinearOptions(1024, 512).bias(false).tensor_options(
              at::TensorOptions().dtype(at::kBFloat16).device(d)));
      return base;
    };
    auto gbase = make(dev), cbase = make(at::Device(at::kCPU));
    at::Tensor w = (at::randn({512, 1024}) * 0.03).to(at::kBFloat16);
    gbase->weight().set_data(w.to(dev));
    cbase->weight().set_data(w.clone());
    nn::Fp8Config cfg;
    cfg.recipe = recipe;
    nn::Fp8Linear g(*gbase, cfg), c(*cbase, cfg);
    at::Tensor x = at::randn({4, 256, 1024}).to(at::kBFloat16);
    at::Tensor dy = at::randn({4, 256, 512}).to(at::kBFloat16);
    at::Tensor xg = x.to(dev).requires_grad_(), xc = x.clone().requires_grad_();
    at::Tensor yg = g.forward(xg), yc = c.forward(xc);
    yg.backward(dy.to(dev));
    yc.backward(dy);
    auto nrel = [](const at::Tensor& a, const at::Tensor& b) {
      return ((a.cpu().to(at::kFloat) - b.to(at::kFloat)).norm() / b.to(at::kFloat).norm())
          .item<double>();
    };
    EXPECT_LE(nrel(yg, yc), 4e-3) << recipe;
    EXPECT_LE(nrel(xg.grad(), xc.grad()), 4e-3) << recipe;
    EXPECT_LE(nrel(g.weight().grad(), c.weight().grad()), 4e-3) << recipe;
    std::printf("fp8 %s: CUDA vs emulation y %.2e dx %.2e dW %.2e\n", recipe.c_str(), nrel(yg, yc),
                nrel(xg.grad(), xc.grad()), nrel(g.weight().grad(), c.weight().grad()));
  }
}

// A bf16 model with FP8 layers on the GPU: the same with the fused kernels on and off (RMSNorm,
// rotary, SwiGLU and the loss still fused around the FP8 GEMMs), different from the plain bf16
// model (no fused path bypasses an FP8 layer), and each weight cast once per form (group or layer).
TEST(ModelCuda, Fp8LayersAreNeverFusedAway) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  const at::Device dev = Accelerator::cuda().device();
  auto model = tiny_on_gpu(at::kBFloat16), plain = tiny_on_gpu(at::kBFloat16);
  nn::convert_to_fp8(*model, nn::Fp8Config{}, dev);
  at::manual_seed(4);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 64}, at::kLong).to(dev);
  auto q = std::dynamic_pointer_cast<nn::Fp8Linear>(
      nn::find_module(*model, "model.layers.0.self_attn.q_proj"));
  ASSERT_TRUE(q);
  kernels::set_enabled(true);
  at::Tensor fused = model->forward(ids).to(at::kFloat);
  // The fused q/k/v group cast q's weight once (as a part of the group's concatenation); a second
  // forward with unchanged weights (the next micro-batch) reuses it.
  EXPECT_EQ(q->weight_casts(), 1);
  model->forward(ids);
  EXPECT_EQ(q->weight_casts(), 1);
  at::Tensor bf16 = plain->forward(ids).to(at::kFloat);
  kernels::set_enabled(false);
  at::Tensor composite = model->forward(ids).to(at::kFloat);
  // Unfused, the layer casts its own weight with its own scale: one more cast, once.
  EXPECT_EQ(q->weight_casts(), 2);
  model->forward(ids);
  EXPECT_EQ(q->weight_casts(), 2);
  kernels::set_enabled(true);
  const double scale = composite.abs().max().item<double>();
  // Fused, q/k/v and gate/up run as one FP8 GEMM each with one weight scale per group
  // (nn::fp8_fused_projections), unfused one scale per layer: two FP8 roundings of one model,
  // each within FP8's error of the bf16 one, so their gap is bounded by the sum of those errors.
  const double fp8_err = (composite - bf16).abs().max().item<double>();
  EXPECT_LE((fused - composite).abs().max().item<double>(), 3e-2 * scale + 2 * fp8_err);
  EXPECT_GT((fused - bf16).abs().max().item<double>(), 1e-3 * scale);
}

// --attn_backend own on the GPU: OwnAttention in every core-attention slot serves every layer of
// a bf16 model with our kernels (no call handed to SDPA on sm_90), dense and with packed
// documents, and gives SDPA's logits and gradients within bf16's error: two bf16 attention
// kernels with different summation orders, 3e-2 of the largest logit (as the variable-length
// test above) and 5e-2 norm-wise for the gradients. Skipped where the kernels do not run.
TEST(ModelCuda, OwnAttentionServesEveryLayer) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  at::Tensor probe = at::empty({1, 1, 64}, at::TensorOptions().dtype(at::kBFloat16).device(dev));
  const std::string why = kernels::own_attention_unsupported(probe, probe);
  if (!why.empty()) GTEST_SKIP() << why;
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  cfg.num_attention_heads = 4;
  cfg.head_dim = 64;            // our kernels' head dims are 64 and 128
  cfg.num_key_value_heads = 1;  // MQA: every query head reads the one kv head in place
  auto sdpa = tiny_on_gpu(at::kBFloat16, cfg), own = tiny_on_gpu(at::kBFloat16, cfg);
  const auto [attn, slots] = nn::use_own_attention(*own, false);
  EXPECT_EQ(slots, cfg.num_hidden_layers);
  const int64_t B = 2, S = 200;
  at::manual_seed(12);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {B, S}, at::kLong).to(dev);
  at::Tensor targets = at::randint(0, cfg.vocab_size, {B, S}, at::kLong).to(dev);
  at::Tensor doc = at::zeros({B, S}, at::kLong);
  doc[0].narrow(0, 77, S - 77).fill_(1);
  doc[1].narrow(0, 1, S - 1).fill_(1);  // a document of one token
  for (bool documents : {false, true}) {
    SCOPED_TRACE(documents ? "packed documents" : "dense");
    models::ForwardOptions fo;
    if (documents) fo.document_ids = doc;
    at::Tensor a = sdpa->forward(ids, fo).to(at::kFloat), b = own->forward(ids, fo).to(at::kFloat);
    EXPECT_LE((a - b).abs().max().item<double>(), 3e-2 * a.abs().max().item<double>());
    sdpa->zero_grad();
    own->zero_grad();
    sdpa->forward_loss(ids, targets, 64, fo).backward();
    own->forward_loss(ids, targets, 64, fo).backward();
    auto pa = sdpa->named_parameters(), pb = own->named_parameters();
    for (const auto& item : pa) {
      const at::Tensor ga = item.value().grad().to(at::kFloat);
      const at::Tensor gb = pb[item.key()].grad().to(at::kFloat);
      EXPECT_LE(((ga - gb).norm() / ga.norm().clamp_min(1e-12)).item<double>(), 5e-2) << item.key();
    }
  }
  EXPECT_EQ(attn->fallback_calls(), 0) << attn->fallback_reason();
  EXPECT_EQ(attn->own_calls(), 4 * cfg.num_hidden_layers);
}

// FP8 known amaxes on the GPU: the SwiGLU kernels' recorded amax is exactly max |stored value| of
// their output and input gradients (separate and packed), the optimizer kernel's that of the
// working weights it writes, and an FP8 model gives bit for bit the
// same logits and gradients with recording on (its casts take the recorded amaxes) and off.
TEST(ModelCuda, KernelsRecordTheAmaxOfWhatTheyStore) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  auto bf = at::TensorOptions().dtype(at::kBFloat16).device(dev);
  kernels::set_fp8_amax_capture(true);
  at::manual_seed(21);
  auto amax_of = [](const at::Tensor& t) { return t.abs().max().to(at::kFloat).item<float>(); };
  for (int64_t cols : {4096, 1000}) {  // vectorised and not
    at::Tensor g = at::randn({37, cols}, bf).requires_grad_(),
               u = at::randn({37, cols}, bf).requires_grad_();
    at::Tensor y = kernels::swiglu(g, u);
    ASSERT_TRUE(kernels::known_fp8_amax(y).defined());
    EXPECT_EQ(kernels::known_fp8_amax(y).item<float>(), amax_of(y));
    y.backward(at::randn_like(y) * 3);
    EXPECT_EQ(kernels::known_fp8_amax(g.grad()).item<float>(), amax_of(g.grad()));
    EXPECT_EQ(kernels::known_fp8_amax(u.grad()).item<float>(), amax_of(u.grad()));
    at::Tensor gu = at::randn({37, 2 * cols}, bf).requires_grad_();
    at::Tensor yp = kernels::swiglu_packed(gu);
    EXPECT_EQ(kernels::known_fp8_amax(yp).item<float>(), amax_of(yp));
    yp.backward(at::randn_like(yp));
    EXPECT_EQ(kernels::known_fp8_amax(gu.grad()).item<float>(), amax_of(gu.grad()));
  }
  // The optimizer kernel: the amax of each working weight it writes (vectorised and not).
  {
    std::vector<at::Tensor> p, g, m, v, w;
    for (int64_t n : {4096 * 9, 1001}) {
      p.push_back(at::randn({n}, bf.dtype(at::kFloat)));
      g.push_back(at::randn({n}, bf));
      m.push_back(at::zeros({n}, bf.dtype(at::kFloat)));
      v.push_back(at::zeros({n}, bf.dtype(at::kFloat)));
      w.push_back(at::empty({n}, bf));
    }
    kernels::AdamWStep hy;
    kernels::fused_adamw(p, g, m, v, w, hy);
    for (const at::Tensor& t : w) EXPECT_EQ(kernels::known_fp8_amax(t).item<float>(), amax_of(t));
  }
  auto model = tiny_on_gpu(at::kBFloat16);
  nn::convert_to_fp8(*model, nn::Fp8Config{}, dev);
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 64}, at::kLong).to(dev);
  at::Tensor targets = at::randint(0, cfg.vocab_size, {2, 64}, at::kLong).to(dev);
  auto run = [&](bool capture) {
    kernels::set_fp8_amax_capture(capture);
    model->zero_grad();
    std::vector<at::Tensor> out{model->forward(ids).detach().clone()};
    model->forward_loss(ids, targets, 64).backward();
    for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto off = run(false);
  const int64_t uses = kernels::fp8_known_amax_uses();
  const auto on = run(true);
  EXPECT_GE(kernels::fp8_known_amax_uses() - uses, 2 * cfg.num_hidden_layers);
  for (size_t i = 0; i < on.size(); ++i) EXPECT_TRUE(at::equal(on[i], off[i])) << "tensor " << i;
}
