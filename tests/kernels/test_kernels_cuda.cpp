// Fused kernels (kernels/fused.h) on CUDA: every op against its ATen reference on the GPU, the
// CUDA path against the CPU path, the 16-byte and the scalar (odd size / misaligned) kernel
// variants, poisoned (NaN) memory under the outputs to catch unwritten elements, a non-default
// stream, and the multi-tensor AdamW against at::_fused_adamw_ (torch.optim.AdamW(fused=True)).
// Skipped without a visible GPU (this machine's CI); the lead runs it on the H200.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "kernels/numerics.h"

using namespace colossal;
namespace K = colossal::kernels;
using namespace colossal::test;

namespace {

bool have_gpu() {
  return Accelerator::cuda().available();
}
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible"

at::Device gpu() {
  return at::Device(at::kCUDA, 0);
}

bool all_finite(const at::Tensor& t) {
  return at::isfinite(t).all().item<bool>();
}

// Fill freed caching-allocator blocks with NaN: outputs allocated next reuse them, so an
// element a kernel never writes stays NaN and fails all_finite.
void poison() {
  std::vector<at::Tensor> keep;
  for (int i = 0; i < 64; ++i)
    keep.push_back(at::full({1 << 17}, NAN, at::TensorOptions().device(gpu())));  // small pool
  keep.push_back(at::full({int64_t(1) << 26}, NAN, at::TensorOptions().device(gpu())));
  Accelerator::cuda().synchronize();
}

// A [rows, h] tensor whose data pointer is 2 bytes off 16-byte alignment (scalar kernels).
at::Tensor misaligned(const at::Tensor& t) {
  at::Tensor buf = at::empty({t.numel() + 8}, t.options());
  at::Tensor v = buf.narrow(0, 1, t.numel()).view(t.sizes());
  v.copy_(t);
  return v;
}

}  // namespace

TEST(CudaKernels, Registered) {
  REQUIRE_GPU();
  at::Tensor t = at::ones({1}, at::TensorOptions().device(gpu()));
  EXPECT_TRUE(K::has_fused_kernels(t));
  auto names = cuda_kernels();
  EXPECT_NE(std::find(names.begin(), names.end(), "rms_norm"), names.end());
}

TEST(CudaKernels, RmsNorm) {
  REQUIRE_GPU();
  struct Shape {
    int64_t rows, h;
    bool misalign;
  };
  for (auto dt : kTypes) {
    for (Shape s : {Shape{111, 4104, false}, Shape{5, 2049, false}, Shape{1000, 2048, false},
                    Shape{64, 4096, true}, Shape{3, 64, false}, Shape{7, 16384, false}}) {
      at::manual_seed(11);
      at::Tensor x0 = (at::randn({s.rows, s.h}) * 2).to(dt), w0 = (at::rand({s.h}) + 0.5).to(dt);
      at::Tensor dy = at::randn({s.rows, s.h}).to(dt);
      at::Tensor xg = x0.to(gpu()), wg = w0.to(gpu()), dyg = dy.to(gpu());
      if (s.misalign) {
        xg = misaligned(xg);
        dyg = misaligned(dyg);
      }
      const std::string what = std::string(c10::toString(dt)) + " rows " + std::to_string(s.rows) +
                               " h " + std::to_string(s.h);
      // forward: vs the ATen composite on the GPU and vs our CPU path
      poison();
      at::Tensor y = K::rms_norm(xg, wg, 1e-6);
      ASSERT_TRUE(all_finite(y)) << what;
      at::Tensor yr = K::rms_norm_reference(xg, wg, 1e-6);
      at::Tensor yc = K::rms_norm(x0, w0, 1e-6);
      // rstd differs from ATen's in the last fp32 bit now and then (another summation order),
      // which can flip the rounding of x * rstd to the dtype: two ulp of the output at most.
      const double tol = dt == at::kFloat ? 4 * ulp(dt) : 2 * ulp(dt);
      EXPECT_LE(excess(y, yr, tol, 1e-30), 1.0) << what;
      EXPECT_LE(excess(y, yc, tol, 1e-30), 1.0) << what;
      std::printf("rms_norm fwd %s: %.5f bitwise equal to ATen CUDA, %.5f to our CPU path\n",
                  what.c_str(), frac_equal(y, yr), frac_equal(y, yc));
      // backward: vs the fp64 truth (as tight as the CPU path) and vs the CPU path
      at::Tensor x = xg.detach().clone().requires_grad_(true),
                 w = wg.detach().clone().requires_grad_(true);
      poison();
      auto [dx, dw] = grads_of(K::rms_norm(x, w, 1e-5), dyg, x, w);
      ASSERT_TRUE(all_finite(dx) && all_finite(dw)) << what;
      at::Tensor xt = x0.to(at::kDouble).requires_grad_(true),
                 wt = w0.to(at::kDouble).requires_grad_(true);
      at::Tensor yt = wt * (xt * at::rsqrt(xt.pow(2).mean(-1, true) + 1e-5));
      auto [dxt, dwt] = grads_of(yt, dy.to(at::kDouble), xt, wt);
      EXPECT_LE(max_abs(dx.cpu().to(at::kDouble) - dxt), 4 * ulp(dt) * max_abs(dxt)) << what;
      EXPECT_LE(max_abs(dw.cpu().to(at::kDouble) - dwt),
                (dt == at::kFloat ? 256 : 4) * ulp(dt) * max_abs(dwt))
          << what;
      at::Tensor xc = x0.clone().requires_grad_(true), wc = w0.clone().requires_grad_(true);
      auto [dxc, dwc] = grads_of(K::rms_norm(xc, wc, 1e-5), dy, xc, wc);
      EXPECT_LE(max_abs(dx.cpu().to(at::kDouble) - dxc.to(at::kDouble)), 2 * ulp(dt) * max_abs(dxt))
          << what;
    }
  }
}

