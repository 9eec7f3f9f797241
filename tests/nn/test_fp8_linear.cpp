// FP8 linear layers on the CPU (nn/fp8_linear.h, kernels/fp8.h): the emulation path that runs the
// same casts and scaling logic as the CUDA one. The casts: amax maps to the format's largest
// value, every value within the format's rounding of x, the transpose is the data's transpose.
// The layer: forward and both gradients against an fp64 reference within the bound that the
// quantization of each operand gives (stated below); the weight cast once per weight version
// and optimizer step; the conversion of a model (excluded paths stay plain); named errors.
// The CUDA kernels and _scaled_mm against this emulation: tests/kernels/test_model_cuda.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/core/weights_epoch.h"
#include "colossal/kernels/adamw.h"
#include "colossal/kernels/fp8.h"
#include "colossal/kernels/swiglu.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/fp8_linear.h"
#include "colossal/nn/init.h"
#include "common/error_of.h"
#include "common/tiny_llama.h"

using namespace colossal;
using colossal::tests::error_of;
using namespace colossal::nn;

namespace {

// The largest rounding error of the cast of x (fp64, x's scale) element by element: relative
// half a unit in the last place for normal values (e4m3: 3 mantissa bits, 2^-4; e5m2: 2^-3),
// absolute half the subnormal spacing below the smallest normal (e4m3: 2^-10; e5m2: 2^-17), in
// the scaled domain, so divided by the scale, i.e. times inv_scale.
at::Tensor cast_error_bound(const at::Tensor& x, const at::Tensor& inv_scale, bool e5m2) {
  const double rel = e5m2 ? 0.125 : 0.0625,
               sub = e5m2 ? std::ldexp(1.0, -17) : std::ldexp(1.0, -10);
  at::Tensor a = x.to(at::kDouble).abs() * rel;
  at::Tensor b = inv_scale.to(at::kDouble) * sub;
  return at::maximum(a, b.expand_as(a)) * (1 + 1e-6);
}

// |a b^T - (a~ b~^T)| <= |a| eb^T + ea |b|^T + ea eb^T elementwise (ea, eb: the operands' cast
// error bounds), plus fp32 accumulation: 1e-5 of sum |a||b|.
at::Tensor product_bound(const at::Tensor& a, const at::Tensor& ea, const at::Tensor& b,
                         const at::Tensor& eb) {
  at::Tensor aa = a.to(at::kDouble).abs(), bb = b.to(at::kDouble).abs();
  return at::mm(aa, eb.t()) + at::mm(ea, bb.t()) + at::mm(ea, eb.t()) + 1e-5 * at::mm(aa, bb.t());
}

}  // namespace

TEST(Fp8Cast, ScalesValuesAndTransposeFollowTheFormat) {
  at::manual_seed(2);
  at::Tensor x = at::randn({48, 80}) * 3;
  x[5][7] = 0.0;
  for (auto fmt : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    const bool e5m2 = fmt == at::kFloat8_e5m2;
    const double m = kernels::fp8_max(fmt);
    for (bool rowwise : {false, true}) {
      kernels::Fp8Tensor q = kernels::cast_to_fp8(x, fmt, rowwise, !rowwise);
      ASSERT_EQ(q.data.scalar_type(), fmt);
      at::Tensor deq = q.data.to(at::kFloat) * q.inv_scale;
      // amax lands on the largest value: per tensor, or in every row.
      at::Tensor top =
          rowwise ? q.data.to(at::kFloat).abs().amax(1) : q.data.to(at::kFloat).abs().amax();
      EXPECT_TRUE(at::allclose(top, at::full_like(top, m))) << fmt << " rowwise " << rowwise;
      EXPECT_TRUE(((deq.to(at::kDouble) - x.to(at::kDouble)).abs() <=
                   cast_error_bound(x, q.inv_scale, e5m2))
                      .all()
                      .item<bool>())
          << fmt << " rowwise " << rowwise;
      EXPECT_EQ(deq[5][7].item<float>(), 0.0f);
      if (!rowwise) {
        EXPECT_EQ(q.inv_scale.numel(), 1);
        EXPECT_TRUE(at::equal(q.data_t.to(at::kFloat), q.data.t().to(at::kFloat)));
      } else {
        EXPECT_EQ(q.inv_scale.sizes(), (std::vector<int64_t>{48, 1}));
      }
    }
  }
  // A zero tensor: zeros and a finite scale.
  kernels::Fp8Tensor z =
      kernels::cast_to_fp8(at::zeros({16, 16}), at::kFloat8_e4m3fn, false, false);
  EXPECT_EQ(z.data.to(at::kFloat).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(std::isfinite(z.inv_scale.item<float>()));
  EXPECT_NE(error_of([&] {
              kernels::cast_to_fp8(x, at::kFloat8_e4m3fn, true, true);
            }).find("rowwise cast has no transpose"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              kernels::cast_to_fp8(x, at::kHalf, false, false);
            }).find("is not an FP8 format"),
            std::string::npos);
}