TEST(CudaKernels, AddRmsNorm) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t h : {int64_t(2048), int64_t(4096), int64_t(2049)}) {  // 16-byte and scalar kernels
      at::manual_seed(12);
      auto o = at::TensorOptions().device(gpu());
      at::Tensor x = (at::randn({1000, h}, o) * 2).to(dt), r = at::randn({1000, h}, o).to(dt);
      at::Tensor w = (at::rand({h}, o) + 0.5).to(dt);
      at::Tensor dh = at::randn({1000, h}, o).to(dt), dy = at::randn({1000, h}, o).to(dt);
      poison();
      auto [f, p] = add_rms_cases(
          x, r, w, dh, dy, [](auto& a, auto& b, auto& c) { return K::add_rms_norm(a, b, c, 1e-5); },
          [](auto& a, auto& c) { return K::rms_norm(a, c, 1e-5); });
      const std::string what = std::string(c10::toString(dt)) + " h " + std::to_string(h);
      ASSERT_TRUE(all_finite(f.h) && all_finite(f.y) && all_finite(f.dx)) << what;
      EXPECT_TRUE(at::equal(f.h, p.h)) << what;
      EXPECT_TRUE(at::equal(f.y, p.y)) << what;
      EXPECT_TRUE(at::equal(f.dx, p.dx)) << what;
      EXPECT_TRUE(at::equal(f.dr, p.dr)) << what;
      EXPECT_TRUE(at::equal(f.dw, p.dw)) << what;
      std::printf("add_rms_norm %s: h, y, dx, dr, dw bitwise equal to add + rms_norm\n",
                  what.c_str());
    }
  }
}

TEST(CudaKernels, Rotary) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t d : {64, 128, 72}) {
      for (bool bc : {false, true}) {
        at::manual_seed(12);
        const int64_t b = 2, h = 5, s = 37;
        at::Tensor xc = at::randn({b, s, h, d}).to(dt).transpose(1, 2);
        at::Tensor pos = at::arange(s, at::kFloat).unsqueeze(0).expand({bc ? 1 : b, s});
        at::Tensor inv = at::pow(10000.0, -at::arange(0, d, 2, at::kFloat) / d);
        at::Tensor f = pos.unsqueeze(-1) * inv, emb = at::cat({f, f}, -1);
        at::Tensor cc = emb.cos().to(dt), sc = emb.sin().to(dt);
        at::Tensor x = xc.to(gpu()), cs = cc.to(gpu()), sn = sc.to(gpu());
        const std::string what = std::string(c10::toString(dt)) + " D " + std::to_string(d);
        poison();
        at::Tensor y = K::apply_rotary(x, cs, sn);
        ASSERT_TRUE(all_finite(y)) << what;
        EXPECT_TRUE(y.transpose(1, 2).is_contiguous());
        at::Tensor yr = K::apply_rotary_reference(x, cs, sn);
        EXPECT_TRUE(at::equal(y, yr)) << what << " excess " << excess(y, yr, ulp(dt), 1e-30);
        EXPECT_TRUE(at::equal(y.cpu(), K::apply_rotary(xc, cc, sc))) << what;
        at::Tensor dy = at::randn({b, h, s, d}, x.options());
        at::Tensor xg = x.detach().clone().requires_grad_(true);
        at::Tensor xr = x.detach().clone().requires_grad_(true);
        poison();
        at::Tensor dx = torch::autograd::grad({K::apply_rotary(xg, cs, sn)}, {xg}, {dy})[0];
        ASSERT_TRUE(all_finite(dx)) << what;
        at::Tensor dxr =
            torch::autograd::grad({K::apply_rotary_reference(xr, cs, sn)}, {xr}, {dy})[0];
        EXPECT_TRUE(at::equal(dx, dxr)) << what << " excess " << excess(dx, dxr, ulp(dt), 1e-30);
      }
    }
  }
}

// The merge by log-sum-exp: one pass on the GPU against the ATen composite on the same GPU and
// against the CPU: fp32, bf16 and fp16 parts; head dims 64, 128 and 6 (the scalar kernel); a
// tokens-major running result (as ring_attn keeps it) and heads-major parts; rows that are
// empty in the running result (-inf: the first block) and in both (left as they are). The
// products and the sum are rounded where the composite rounds them; exp / log1p may differ in
// the last bit between the two, so 1e-6 relative is allowed.
TEST(CudaKernels, AttentionMerge) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t d : {64, 128, 6}) {
      at::manual_seed(31);
      const int64_t b = 2, h = 3, n = 37;
      const std::string what = std::string(c10::toString(dt)) + " D " + std::to_string(d);
      at::Tensor out = at::randn({b, n, h, d}).transpose(1, 2);  // tokens-major
      at::Tensor lse = at::randn({b, h, n});
      lse.select(2, 0).fill_(-INFINITY);  // the first block's rows: nothing merged yet
      out.select(2, 0).zero_();
      at::Tensor part = at::randn({b, h, n, d}).to(dt);
      at::Tensor part_lse = at::randn({b, h, n});
      part_lse.select(2, 0)[0].fill_(-INFINITY);  // batch 0, row 0: empty in both
      at::Tensor og = out.to(gpu()), lg = lse.to(gpu()), orf = og.clone(), lrf = lg.clone();
      const at::Tensor pg = part.to(gpu()), plg = part_lse.to(gpu());
      K::attention_merge(og, lg, pg, plg);
      K::attention_merge_reference(orf, lrf, pg, plg);
      ASSERT_TRUE(all_finite(og)) << what;
      EXPECT_TRUE(at::allclose(og, orf, 1e-6, 1e-6))
          << what << " excess " << excess(og, orf, 1e-6, 1e-6);
      EXPECT_TRUE(at::allclose(lg, lrf, 1e-6, 1e-6, /*equal_nan=*/false)) << what;
      EXPECT_TRUE(at::isneginf(lg.select(2, 0)[0]).all().item<bool>()) << what;
      at::Tensor oc = out.clone(), lc = lse.clone();
      K::attention_merge(oc, lc, part, part_lse);  // the CPU path
      EXPECT_TRUE(at::allclose(og.cpu(), oc, 1e-6, 1e-6)) << what;
      // A part 2 bytes off 16-byte alignment takes the scalar kernel.
      at::Tensor og2 = out.to(gpu()), lg2 = lse.to(gpu());
      const at::Tensor pm = misaligned(pg.reshape({b * h * n, d})).view({b, h, n, d});
      K::attention_merge(og2, lg2, pm, plg);
      EXPECT_TRUE(at::allclose(og2, orf, 1e-6, 1e-6)) << what << " misaligned";
    }
  }
}