class Fp8Recipes : public ::testing::TestWithParam<std::string> {};

TEST_P(Fp8Recipes, LayerIsWithinTheQuantizationBoundOfFp64) {
  at::manual_seed(3);
  const int64_t M = 64, K = 96, N = 48;
  Linear base(LinearOptions(K, N).bias(false));
  base.weight().set_data(at::randn({N, K}) * 0.05);
  Fp8Config cfg;
  cfg.recipe = GetParam();
  Fp8Linear layer(base, cfg);
  EXPECT_EQ(layer.weight().data_ptr(), base.weight().data_ptr());  // shared
  const bool rowwise = GetParam() == "rowwise";
  at::Tensor x = (at::randn({2, M / 2, K}) * 2).requires_grad_();
  at::Tensor y = layer.forward(x);
  at::Tensor dy = at::randn({2, M / 2, N});
  y.backward(dy);
  const at::Tensor x2 = x.detach().reshape({M, K}), w = base.weight().detach();
  const at::Tensor dy2 = dy.reshape({M, N});
  // Forward: x and W in e4m3.
  kernels::Fp8Tensor xq = kernels::cast_to_fp8(x2, at::kFloat8_e4m3fn, rowwise, false);
  kernels::Fp8Tensor wq = kernels::cast_to_fp8(w, at::kFloat8_e4m3fn, rowwise, false);
  at::Tensor ex = cast_error_bound(x2, xq.inv_scale, false);
  at::Tensor ew = cast_error_bound(w, wq.inv_scale, false);
  at::Tensor y64 = at::mm(x2.to(at::kDouble), w.to(at::kDouble).t());
  EXPECT_TRUE(
      ((y.detach().reshape({M, N}).to(at::kDouble) - y64).abs() <= product_bound(x2, ex, w, ew))
          .all()
          .item<bool>());
  // Not the unquantized product: FP8 is really used.
  EXPECT_GT((y.detach().reshape({M, N}).to(at::kDouble) - y64).abs().max().item<double>(), 1e-4);
  // dx = dy W: dy in e5m2 (tensorwise) or e4m3 (rowwise); W as above (rowwise: cast along K).
  kernels::Fp8Tensor dq =
      kernels::cast_to_fp8(dy2, rowwise ? at::kFloat8_e4m3fn : at::kFloat8_e5m2, rowwise, false);
  at::Tensor edy = cast_error_bound(dy2, dq.inv_scale, !rowwise);
  at::Tensor wt = w.t().contiguous();
  at::Tensor ewt =
      rowwise ? cast_error_bound(
                    wt, kernels::cast_to_fp8(wt, at::kFloat8_e4m3fn, true, false).inv_scale, false)
              : ew.t();
  at::Tensor dx64 = at::mm(dy2.to(at::kDouble), w.to(at::kDouble));
  EXPECT_TRUE(
      ((x.grad().reshape({M, K}).to(at::kDouble) - dx64).abs() <= product_bound(dy2, edy, wt, ewt))
          .all()
          .item<bool>());
  // dW = dy^T x: in FP8 (tensorwise: dy e5m2 and x e4m3, both transposed) or in fp32 (rowwise).
  at::Tensor dw64 = at::mm(dy2.to(at::kDouble).t(), x2.to(at::kDouble));
  at::Tensor dw_bound =
      rowwise ? 1e-5 * at::mm(dy2.to(at::kDouble).abs().t(), x2.to(at::kDouble).abs())
              : product_bound(dy2.t().contiguous(), edy.t(), x2.t().contiguous(), ex.t());
  EXPECT_TRUE(
      ((layer.weight().grad().to(at::kDouble) - dw64).abs() <= dw_bound).all().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8Recipes, ::testing::Values("tensorwise", "rowwise"));

TEST(Fp8Linear, TheWeightIsCastOncePerUpdate) {
  Linear base(LinearOptions(32, 16).bias(true));
  base.weight().set_data(at::randn({16, 32}));
  base.param("bias").set_data(at::randn({16}));
  Fp8Linear layer(base, Fp8Config{});
  at::Tensor x = at::randn({16, 32});
  at::Tensor y1 = layer.forward(x);
  layer.forward(x);
  layer.forward(x);
  EXPECT_EQ(layer.weight_casts(), 1);  // micro-batches of one step share the cast
  bump_weights_epoch();                // an optimizer step
  layer.forward(x);
  EXPECT_EQ(layer.weight_casts(), 2);
  {
    at::NoGradGuard ng;
    base.weight().mul_(2);  // an in-place update seen by the version counter
  }
  at::Tensor y3 = layer.forward(x);
  EXPECT_EQ(layer.weight_casts(), 3);
  // Doubling W doubles the weight's inverse scale and leaves its codes: y - b doubles exactly.
  EXPECT_TRUE(at::allclose(y3 - base.param("bias"), (y1 - base.param("bias")) * 2, 1e-6, 1e-6));
  // Without keeping them, every forward casts (and the same values come out).
  Fp8Config dropping;
  dropping.keep_weight_casts = false;
  Fp8Linear fresh(base, dropping);
  EXPECT_TRUE(at::equal(fresh.forward(x), y3));
  fresh.forward(x);
  EXPECT_EQ(fresh.weight_casts(), 2);
}

// q, k and v read one input: its cast is made once and shared while the layers' saved tensors
// hold it; an in-place change of the input, or a forward that saves nothing, casts afresh. The
// shared cast gives the same outputs and gradients as separate ones.
TEST(Fp8Linear, LayersReadingOneInputShareItsCast) {
  std::vector<std::shared_ptr<Fp8Linear>> layers;
  for (int i = 0; i < 3; ++i) {
    Linear base(LinearOptions(32, 16).bias(false));
    base.weight().set_data(at::randn({16, 32}));
    layers.push_back(std::make_shared<Fp8Linear>(base, Fp8Config{}));
  }
  at::Tensor x = at::randn({16, 32}).requires_grad_();
  const int64_t n0 = Fp8Linear::activation_casts();
  std::vector<at::Tensor> ys;
  for (auto& l : layers) ys.push_back(l->forward(x));
  EXPECT_EQ(Fp8Linear::activation_casts(), n0 + 1);
  (ys[0].sum() + ys[1].pow(2).sum() + ys[2].sum()).backward();
  // Separately: each layer on its own copy of x (another storage: its own cast).
  at::Tensor gx = at::zeros_like(x);
  for (int i = 0; i < 3; ++i) {
    at::Tensor xi = x.detach().clone().requires_grad_();
    at::Tensor yi = layers[i]->forward(xi);
    EXPECT_TRUE(at::equal(yi, ys[i])) << "layer " << i;
    (i == 1 ? yi.pow(2).sum() : yi.sum()).backward();
    gx += xi.grad();
  }
  EXPECT_EQ(Fp8Linear::activation_casts(), n0 + 4);
  EXPECT_TRUE(at::allclose(x.grad(), gx, 1e-6, 1e-6));
  // An in-place change of the input is a new version: cast again.
  at::Tensor y0 = layers[0]->forward(x);
  {
    at::NoGradGuard ng;
    x.mul_(2);
  }
  at::Tensor y1 = layers[1]->forward(x);
  EXPECT_EQ(Fp8Linear::activation_casts(), n0 + 6);
  EXPECT_TRUE(at::equal(y1, layers[1]->forward(x.detach().clone())));
  // Without grad nothing needs the transpose: the three layers still share one cast.
  at::NoGradGuard ng;
  const int64_t n1 = Fp8Linear::activation_casts();
  for (auto& l : layers) l->forward(x);
  EXPECT_EQ(Fp8Linear::activation_casts(), n1 + 1);
  // A layer that needs the transpose after its saver is gone casts again (x3 with grad: the
  // transpose is held weakly and nobody kept it).
  {
    at::AutoGradMode on(true);
    layers[2]->forward(x);
  }
  EXPECT_EQ(Fp8Linear::activation_casts(), n1 + 2);
  // A freed input whose memory comes back for a new tensor of the same shape never matches:
  // two storages over one buffer (from_blob), the first freed before the second is made, so the
  // address, offset, shape, strides and version all agree and only the storage differs.
  std::vector<float> buffer(16 * 32);
  at::Tensor z = at::from_blob(buffer.data(), {16, 32}, at::kFloat);
  z.normal_();
  layers[0]->forward(z);
  z = at::Tensor();
  at::Tensor w = at::from_blob(buffer.data(), {16, 32}, at::kFloat);
  w.mul_(2);  // other values; one in-place op each, so both versions are 1
  ASSERT_EQ(w._version(), 1u);
  const int64_t n2 = Fp8Linear::activation_casts();
  at::Tensor yw = layers[0]->forward(w);
  EXPECT_EQ(Fp8Linear::activation_casts(), n2 + 1);
  EXPECT_TRUE(at::equal(yw, layers[0]->forward(w.clone())));
}

// q, k and v as FP8 layers fuse among themselves (fused_projections, CPU loops: any_device): one
// cast of the concatenated weights, one GEMM into the packed output, one cast of the packed
// output gradient and one GEMM each for dx and the concatenated dW. Equal bit for bit to those
// casts and GEMMs written out; mixed or rowwise groups are not fused.
TEST(Fp8Linear, ProjectionsOfOneInputFuseAmongThemselves) {
  at::manual_seed(5);
  std::vector<std::shared_ptr<Fp8Linear>> layers;
  for (int64_t out : {32, 16, 16}) {
    Linear base(LinearOptions(32, out).bias(true));
    base.weight().set_data(at::randn({out, 32}) * 0.2);
    base.param("bias").set_data(at::randn({out}));
    layers.push_back(std::make_shared<Fp8Linear>(base, Fp8Config{}));
  }
  std::vector<Linear*> group{layers[0].get(), layers[1].get(), layers[2].get()};
  at::Tensor x = at::randn({2, 8, 32}).requires_grad_();
  auto fused = fused_projections(x, group, /*any_device=*/true);
  ASSERT_TRUE(fused.has_value());
  for (auto& l : layers) EXPECT_EQ(l->weight_casts(), 1);
  // Written out: the casts of x, of cat(W) and of the packed gradient, dequantized products.
  const auto e4 = at::kFloat8_e4m3fn, e5 = at::kFloat8_e5m2;
  auto deq = [](const at::Tensor& d, const at::Tensor& inv) { return d.to(at::kFloat) * inv; };
  at::Tensor x2 = x.detach().reshape({-1, 32});
  at::Tensor w =
      at::cat({layers[0]->weight(), layers[1]->weight(), layers[2]->weight()}, 0).detach();
  at::Tensor b =
      at::cat({layers[0]->param("bias"), layers[1]->param("bias"), layers[2]->param("bias")})
          .detach();
  kernels::Fp8Tensor xq = kernels::cast_to_fp8_reference(x2, e4, false, true),
                     wq = kernels::cast_to_fp8_reference(w, e4, false, true);
  at::Tensor y = at::mm(deq(xq.data, xq.inv_scale), deq(wq.data, wq.inv_scale).t()) + b;
  EXPECT_TRUE(at::equal(fused->reshape({-1, 64}), y));
  at::Tensor g = at::randn_like(*fused);
  std::vector<at::Tensor> wrt{x};
  for (auto& l : layers) wrt.push_back(l->weight());
  for (auto& l : layers) wrt.push_back(l->param("bias"));
  auto grads = torch::autograd::grad({*fused}, wrt, {g});
  kernels::Fp8Tensor gq = kernels::cast_to_fp8_reference(g.reshape({-1, 64}), e5, false, true);
  at::Tensor dx = at::mm(deq(gq.data, gq.inv_scale), deq(wq.data_t, wq.inv_scale).t());
  at::Tensor dw = at::mm(deq(gq.data_t, gq.inv_scale), deq(xq.data_t, xq.inv_scale).t());
  at::Tensor db = g.reshape({-1, 64}).sum(0);
  EXPECT_TRUE(at::equal(grads[0], dx.view(x.sizes())));
  int64_t r0 = 0;
  for (size_t i = 0; i < 3; ++i) {
    const int64_t rows = layers[i]->weight().size(0);
    EXPECT_TRUE(at::equal(grads[1 + i], dw.narrow(0, r0, rows))) << "dW " << i;
    EXPECT_TRUE(at::equal(grads[4 + i], db.narrow(0, r0, rows))) << "db " << i;
    r0 += rows;
  }
  // Within the quantization bound of the unquantized product (the group's one weight scale).
  at::Tensor exact = at::matmul(x.detach(), w.t()) + b;
  EXPECT_LT((*fused - exact).abs().max().item<double>(), 0.1 * exact.abs().max().item<double>());
  // The group's cast of its weights is the cast of their concatenation; parts that do not
  // concatenate are named.
  EXPECT_TRUE(at::equal(
      kernels::cast_to_fp8_concat({layers[0]->weight(), layers[1]->weight()}, e4, true).data_t,
      kernels::cast_to_fp8_reference(at::cat({layers[0]->weight(), layers[1]->weight()}), e4, false,
                                     true)
          .data_t));
  EXPECT_NE(error_of([&] {
              kernels::cast_to_fp8_concat({at::zeros({2, 4}), at::zeros({2, 8})}, e4, false);
            }).find("every tensor needs 4 columns"),
            std::string::npos);
  // Not fused: an FP8 layer with a plain one, or the rowwise recipe.
  Linear plain(LinearOptions(32, 16).bias(true));
  EXPECT_FALSE(fused_projections(x, {layers[0].get(), &plain}, true).has_value());
  Fp8Config rowwise;
  rowwise.recipe = "rowwise";
  Fp8Linear r1(*layers[1], rowwise), r2(*layers[2], rowwise);
  EXPECT_FALSE(fused_projections(x, {&r1, &r2}, true).has_value());
}

// A fused group's weight cast stays in its first layer only with keep_weight_casts (several
// micro-batches a step share it). Without it nothing of the cast outlives the step's graph: a
// kept cast per layer held 2 bytes per q/k/v and gate/up weight on the device for the whole run
// (17.6 GB at 13b by count; on the H200 it showed as Gemini's placement running out of host
// room).
TEST(Fp8Linear, AFusedGroupKeepsItsWeightCastOnlyWhenAsked) {
  at::manual_seed(6);
  for (bool keep : {true, false}) {
    SCOPED_TRACE(keep ? "keep_weight_casts" : "casts dropped");
    Fp8Config cfg;
    cfg.keep_weight_casts = keep;
    std::vector<std::shared_ptr<Fp8Linear>> layers;
    for (int i = 0; i < 2; ++i) {
      Linear base(LinearOptions(32, 16).bias(false));
      base.weight().set_data(at::randn({16, 32}));
      layers.push_back(std::make_shared<Fp8Linear>(base, cfg));
    }
    std::vector<Fp8Linear*> group{layers[0].get(), layers[1].get()};
    std::vector<Linear*> as_linear{layers[0].get(), layers[1].get()};
    at::Tensor x = at::randn({4, 8, 32}).requires_grad_();
    {
      auto y = fused_projections(x, as_linear, /*any_device=*/true);
      ASSERT_TRUE(y.has_value());
      y->sum().backward();
    }  // the step's graph is gone
    EXPECT_EQ(layers[0]->weight_casts(), 1);
    const kernels::Fp8Tensor again = layers[0]->group_weight_cast(group);
    // Kept: the same cast again, held by the layer too. Dropped: a new cast, held only here.
    EXPECT_EQ(layers[0]->weight_casts(), keep ? 1 : 2);
    EXPECT_EQ(again.data.use_count(), keep ? 2 : 1);
    EXPECT_EQ(again.data_t.use_count(), keep ? 2 : 1);
  }
}

TEST(Fp8Linear, ConvertsAModelAndKeepsExcludedLayersPlain) {
  models::ModelConfig c = tests::tiny_llama();
  c.tie_word_embeddings = false;
  auto plain = std::make_shared<models::CausalLM>(c);
  InitOptions io;
  init_parameters(*plain, io);
  auto fp8 = std::make_shared<models::CausalLM>(c);
  init_parameters(*fp8, io);
  Fp8Config cfg;
  EXPECT_EQ(convert_to_fp8(*fp8, cfg, at::Device(at::kCPU)).size(), 14u);  // lm_head excluded
  EXPECT_FALSE(std::dynamic_pointer_cast<Fp8Linear>(find_module(*fp8, "lm_head")));
  at::Tensor ids = at::randint(0, 64, {2, 16});
  at::Tensor a = plain->forward(ids), b = fp8->forward(ids);
  const double rel = ((a - b).norm() / a.norm()).item<double>();
  EXPECT_GT(rel, 1e-5);  // FP8 arithmetic is in use (no fused path bypasses it)
  EXPECT_LT(rel, 5e-2);
  // Parameters keep their names and dtypes: checkpoints stay ordinary.
  EXPECT_EQ(fp8->named_parameters().size(), plain->named_parameters().size());
  for (const auto& p : fp8->named_parameters()) EXPECT_EQ(p.value().scalar_type(), at::kFloat);
  auto attn_only = std::make_shared<models::CausalLM>(c);
  Fp8Config ex;
  ex.exclude = {"lm_head", "mlp"};
  EXPECT_EQ(convert_to_fp8(*attn_only, ex, at::Device(at::kCPU)).size(), 8u);

  Fp8Config bad;
  bad.recipe = "blockwise";
  EXPECT_NE(error_of([&] {
              convert_to_fp8(*plain, bad, at::Device(at::kCPU));
            }).find("recipe 'blockwise' is not supported"),
            std::string::npos);
  Linear odd(LinearOptions(24, 16));
  EXPECT_NE(error_of([&] { Fp8Linear l(odd, Fp8Config{}); }).find("divisible by 16"),
            std::string::npos);
  // Sharding keeps the FP8 GEMMs' rule on each rank's sizes (tensor parallelism itself:
  // test_fp8_tp.cpp).
  Linear ok(LinearOptions(32, 16));
  Fp8Linear l(ok, Fp8Config{});
  EXPECT_NE(
      error_of([&] { l.shard(ShardSpec(ShardSpec::Kind::Column, 0, 2)); }).find("divisible by 16"),
      std::string::npos);
  Linear wide(LinearOptions(32, 64));
  Fp8Linear half(wide, Fp8Config{});
  half.shard(ShardSpec(ShardSpec::Kind::Column, 1, 2));
  EXPECT_EQ(half.out_features(), 32);
}

// Known amaxes (kernels/fp8.h): an entry describes bytes (storage, offset, count, version), so a
// view of the same bytes finds it, an in-place change or other bytes do not; a cast that finds
// one uses it as its amax (a different value changes the scale, the true value changes nothing).
TEST(Fp8KnownAmax, EntriesFollowTheBytes) {
  at::Tensor t = at::randn({8, 16}).to(at::kBFloat16);
  kernels::record_fp8_amax(t, at::full({1}, 7.0f));
  EXPECT_TRUE(kernels::known_fp8_amax(t).defined());
  EXPECT_TRUE(kernels::known_fp8_amax(t.view({16, 8})).defined());
  EXPECT_EQ(kernels::known_fp8_amax(t.reshape({-1})).item<float>(), 7.0f);
  EXPECT_FALSE(kernels::known_fp8_amax(t.narrow(0, 0, 4)).defined());
  EXPECT_FALSE(kernels::known_fp8_amax(t.clone()).defined());
  t.add_(1);
  EXPECT_FALSE(kernels::known_fp8_amax(t).defined());

  at::Tensor x = at::randn({32, 64}).to(at::kBFloat16);
  const kernels::Fp8Tensor plain = kernels::cast_to_fp8(x, at::kFloat8_e4m3fn, false, true);
  const int64_t uses = kernels::fp8_known_amax_uses();
  kernels::record_fp8_amax(x, x.abs().amax().to(at::kFloat).reshape({1}));
  const kernels::Fp8Tensor known = kernels::cast_to_fp8(x, at::kFloat8_e4m3fn, false, true);
  EXPECT_EQ(kernels::fp8_known_amax_uses(), uses + 1);
  EXPECT_TRUE(at::equal(known.data.view(at::kByte), plain.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(known.data_t.view(at::kByte), plain.data_t.view(at::kByte)));
  EXPECT_TRUE(at::equal(known.inv_scale, plain.inv_scale));
  kernels::record_fp8_amax(x, at::full({1}, 100.0f));
  const kernels::Fp8Tensor other = kernels::cast_to_fp8(x, at::kFloat8_e4m3fn, false, false);
  EXPECT_FLOAT_EQ(other.inv_scale.item<float>(), 100.0f / 448.0f);
  // Rowwise casts have one amax per row: a recorded tensorwise amax is not theirs.
  const int64_t before = kernels::fp8_known_amax_uses();
  kernels::cast_to_fp8(x, at::kFloat8_e4m3fn, true, false);
  EXPECT_EQ(kernels::fp8_known_amax_uses(), before);
}

// FP8 projections around our SwiGLU (the MLP's shape; the model takes this path on the GPU):
// SwiGLU records the amax of its output (the down projection's input) and of its input
// gradients (the gate / up projections' output gradients, packed for a fused gate/up), and
// those casts take them; the output and every gradient are bit for bit those with recording off
// (the recorded amax is the max of the same stored values).
TEST(Fp8KnownAmax, SwigluRecordsWhatTheFp8CastsReadAgain) {
  at::manual_seed(2);
  auto make = [](int64_t in, int64_t out) {
    auto base = std::make_shared<Linear>(LinearOptions(in, out).bias(false));
    base->weight().set_data(at::randn({out, in}) * 0.1);
    return base;
  };
  auto g = make(64, 96), u = make(64, 96), d = make(96, 64);
  Fp8Config cfg;
  Fp8Linear fg(*g, cfg), fu(*u, cfg), fd(*d, cfg);
  at::Tensor x0 = at::randn({2, 8, 64}), dy = at::randn({2, 8, 64});
  for (bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "fused gate/up" : "separate gate and up");
    auto run = [&](bool capture) {
      kernels::set_fp8_amax_capture(capture);
      for (Fp8Linear* l : {&fg, &fu, &fd}) l->weight().mutable_grad() = at::Tensor();
      at::Tensor x = x0.clone().requires_grad_();
      at::Tensor h;
      if (packed) {
        auto gu = fp8_fused_projections(x, {&fg, &fu});
        EXPECT_TRUE(gu.has_value());
        h = kernels::swiglu_packed(*gu);
      } else {
        h = kernels::swiglu(fg.forward(x), fu.forward(x));
      }
      at::Tensor y = fd.forward(h);
      y.backward(dy);
      return std::vector<at::Tensor>{y.detach(), x.grad(), fg.weight().grad(), fu.weight().grad(),
                                     fd.weight().grad()};
    };
    const std::vector<at::Tensor> off = run(false);
    const int64_t uses = kernels::fp8_known_amax_uses();
    const std::vector<at::Tensor> on = run(true);
    // The down projection's input; the output gradient of gate and of up (one packed for both).
    EXPECT_EQ(kernels::fp8_known_amax_uses() - uses, packed ? 2 : 3);
    for (size_t i = 0; i < on.size(); ++i) EXPECT_TRUE(at::equal(on[i], off[i])) << "tensor " << i;
  }
  kernels::set_fp8_amax_capture(false);
}

// The optimizer's kernel records the amax of the working weights it writes (the FP8 weight casts
// of the next forward take it: the same cast bit for bit, one pass fewer; a fused group takes the
// max of its parts'), and the next optimizer step or load (the weights epoch) voids the entries.
TEST(Fp8KnownAmax, TheOptimizerRecordsTheWeightsItWrites) {
  kernels::set_fp8_amax_capture(true);
  at::manual_seed(5);
  std::vector<at::Tensor> masters, grads, ms, vs, working;
  for (int64_t rows : {32, 16}) {
    masters.push_back(at::randn({rows, 64}));
    grads.push_back(at::randn({rows, 64}));
    ms.push_back(at::zeros({rows, 64}));
    vs.push_back(at::zeros({rows, 64}));
    working.push_back(masters.back().to(at::kBFloat16));
  }
  kernels::AdamWStep hy;
  hy.lr = 1e-2;
  kernels::fused_adamw(masters, grads, ms, vs, working, hy);
  for (const at::Tensor& w : working) {
    at::Tensor k = kernels::known_fp8_amax(w);
    ASSERT_TRUE(k.defined());
    EXPECT_EQ(k.item<float>(), w.abs().max().to(at::kFloat).item<float>());
  }
  int64_t uses = kernels::fp8_known_amax_uses();
  const kernels::Fp8Tensor known =
      kernels::cast_to_fp8(working[0], at::kFloat8_e4m3fn, false, true);
  const kernels::Fp8Tensor plain =
      kernels::cast_to_fp8(working[0].clone(), at::kFloat8_e4m3fn, false, true);
  EXPECT_EQ(kernels::fp8_known_amax_uses(), uses + 1);
  EXPECT_TRUE(at::equal(known.data.view(at::kByte), plain.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(known.inv_scale, plain.inv_scale));
  uses = kernels::fp8_known_amax_uses();
  const kernels::Fp8Tensor group = kernels::cast_to_fp8_concat(working, at::kFloat8_e4m3fn, true);
  EXPECT_EQ(kernels::fp8_known_amax_uses(), uses + 1);
  const kernels::Fp8Tensor group_plain =
      kernels::cast_to_fp8(at::cat(working, 0), at::kFloat8_e4m3fn, false, true);
  EXPECT_TRUE(at::equal(group.data.view(at::kByte), group_plain.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(group.inv_scale, group_plain.inv_scale));
  bump_weights_epoch();
  EXPECT_FALSE(kernels::known_fp8_amax(working[0]).defined());
  kernels::set_fp8_amax_capture(false);
}