TEST(CudaKernels, SwiGLU) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t f : {5632, 5635}) {  // 16-byte packs, and the scalar kernel
      at::manual_seed(13);
      at::Tensor g0 = (at::randn({3, 37, f}) * 3).to(dt), u0 = at::randn({3, 37, f}).to(dt);
      at::Tensor dy0 = at::randn({3, 37, f}).to(dt);
      at::Tensor g = g0.to(gpu()).requires_grad_(true), u = u0.to(gpu()).requires_grad_(true);
      at::Tensor gr = g0.to(gpu()).requires_grad_(true), ur = u0.to(gpu()).requires_grad_(true);
      const std::string what = std::string(c10::toString(dt)) + " F " + std::to_string(f);
      poison();
      at::Tensor y = K::swiglu(g, u);
      auto [dg, du] = grads_of(y, dy0.to(gpu()), g, u);
      ASSERT_TRUE(all_finite(y) && all_finite(dg) && all_finite(du)) << what;
      at::Tensor yr = K::swiglu_reference(gr, ur);
      auto [dgr, dur] = grads_of(yr, dy0.to(gpu()), gr, ur);
      const double tol = dt == at::kFloat ? 8 * ulp(dt) : ulp(dt);
      EXPECT_LE(excess(y, yr, tol, 1e-30), 1.0) << what;
      EXPECT_LE(excess(du, dur, tol, 1e-30), 1.0) << what;
      EXPECT_LE(excess(dg, dgr, tol, ulp(dt) * max_abs(dgr)), 1.0) << what;
      EXPECT_LE(excess(y, K::swiglu(g0, u0), tol, 1e-30), 1.0) << what;
      std::printf("swiglu %s: y %.5f, dgate %.5f, dup %.5f bitwise equal to ATen CUDA\n",
                  what.c_str(), frac_equal(y, yr), frac_equal(dg, dgr), frac_equal(du, dur));
    }
  }
}

TEST(CudaKernels, SumSquares) {
  REQUIRE_GPU();
  at::manual_seed(18);
  std::vector<at::Tensor> ts;
  for (int i = 0; i < 150; ++i) {  // > one launch, three dtypes, odd sizes, one misaligned
    const int64_t n = 1 + (i * 104729) % 300000;
    at::Tensor t = at::randn({n}).to(kTypes[i % 3]).to(gpu());
    ts.push_back(i == 7 ? misaligned(t.view({1, n})).view({n}) : t);
  }
  ts.push_back(at::randn({64, 96}).to(gpu()).t());  // strided
  const double ours = K::sum_squares(ts).item<double>();
  const double ref = K::sum_squares_reference(ts).item<double>();
  // fp32 sums of <= 65536 squares per block, fp64 across blocks: ~1e-6 relative.
  EXPECT_NEAR(ours, ref, 1e-5 * ref);
  ts[3][5] = INFINITY;
  EXPECT_FALSE(std::isfinite(K::sum_squares(ts).item<double>()));
  ts[3][5] = NAN;
  EXPECT_TRUE(std::isnan(K::sum_squares(ts).item<double>()));
  EXPECT_EQ(K::sum_squares({}).item<double>(), 0.0);
}

TEST(CudaKernels, CrossEntropyGrad) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t V : {32000, 1003}) {  // 16-byte packs, and the scalar kernel
      at::manual_seed(17);
      const int64_t n = 300;
      at::Tensor x0 = (at::randn({n, V}) * 4).to(dt);
      at::Tensor t = at::randint(0, V, {n}, at::kLong);
      t.index_put_({at::arange(0, n, 7)}, -100);
      at::Tensor scale = at::full({}, 1.0 / 257, at::TensorOptions().device(gpu()));
      at::Tensor x = x0.to(gpu()), xr = x0.to(gpu()), xc = x0.clone();
      const std::string what = std::string(c10::toString(dt)) + " V " + std::to_string(V);
      at::Tensor loss = K::cross_entropy_grad_(x, t.to(gpu()), -100, scale);
      at::Tensor lr = K::cross_entropy_grad_reference_(xr, t.to(gpu()), -100, scale);
      at::Tensor lc = K::cross_entropy_grad_(xc, t, -100, scale.cpu());
      ASSERT_TRUE(all_finite(x)) << what;
      EXPECT_LE(max_abs(loss - lr), 1e-5 * max_abs(lr)) << what;
      EXPECT_LE(max_abs(loss.cpu() - lc), 1e-5 * max_abs(lc)) << what;
      const double tol = dt == at::kFloat ? 1e-5 : ulp(dt);  // as in test_kernels.cpp
      EXPECT_LE(max_abs(x.to(at::kFloat) - xr.to(at::kFloat)),
                tol * max_abs(xr.to(at::kFloat)) + 1e-12)
          << what;
      EXPECT_LE(max_abs(x.cpu().to(at::kFloat) - xc.to(at::kFloat)),
                tol * max_abs(xc.to(at::kFloat)) + 1e-12)
          << what;
    }
  }
}

TEST(CudaKernels, SwiGLUPackedAndLinearConcat) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t f : {5632, 1411}) {  // 16-byte packs, and the scalar kernel
      at::manual_seed(15);
      const std::string what = std::string(c10::toString(dt)) + " F " + std::to_string(f);
      at::Tensor gu0 = (at::randn({3, 37, 2 * f}) * 3).to(dt), dy0 = at::randn({3, 37, f}).to(dt);
      at::Tensor gu = gu0.to(gpu()).requires_grad_(true);
      poison();
      at::Tensor y = K::swiglu_packed(gu);
      at::Tensor dgu = torch::autograd::grad({y}, {gu}, {dy0.to(gpu())})[0];
      ASSERT_TRUE(all_finite(y) && all_finite(dgu)) << what;
      // Bitwise the unpacked CUDA kernel on the two halves.
      at::Tensor g = gu0.narrow(-1, 0, f).to(gpu()).requires_grad_(true);
      at::Tensor u = gu0.narrow(-1, f, f).to(gpu()).requires_grad_(true);
      at::Tensor yh = K::swiglu(g, u);
      auto [dg, du] = grads_of(yh, dy0.to(gpu()), g, u);
      EXPECT_TRUE(at::equal(y, yh)) << what;
      EXPECT_TRUE(at::equal(dgu, at::cat({dg, du}, -1))) << what;
    }
  }
  // linear_concat on cuBLAS: the same as separate linears (bf16 outputs within one ulp: the
  // GEMMs may pick other tilings), gradients too; thin weights (one concatenated GEMM) and wide
  // ones (a GEMM per column block).
  for (int64_t r : {64, 1024}) {
    at::manual_seed(16);
    at::Tensor x0 = at::randn({4, 64, 256}).to(at::kBFloat16);
    std::vector<at::Tensor> w0{at::randn({1024, 256}) * 0.05, at::randn({r, 256}) * 0.05,
                               at::randn({r, 256}) * 0.05};
    std::vector<at::Tensor> w, wr;
    for (auto& t : w0) {
      w.push_back(t.to(gpu(), at::kBFloat16).requires_grad_(true));
      wr.push_back(t.to(gpu(), at::kBFloat16).requires_grad_(true));
    }
    at::Tensor x = x0.to(gpu()).requires_grad_(true), xr = x0.to(gpu()).requires_grad_(true);
    at::Tensor y = K::linear_concat(x, w), yr = K::linear_concat_reference(xr, wr);
    at::Tensor dy = at::randn(y.sizes(), y.options());
    auto gs = torch::autograd::grad({y}, {x, w[0], w[1], w[2]}, {dy});
    auto gsr = torch::autograd::grad({yr}, {xr, wr[0], wr[1], wr[2]}, {dy});
    EXPECT_LE(excess(y, yr, ulp(at::kBFloat16), ulp(at::kBFloat16) * max_abs(yr)), 1.0);
    for (size_t i = 0; i < gs.size(); ++i)
      EXPECT_LE(
          excess(gs[i], gsr[i], 2 * ulp(at::kBFloat16), 2 * ulp(at::kBFloat16) * max_abs(gsr[i])),
          1.0)
          << "input " << i << " rows " << r;
  }
}

namespace {
struct AdamState {
  std::vector<at::Tensor> p, g, m, v, w;
};
AdamState adam_state(const std::vector<int64_t>& sizes, at::ScalarType gdt, at::ScalarType wdt,
                     at::Device dev, bool misalign) {
  at::manual_seed(14);
  AdamState s;
  auto put = [&](at::Tensor t) { return misalign ? misaligned(t.to(dev)) : t.to(dev); };
  for (int64_t n : sizes) {
    s.p.push_back(put(at::randn({n})));
    s.g.push_back(put(at::randn({n}).to(gdt)));
    s.m.push_back(put(at::randn({n}) * 0.1));
    s.v.push_back(put(at::rand({n}) * 0.01));
    if (wdt != at::kFloat)
      s.w.push_back(at::full({n}, NAN, at::TensorOptions().dtype(wdt).device(dev)));
  }
  return s;
}
AdamState copy(const AdamState& s, at::Device dev) {
  AdamState c;
  for (auto [from, to] :
       {std::pair{&s.p, &c.p}, {&s.g, &c.g}, {&s.m, &c.m}, {&s.v, &c.v}, {&s.w, &c.w}})
    for (const auto& t : *from) to->push_back(t.to(dev, /*non_blocking=*/false, /*copy=*/true));
  return c;
}
void aten_fused_adamw(AdamState& s, const K::AdamWStep& h) {
  std::vector<at::Tensor> g, steps;
  // A copy even for fp32 grads: ATen's CUDA kernel writes the unscaled gradient back in place
  // when given a grad_scale (ours only reads them).
  for (const auto& t : s.g) g.push_back(t.to(at::kFloat).contiguous().clone());
  for (size_t i = 0; i < s.p.size(); ++i)
    steps.push_back(at::full({}, double(h.step), s.p[i].options()));
  std::optional<at::Tensor> scale;
  if (h.grad_divisor != 1.0) scale = at::full({}, h.grad_divisor, s.p[0].options());
  at::_fused_adamw_(s.p, g, s.m, s.v, {}, steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                    false, false, scale, std::nullopt);
  for (size_t i = 0; i < s.w.size(); ++i) s.w[i].copy_(s.p[i]);
}
}  // namespace

TEST(CudaKernels, FusedAdamW) {
  REQUIRE_GPU();
  std::vector<int64_t> sizes = {65536 * 3 + 5, 1, 7, 4104, 0, 1000};
  for (int i = 0; i < 100; ++i) sizes.push_back(1 + (i * 7919) % 30000);  // > one launch
  struct Case {
    at::ScalarType g, w;
    bool misalign;
  };
  for (Case c : {Case{at::kFloat, at::kFloat, false}, Case{at::kBFloat16, at::kBFloat16, false},
                 Case{at::kHalf, at::kHalf, false}, Case{at::kBFloat16, at::kBFloat16, true},
                 Case{at::kFloat, at::kBFloat16, false}}) {
    AdamState ours = adam_state(sizes, c.g, c.w, gpu(), c.misalign);
    AdamState ref = copy(ours, gpu()), cpu = copy(ours, at::kCPU), ref_cpu = copy(ours, at::kCPU);
    for (int64_t step = 1; step <= 3; ++step) {
      K::AdamWStep h;
      h.lr = 1e-3;
      h.weight_decay = 0.1;
      h.step = step;
      h.grad_divisor = step == 2 ? 4.0 : 1.0;
      K::fused_adamw(ours.p, ours.g, ours.m, ours.v, ours.w, h);
      aten_fused_adamw(ref, h);
      K::fused_adamw(cpu.p, cpu.g, cpu.m, cpu.v, cpu.w, h);
      aten_fused_adamw(ref_cpu, h);
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] == 0) continue;
      const std::string what = std::string(c10::toString(c.g)) + " tensor " + std::to_string(i);
      // The arithmetic of ATen's CUDA kernel (fp32 scalars, fma moments): bitwise in practice.
      EXPECT_LE(excess(ours.p[i], ref.p[i], 4 * ulp(at::kFloat), 1e-8), 1.0) << what;
      // m and v: a few ulp of each element, or of the tensor's scale where they cancel to ~0.
      EXPECT_LE(
          excess(ours.m[i], ref.m[i], 4 * ulp(at::kFloat), 4 * ulp(at::kFloat) * max_abs(ref.m[i])),
          1.0)
          << what;
      EXPECT_LE(
          excess(ours.v[i], ref.v[i], 4 * ulp(at::kFloat), 4 * ulp(at::kFloat) * max_abs(ref.v[i])),
          1.0)
          << what;
      // Our CPU path follows ATen's CPU kernel (bitwise, test_kernels.cpp) and our CUDA path
      // ATen's CUDA kernel; ATen's two kernels differ in rounding (powf and fma on the device,
      // std::pow and separate multiply-adds on the host). So our CPU and CUDA results may be as
      // far apart as ATen's own CPU and CUDA results, and no further (plus 1 ulp of the value).
      const double aten_gap = max_abs((ref.p[i].cpu() - ref_cpu.p[i]));
      const double gap = max_abs((ours.p[i].cpu() - cpu.p[i]));
      EXPECT_LE(gap, aten_gap + ulp(at::kFloat) * max_abs(ref_cpu.p[i])) << what;
      if (!ours.w.empty()) {
        ASSERT_TRUE(all_finite(ours.w[i])) << what;
        EXPECT_LE(excess(ours.w[i], ref.w[i], ulp(c.w), 1e-12), 1.0) << what;
      }
    }
    std::printf("fused_adamw grads %s working %s%s: params %.5f bitwise equal to ATen CUDA\n",
                c10::toString(c.g), c10::toString(c.w), c.misalign ? " (misaligned)" : "",
                frac_equal(ours.p[0], ref.p[0]));
  }
}

TEST(CudaKernels, MixedGradDtypesInOneCall) {
  REQUIRE_GPU();
  AdamState a = adam_state({1000, 3000}, at::kBFloat16, at::kBFloat16, gpu(), false);
  AdamState b = adam_state({2000}, at::kFloat, at::kBFloat16, gpu(), false);
  AdamState all = a;
  for (auto [from, to] :
       {std::pair{&b.p, &all.p}, {&b.g, &all.g}, {&b.m, &all.m}, {&b.v, &all.v}, {&b.w, &all.w}})
    to->insert(to->end(), from->begin(), from->end());
  AdamState ref = copy(all, gpu());
  K::AdamWStep h;
  K::fused_adamw(all.p, all.g, all.m, all.v, all.w, h);
  aten_fused_adamw(ref, h);
  for (size_t i = 0; i < all.p.size(); ++i)
    EXPECT_LE(excess(all.p[i], ref.p[i], 4 * ulp(at::kFloat), 1e-8), 1.0) << i;
}

TEST(CudaKernels, RunsOnTheCurrentStream) {
  REQUIRE_GPU();
  Accelerator& acc = Accelerator::cuda();
  c10::Stream before = acc.current_stream();
  c10::Stream side = acc.new_stream();
  acc.set_stream(side);
  at::manual_seed(15);
  at::Tensor x = at::randn({4096, 2048}, at::TensorOptions().device(gpu()).dtype(at::kBFloat16));
  at::Tensor w = at::ones({2048}, x.options());
  at::Tensor y = K::rms_norm(x, w, 1e-6);  // queued on `side` after randn
  at::Tensor r = K::rms_norm_reference(x, w, 1e-6);
  acc.synchronize();
  acc.set_stream(before);
  EXPECT_LE(excess(y, r, ulp(at::kBFloat16), 1e-30), 1.0);
}

TEST(CudaKernels, DeviceMismatchesNameTheArgument) {
  REQUIRE_GPU();
  at::Tensor x = at::randn({4, 8}, at::TensorOptions().device(gpu()));
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const InputError& e) {
      return e.what();
    }
    return "no InputError";
  };
  EXPECT_NE(message([&] { K::rms_norm(x, at::ones({8}), 1e-6); }).find("weight is on cpu"),
            std::string::npos);
  EXPECT_NE(message([&] { K::swiglu(x, x.cpu()); }).find("up is on cpu"), std::string::npos);
  AdamState s = adam_state({5, 6}, at::kBFloat16, at::kBFloat16, gpu(), false);
  s.g[1] = s.g[1].cpu();
  K::AdamWStep h;
  EXPECT_NE(message([&] { K::fused_adamw(s.p, s.g, s.m, s.v, s.w, h); }).find("grads[1] is on cpu"),
            std::string::npos);
}
