// Fused kernels (kernels/fused.h), CPU paths, against their ATen references: RMSNorm, rotary,
// SwiGLU forward and backward (fp32, bf16, fp16; odd sizes), the multi-tensor AdamW against
// at::_fused_adamw_ (torch.optim.AdamW(fused=True)), and the argument errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/kernels/attention_reference.h"
#include "colossal/kernels/fused.h"
#include "kernels/numerics.h"

using namespace colossal;
namespace K = colossal::kernels;

using namespace colossal::test;

// ---- RMSNorm ----
TEST(RmsNorm, ForwardMatchesReference) {
  for (auto dt : kTypes) {
    for (auto shape : {std::vector<int64_t>{3, 37, 4104}, std::vector<int64_t>{5, 2049},
                       std::vector<int64_t>{1, 1, 64}, std::vector<int64_t>{2, 65543}}) {
      at::manual_seed(1);
      at::Tensor x = (at::randn(shape) * 3).to(dt);
      at::Tensor w = (at::rand({shape.back()}) + 0.5).to(dt);
      at::Tensor y = K::rms_norm(x, w, 1e-6), r = K::rms_norm_reference(x, w, 1e-6);
      ASSERT_EQ(y.scalar_type(), dt);
      ASSERT_EQ(y.sizes(), x.sizes());
      const double eq = frac_equal(y, r);
      std::printf("rms_norm fwd %s H=%ld: %.5f bitwise equal, excess %.3f\n", c10::toString(dt),
                  long(shape.back()), eq, excess(y, r, ulp(dt), 1e-30));
#if defined(__x86_64__)
      // The row sums replay ATen's CPU reduction order (8 lanes on x86-64): bitwise equal.
      EXPECT_TRUE(at::equal(y, r)) << c10::toString(dt) << " H=" << shape.back();
#else
      // Elsewhere the sums are correctly rounded, ATen's may differ in the last bit: the
      // rounding to a low-precision dtype flips rarely, fp32 results move by an ulp or two.
      EXPECT_LE(excess(y, r, dt == at::kFloat ? 4 * ulp(dt) : ulp(dt), 1e-30), 1.0);
#endif
    }
  }
}

TEST(RmsNorm, BackwardMatchesAutogradOfReference) {
  for (auto dt : kTypes) {
    at::manual_seed(2);
    const int64_t h = 4104;
    at::Tensor x0 = (at::randn({3, 37, h}) * 2).to(dt), w0 = (at::rand({h}) + 0.5).to(dt);
    at::Tensor dy = at::randn({3, 37, h}).to(dt);
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto [dx, dw] = grads_of(K::rms_norm(x, w, 1e-5), dy, x, w);
    at::Tensor xr = x0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
    auto [dxr, dwr] = grads_of(K::rms_norm_reference(xr, wr, 1e-5), dy, xr, wr);
    // fp64 truth from the same (rounded) inputs: RMSNorm without any intermediate rounding.
    at::Tensor xt = x0.to(at::kDouble).requires_grad_(true),
               wt = w0.to(at::kDouble).requires_grad_(true);
    at::Tensor yt = wt * (xt * at::rsqrt(xt.pow(2).mean(-1, true) + 1e-5));
    auto [dxt, dwt] = grads_of(yt, dy.to(at::kDouble), xt, wt);
    ASSERT_EQ(dx.scalar_type(), dt);
    ASSERT_EQ(dw.scalar_type(), dt);
    const double err_dx = max_abs(dx.to(at::kDouble) - dxt),
                 ref_dx = max_abs(dxr.to(at::kDouble) - dxt);
    const double err_dw = max_abs(dw.to(at::kDouble) - dwt),
                 ref_dw = max_abs(dwr.to(at::kDouble) - dwt);
    std::printf(
        "rms_norm bwd %s: |dx-truth| %.3g (reference %.3g), |dw-truth| %.3g (reference %.3g)\n",
        c10::toString(dt), err_dx, ref_dx, err_dw, ref_dw);
    // fp32 math with one final rounding: within a few ulp of the output scale of the truth, and
    // never meaningfully worse than the composite (which rounds dy*w and every product to dt).
    EXPECT_LE(err_dx, 4 * ulp(dt) * max_abs(dxt) + 1e-12);
    EXPECT_LE(err_dx, 1.05 * ref_dx + ulp(dt) * max_abs(dxt));
    // dweight sums 111 rows: fp32 accumulation error grows ~sqrt(rows) ulp of the terms.
    EXPECT_LE(err_dw, (dt == at::kFloat ? 64 : 2) * ulp(dt) * max_abs(dwt) + 1e-12);
    EXPECT_LE(err_dw, 1.05 * ref_dw + ulp(dt) * max_abs(dwt));
  }
}

TEST(RmsNorm, StridedInputAndNoGrad) {
  at::manual_seed(3);
  at::Tensor x = at::randn({64, 9}).t();  // [9, 64], last stride 9
  at::Tensor w = at::rand({64}) + 0.5;
  at::NoGradGuard ng;
  EXPECT_LE(excess(K::rms_norm(x, w, 1e-6), K::rms_norm_reference(x, w, 1e-6), 4 * ulp(at::kFloat),
                   1e-30),
            1.0);
}

TEST(AddRmsNorm, EqualsTheAddThenTheNormAndItsGradients) {
  for (auto dt : kTypes) {
    at::manual_seed(4);
    const int64_t h = 2049;
    at::Tensor x = (at::randn({3, 5, h}) * 2).to(dt), r = at::randn({3, 5, h}).to(dt);
    at::Tensor w = (at::rand({h}) + 0.5).to(dt);
    at::Tensor dh = at::randn({3, 5, h}).to(dt), dy = at::randn({3, 5, h}).to(dt);
    auto [f, p] = add_rms_cases(
        x, r, w, dh, dy, [](auto& a, auto& b, auto& c) { return K::add_rms_norm(a, b, c, 1e-5); },
        [](auto& a, auto& c) { return K::rms_norm(a, c, 1e-5); });
    const char* n = c10::toString(dt);
    EXPECT_TRUE(at::equal(f.h, p.h)) << n;
    EXPECT_TRUE(at::equal(f.y, p.y)) << n;
    EXPECT_TRUE(at::equal(f.dx, p.dx)) << n;
    EXPECT_TRUE(at::equal(f.dr, p.dr)) << n;
    EXPECT_TRUE(at::equal(f.dw, p.dw)) << n;
    // and the reference composite (ATen add + ATen norm) within the norm's own contract
    auto [hr, yr] = K::add_rms_norm_reference(x, r, w, 1e-5);
    EXPECT_TRUE(at::equal(f.h, hr)) << n;
    EXPECT_LE(excess(f.y, yr, dt == at::kFloat ? 4 * ulp(dt) : ulp(dt), 1e-30), 1.0) << n;
  }
  // Only one of the two outputs used: the other gradient is absent, not zero-filled garbage.
  at::Tensor x = at::randn({4, 64}).requires_grad_(true), r = at::randn({4, 64});
  at::Tensor w = at::ones({64});
  auto [hh, yy] = K::add_rms_norm(x, r, w, 1e-6);
  auto g = torch::autograd::grad({hh.sum()}, {x});
  EXPECT_TRUE(at::equal(g[0], at::ones({4, 64})));
  // bad shapes name the argument
  try {
    K::add_rms_norm(at::randn({4, 64}), at::randn({4, 63}), w, 1e-6);
    ADD_FAILURE() << "expected an InputError";
  } catch (const colossal::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("add_rms_norm: r"), std::string::npos) << e.what();
  }
}

// ---- Rotary ----
namespace {
struct RotaryCase {
  at::Tensor x, cos, sin;
};
// x as the attention projections produce it: [B, S, h, D] transposed to [B, h, S, D].
RotaryCase rotary_case(int64_t b, int64_t h, int64_t s, int64_t d, at::ScalarType dt,
                       bool broadcast_batch = false) {
  RotaryCase c;
  c.x = at::randn({b, s, h, d}).to(dt).transpose(1, 2);
  at::Tensor pos = at::arange(s, at::kFloat).unsqueeze(0).expand({broadcast_batch ? 1 : b, s}) +
                   at::randint(0, 100, {broadcast_batch ? 1 : b, 1}).to(at::kFloat);
  at::Tensor inv = at::pow(10000.0, -at::arange(0, d, 2, at::kFloat) / d);
  at::Tensor f = pos.unsqueeze(-1) * inv;
  at::Tensor emb = at::cat({f, f}, -1);
  c.cos = emb.cos().to(dt);
  c.sin = emb.sin().to(dt);
  return c;
}
}  // namespace

TEST(Rotary, ForwardEqualsReference) {
  for (auto dt : kTypes) {
    for (int64_t d : {64, 128}) {
      for (bool bc : {false, true}) {
        at::manual_seed(4);
        RotaryCase c = rotary_case(2, 5, 37, d, dt, bc);
        at::Tensor y = K::apply_rotary(c.x, c.cos, c.sin);
        at::Tensor r = K::apply_rotary_reference(c.x, c.cos, c.sin);
        ASSERT_EQ(y.sizes(), c.x.sizes());
        EXPECT_TRUE(y.transpose(1, 2).is_contiguous()) << "stored [B, S, h, D]";
        // Same roundings as the composite (each product, then the sum): bitwise.
        EXPECT_TRUE(at::equal(y, r))
            << c10::toString(dt) << " D=" << d << " excess " << excess(y, r, ulp(dt), 1e-30);
      }
    }
  }
}

TEST(Rotary, BackwardEqualsAutogradOfReference) {
  for (auto dt : kTypes) {
    at::manual_seed(5);
    RotaryCase c = rotary_case(3, 4, 29, 64, dt);
    at::Tensor dy = at::randn({3, 4, 29, 64}).to(dt);
    at::Tensor x = c.x.detach().clone().requires_grad_(true);
    at::Tensor xr = c.x.detach().clone().requires_grad_(true);
    at::Tensor dx = torch::autograd::grad({K::apply_rotary(x, c.cos, c.sin)}, {x}, {dy})[0];
    at::Tensor dxr =
        torch::autograd::grad({K::apply_rotary_reference(xr, c.cos, c.sin)}, {xr}, {dy})[0];
    EXPECT_TRUE(at::equal(dx, dxr))
        << c10::toString(dt) << " excess " << excess(dx, dxr, ulp(dt), 1e-30);
    // A strided (transposed) upstream gradient.
    at::Tensor dyt = at::randn({3, 29, 4, 64}).to(dt).transpose(1, 2);
    dx = torch::autograd::grad({K::apply_rotary(x, c.cos, c.sin)}, {x}, {dyt})[0];
    dxr = torch::autograd::grad({K::apply_rotary_reference(xr, c.cos, c.sin)}, {xr}, {dyt})[0];
    EXPECT_TRUE(at::equal(dx, dxr));
  }
}

TEST(Rotary, CosSinGradientsFallBackToTheComposite) {
  at::manual_seed(6);
  RotaryCase c = rotary_case(1, 2, 7, 64, at::kFloat);
  at::Tensor cs = c.cos.clone().requires_grad_(true);
  at::Tensor y = K::apply_rotary(c.x, cs, c.sin);
  at::Tensor g = torch::autograd::grad({y.sum()}, {cs})[0];
  EXPECT_TRUE(at::allclose(g, c.x.sum(1)));  // d(sum(x*cos))/dcos = sum over heads of x
}

// ---- SwiGLU ----
TEST(SwiGLU, ForwardAndBackwardMatchReference) {
  for (auto dt : kTypes) {
    at::manual_seed(7);
    at::Tensor g0 = (at::randn({3, 37, 5640}) * 3).to(dt), u0 = at::randn({3, 37, 5640}).to(dt);
    at::Tensor dy = at::randn({3, 37, 5640}).to(dt);
    at::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
    at::Tensor gr = g0.clone().requires_grad_(true), ur = u0.clone().requires_grad_(true);
    at::Tensor y = K::swiglu(g, u), yr = K::swiglu_reference(gr, ur);
    auto [dg, du] = grads_of(y, dy, g, u);
    auto [dgr, dur] = grads_of(yr, dy, gr, ur);
    std::printf("swiglu %s: y %.5f, dgate %.5f, dup %.5f bitwise equal\n", c10::toString(dt),
                frac_equal(y, yr), frac_equal(dg, dgr), frac_equal(du, dur));
    // Same rounding points as ATen; only exp() may differ by an ulp from ATen's vectorised one.
    // dgate = dy*up * silu'(gate) cancels near gate = -1.28 (silu' = 0), so its error is
    // bounded by the tensor's scale there: one ulp of the largest element.
    const double tol = dt == at::kFloat ? 8 * ulp(dt) : ulp(dt);
    EXPECT_LE(excess(y, yr, tol, 1e-30), 1.0);
    EXPECT_LE(excess(du, dur, tol, 1e-30), 1.0);
    EXPECT_LE(excess(dg, dgr, tol, ulp(dt) * max_abs(dgr)), 1.0);
    if (dt != at::kFloat) {
      EXPECT_GE(frac_equal(y, yr), 0.999);
    }
  }
}

// Packed gate/up: the same values as swiglu on the two halves, gradient packed.
TEST(SwiGLU, PackedEqualsSwiGLUOfTheHalves) {
  for (auto dt : kTypes) {
    at::manual_seed(8);
    const int64_t f = 1411;  // odd: no vector path on a GPU, nothing special here
    at::Tensor gu0 = (at::randn({2, 9, 2 * f}) * 3).to(dt), dy = at::randn({2, 9, f}).to(dt);
    at::Tensor gu = gu0.clone().requires_grad_(true);
    at::Tensor y = K::swiglu_packed(gu);
    at::Tensor dgu = torch::autograd::grad({y}, {gu}, {dy})[0];
    at::Tensor g = gu0.narrow(-1, 0, f).clone().requires_grad_(true);
    at::Tensor u = gu0.narrow(-1, f, f).clone().requires_grad_(true);
    at::Tensor yh = K::swiglu(g, u);
    auto [dg, du] = grads_of(yh, dy, g, u);
    EXPECT_TRUE(at::equal(y, yh)) << c10::toString(dt);
    EXPECT_TRUE(at::equal(dgu, at::cat({dg, du}, -1))) << c10::toString(dt);
    // And the ATen composite, within swiglu's contract.
    at::Tensor gr = gu0.clone().requires_grad_(true);
    at::Tensor yr = K::swiglu_packed_reference(gr);
    at::Tensor dgr = torch::autograd::grad({yr}, {gr}, {dy})[0];
    const double tol = dt == at::kFloat ? 8 * ulp(dt) : ulp(dt);
    EXPECT_LE(excess(y, yr, tol, 1e-30), 1.0);
    EXPECT_LE(excess(dgu, dgr, tol, ulp(dt) * max_abs(dgr)), 1.0);
    at::NoGradGuard ng;
    EXPECT_TRUE(at::equal(K::swiglu_packed(gu0), y));
  }
  EXPECT_THROW(K::swiglu_packed(at::randn({4, 7})), InputError);  // odd last dim
}

// ---- Softmax cross-entropy gradient ----
TEST(CrossEntropyGrad, MatchesTheComposite) {
  for (auto dt : kTypes) {
    for (bool with_scale : {false, true}) {
      at::manual_seed(10);
      const int64_t n = 37, V = dt == at::kFloat ? 32000 : 1003;  // a vocabulary-wide fp32 row
      at::Tensor x0 = (at::randn({n, V}) * 4).to(dt);
      at::Tensor t = at::randint(0, V, {n}, at::kLong);
      t.index_put_({at::arange(0, n, 5)}, -100);  // some ignored rows
      at::Tensor scale = with_scale ? at::full({}, 1.0 / 29, at::kFloat) : at::Tensor();
      at::Tensor x = x0.clone(), xr = x0.clone();
      at::Tensor loss = K::cross_entropy_grad_(x, t, -100, scale);
      at::Tensor lr = K::cross_entropy_grad_reference_(xr, t, -100, scale);
      const std::string what = std::string(c10::toString(dt)) + (with_scale ? " scaled" : "");
      // fp32 statistics both ways (max, sum of exp, log): a few fp32 ulp of the row's lse.
      EXPECT_LE(max_abs(loss - lr), 1e-5 * max_abs(lr)) << what;
      // The gradient differs only in the last rounding to the working dtype (exp(x - lse) vs
      // exp(log_softmax)): one ulp of the dtype relative to the largest gradient of the row
      // (the target's softmax - 1 is the largest in magnitude).
      // fp32: p = exp(x - lse) carries lse's rounding (|lse| ~ 10-20, summed in another order
      // than ATen's vectorised log_softmax): 8 ulp of lse, ~1e-5.
      const double tol = dt == at::kFloat ? 1e-5 : ulp(dt);
      EXPECT_LE(max_abs((x.to(at::kFloat) - xr.to(at::kFloat))),
                tol * max_abs(xr.to(at::kFloat)) + 1e-12)
          << what;
      EXPECT_EQ(max_abs(x.index({at::arange(0, n, 5)}).to(at::kFloat)), 0.0) << "ignored rows";
    }
  }
  at::Tensor x = at::randn({2, 5});
  EXPECT_THROW(K::cross_entropy_grad_(x, at::tensor({1, 7}, at::kLong), -100, {}), InputError);
  EXPECT_THROW(K::cross_entropy_grad_(x, at::tensor({1}, at::kLong), -100, {}), InputError);
}

// ---- Sum of squares (CPU: the ATen composite) ----
TEST(SumSquares, MatchesTheSumOfSquaresAndNamesBadArguments) {
  at::manual_seed(11);
  std::vector<at::Tensor> ts{at::randn({1000}), at::randn({7, 9}).to(at::kBFloat16),
                             at::randn({33}).to(at::kHalf)};
  double expect = 0;
  for (const auto& t : ts) expect += t.to(at::kDouble).square().sum().item<double>();
  EXPECT_NEAR(K::sum_squares(ts).item<double>(), expect, 1e-12 * expect);
  try {
    K::sum_squares({at::randn({3}), at::ones({2}, at::kLong)});
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tensors[1]"), std::string::npos) << e.what();
  }
}

// ---- Attention merge by log-sum-exp ----
// Two halves of the keys' attention, merged, give the attention over all keys (fp64 softmax of
// the concatenated scores); a row empty in both stays as it is; bad arguments are named.
TEST(AttentionMerge, TwoHalvesGiveTheWholeAttention) {
  at::manual_seed(21);
  const int64_t B = 2, H = 3, n = 5, D = 6, kn = 7;
  const at::Tensor q = at::randn({B, H, n, D}, at::kDouble),
                   k = at::randn({B, H, 2 * kn, D}, at::kDouble),
                   v = at::randn({B, H, 2 * kn, D}, at::kDouble);
  const at::Tensor s = at::matmul(q, k.transpose(-2, -1));
  const at::Tensor want = at::matmul(at::softmax(s, -1), v);
  auto half = [&](int64_t i) {
    const at::Tensor si = s.narrow(-1, i * kn, kn);
    const at::Tensor lse = at::logsumexp(si, -1);
    return std::pair{at::matmul(at::softmax(si, -1), v.narrow(2, i * kn, kn)), lse};
  };
  for (at::ScalarType part_dt : {at::kFloat, at::kBFloat16}) {
    // The running result starts empty (out 0, lse -inf); row 0 of batch 1, head 2 gets nothing.
    at::Tensor out = at::zeros({B, H, n, D});
    at::Tensor lse = at::full({B, H, n}, -INFINITY);
    for (int64_t i = 0; i < 2; ++i) {
      auto [o, l] = half(i);
      at::Tensor lf = l.to(at::kFloat);
      lf[1][2][0] = -INFINITY;
      K::attention_merge(out, lse, o.to(part_dt), lf);
    }
    const double tol = part_dt == at::kFloat ? 1e-6 : 8e-3;  // bf16 parts: 2^-8 each
    at::Tensor got = out.to(at::kDouble), w = want.clone();
    w[1][2][0].zero_();
    EXPECT_LT((got - w).abs().max().item<double>(), tol) << c10::toString(part_dt);
    EXPECT_TRUE(std::isinf(lse[1][2][0].item<float>()));
    at::Tensor lse_want = at::logsumexp(s, -1).to(at::kFloat);
    lse_want[1][2][0] = -INFINITY;
    EXPECT_TRUE(at::allclose(lse, lse_want, 1e-6, 1e-6));
  }
  // Strided views (a tokens-major running result) merge like contiguous ones.
  at::Tensor out_t = at::randn({B, n, H, D}).transpose(1, 2), lse_t = at::randn({B, H, n});
  at::Tensor out_c = out_t.contiguous(), lse_c = lse_t.clone();
  const at::Tensor part = at::randn({B, H, n, D}), part_lse = at::randn({B, H, n});
  K::attention_merge(out_t, lse_t, part, part_lse);
  K::attention_merge(out_c, lse_c, part, part_lse);
  EXPECT_TRUE(at::equal(out_t, out_c));
  EXPECT_TRUE(at::equal(lse_t, lse_c));
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no InputError naming " << needle;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { K::attention_merge(out_c.to(at::kBFloat16), lse_c, part, part_lse); },
               "out has dtype");
  expect_error([&] { K::attention_merge(out_c, lse_c, part.narrow(2, 0, 2), part_lse); },
               "part_out has shape");
  expect_error([&] { K::attention_merge(out_c, lse_c.narrow(2, 0, 2), part, part_lse); },
               "lse must be [B, H, n]");
  expect_error([&] { K::attention_merge(out_c, lse_c, part, part_lse.to(at::kDouble)); },
               "part_lse has dtype");
  expect_error(
      [&] {
        K::attention_merge(at::randn({B, H, D, n}).transpose(2, 3), lse_c, part, part_lse);
      },
      "unit last stride");
}

// ---- Concatenated linear ----
TEST(LinearConcat, EqualsSeparateLinearsAndTheirGradients) {
  // Thin weights run as one GEMM against the concatenation; wide ones (>= 1024 rows) as one
  // GEMM per weight into column blocks of the output: both paths.
  for (auto [bias, wide] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    at::manual_seed(9);
    const int64_t r0 = wide ? 1100 : 16, r1 = wide ? 1030 : 4;
    at::Tensor x0 = at::randn({3, 5, 24});
    std::vector<at::Tensor> w0{at::randn({r0, 24}), at::randn({r1, 24}), at::randn({r1, 24})}, b0;
    if (bias) b0 = {at::randn({r0}), at::randn({r1}), at::randn({r1})};
    auto leaves = [](const std::vector<at::Tensor>& ts) {
      std::vector<at::Tensor> out;
      for (const auto& t : ts) out.push_back(t.clone().requires_grad_(true));
      return out;
    };
    at::Tensor x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);
    std::vector<at::Tensor> w = leaves(w0), wr = leaves(w0), b = leaves(b0), br = leaves(b0);
    at::Tensor y = K::linear_concat(x, w, b), yr = K::linear_concat_reference(xr, wr, br);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, r0 + 2 * r1}));
    EXPECT_LE(excess(y, yr, 1e-5, 1e-5), 1.0);
    at::Tensor dy = at::randn(y.sizes());
    std::vector<at::Tensor> in{x}, inr{xr};
    for (size_t i = 0; i < w.size(); ++i) in.push_back(w[i]), inr.push_back(wr[i]);
    for (size_t i = 0; i < b.size(); ++i) in.push_back(b[i]), inr.push_back(br[i]);
    auto g = torch::autograd::grad({y}, in, {dy}), gr = torch::autograd::grad({yr}, inr, {dy});
    ASSERT_EQ(g.size(), gr.size());
    for (size_t i = 0; i < g.size(); ++i) {
      ASSERT_EQ(g[i].sizes(), gr[i].sizes()) << "input " << i;
      EXPECT_LE(excess(g[i], gr[i], 1e-5, 1e-5), 1.0)
          << "input " << i << " bias " << bias << " wide " << wide;
    }
  }
  // A frozen weight gets no gradient and the others are still right.
  at::Tensor x = at::randn({6, 8}).requires_grad_(true);
  at::Tensor w1 = at::randn({3, 8}), w2 = at::randn({5, 8}).requires_grad_(true);
  at::Tensor y = K::linear_concat(x, {w1, w2});
  at::Tensor dw2 = torch::autograd::grad({y.sum()}, {w2})[0];
  EXPECT_TRUE(at::allclose(dw2, at::ones({6, 5}).t().mm(x.detach())));
  // Errors name the argument.
  try {
    K::linear_concat(at::randn({2, 8}), {at::randn({3, 8}), at::randn({3, 7})});
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("weights[1]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(
      K::linear_concat(at::randn({2, 8}), {at::randn({3, 8})}, {at::randn({3}), at::randn({3})}),
      InputError);
}

// ---- AdamW ----
namespace {
struct AdamState {
  std::vector<at::Tensor> p, g, m, v, w;
};
AdamState adam_state(const std::vector<int64_t>& sizes, at::ScalarType gdt, at::ScalarType wdt,
                     uint64_t seed) {
  at::manual_seed(seed);
  AdamState s;
  for (int64_t n : sizes) {
    s.p.push_back(at::randn({n}));
    s.g.push_back(at::randn({n}).to(gdt));
    s.m.push_back(at::randn({n}) * 0.1);
    s.v.push_back(at::rand({n}) * 0.01);
    if (wdt != at::kFloat) s.w.push_back(at::empty({n}, at::TensorOptions().dtype(wdt)));
  }
  return s;
}
std::vector<at::Tensor> clone(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}
// torch.optim.AdamW(fused=True)'s kernel on fp32 clones of the state (grads upcast).
void aten_fused_adamw(AdamState& s, const K::AdamWStep& h) {
  std::vector<at::Tensor> g, steps;
  for (const auto& t : s.g) g.push_back(t.to(at::kFloat));
  for (size_t i = 0; i < s.p.size(); ++i)
    steps.push_back(at::full({}, static_cast<double>(h.step), at::kFloat));
  std::optional<at::Tensor> scale;
  if (h.grad_divisor != 1.0) scale = at::full({}, h.grad_divisor, at::kFloat);
  at::_fused_adamw_(s.p, g, s.m, s.v, {}, steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                    false, false, scale, std::nullopt);
  for (size_t i = 0; i < s.w.size(); ++i) s.w[i].copy_(s.p[i]);
}
}  // namespace

TEST(FusedAdamW, MatchesATenFusedAdamW) {
  const std::vector<int64_t> sizes = {4104 * 3, 1, 7, 1000, (1 << 20) + 3};
  struct Case {
    at::ScalarType g, w;
  };
  for (Case c : {Case{at::kFloat, at::kFloat}, Case{at::kBFloat16, at::kBFloat16},
                 Case{at::kHalf, at::kHalf}, Case{at::kFloat, at::kBFloat16}}) {
    AdamState ours = adam_state(sizes, c.g, c.w, 8);
    AdamState ref = ours;
    ref.p = clone(ours.p);
    ref.m = clone(ours.m);
    ref.v = clone(ours.v);
    ref.w = clone(ours.w);
    for (int64_t step = 1; step <= 3; ++step) {
      K::AdamWStep h;
      h.lr = 1e-3;
      h.weight_decay = 0.1;
      h.step = step;
      h.grad_divisor = step == 2 ? 4.0 : 1.0;
      K::fused_adamw(ours.p, ours.g, ours.m, ours.v, ours.w, h);
      aten_fused_adamw(ref, h);
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      // Same fp32 operations as ATen's CPU kernel, including the multiply-add its vector loop
      // contracts: bitwise in practice; the bound allows a few ulp of |p| and of the update.
      EXPECT_LE(excess(ours.p[i], ref.p[i], 4 * ulp(at::kFloat), 1e-5 * 1e-3), 1.0)
          << "params " << i << " max diff " << max_abs(ours.p[i] - ref.p[i]) << " m "
          << max_abs(ours.m[i] - ref.m[i]) << " v " << max_abs(ours.v[i] - ref.v[i]);
      // m and v: a few ulp of each element, or of the tensor's scale where they cancel to ~0.
      EXPECT_LE(
          excess(ours.m[i], ref.m[i], 4 * ulp(at::kFloat), 4 * ulp(at::kFloat) * max_abs(ref.m[i])),
          1.0)
          << "exp_avg " << i;
      EXPECT_LE(
          excess(ours.v[i], ref.v[i], 4 * ulp(at::kFloat), 4 * ulp(at::kFloat) * max_abs(ref.v[i])),
          1.0)
          << "exp_avg_sq " << i;
      if (!ours.w.empty()) {
        EXPECT_LE(excess(ours.w[i], ref.w[i], ulp(c.w), 1e-12), 1.0) << "working " << i;
        EXPECT_GE(frac_equal(ours.w[i], ref.w[i]), 0.999);
      }
    }
    std::printf("fused_adamw grads %s working %s: params %.5f bitwise equal\n", c10::toString(c.g),
                c10::toString(c.w), frac_equal(ours.p.back(), ref.p.back()));
    EXPECT_GE(frac_equal(ours.p.back(), ref.p.back()), 0.99);
  }
}

TEST(FusedAdamW, ReferenceMatchesATen) {
  AdamState ours = adam_state({1000, 33}, at::kBFloat16, at::kBFloat16, 9);
  AdamState ref = ours;
  ref.p = clone(ours.p);
  ref.m = clone(ours.m);
  ref.v = clone(ours.v);
  ref.w = clone(ours.w);
  K::AdamWStep h;
  h.lr = 3e-4;
  h.weight_decay = 0.01;
  h.step = 5;
  h.grad_divisor = 2.0;
  K::fused_adamw_reference(ours.p, ours.g, ours.m, ours.v, ours.w, h);
  aten_fused_adamw(ref, h);
  for (size_t i = 0; i < 2; ++i) EXPECT_LE(excess(ours.p[i], ref.p[i], 1e-6, 1e-9), 1.0);
}

// ---- errors ----
namespace {
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no error";
}
}  // namespace

// The fp64 attention oracle (issue 25's GPU tests compare against it): per document, SDPA's math
// on that document alone (causal and full, GQA heads expanded), its gradients too; the log-sum-
// exp normalises every query's probabilities, and a document's first token attends only itself.
TEST(AttentionReference, EqualsSdpaPerDocument) {
  at::manual_seed(3);
  const std::vector<int64_t> lens{5, 1, 9, 0};
  const int64_t t = 15, h = 4, hkv = 2, d = 8;
  at::Tensor cu = at::tensor({int64_t(0), int64_t(5), int64_t(6), int64_t(15), int64_t(15)});
  auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({t, h, d}, opt).requires_grad_(), k = at::randn({t, hkv, d}, opt),
             v = at::randn({t, hkv, d}, opt);
  k.requires_grad_();
  v.requires_grad_();
  for (bool causal : {true, false}) {
    K::AttentionReference r = K::attention_reference(q, k, v, cu, causal);
    ASSERT_EQ(r.out.sizes(), q.sizes());
    ASSERT_EQ(r.lse.sizes(), (std::vector<int64_t>{h, t}));
    at::Tensor g = at::randn_like(r.out);
    auto ref = torch::autograd::grad({r.out}, {q, k, v}, {g});
    at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    int64_t a = 0;
    for (int64_t len : lens) {
      if (len == 0) continue;
      auto part = [&](const at::Tensor& x) {
        return x.narrow(0, a, len).detach().permute({1, 0, 2}).unsqueeze(0).requires_grad_();
      };
      at::Tensor qd = part(q), kd = part(k), vd = part(v);
      at::Tensor o = at::scaled_dot_product_attention(qd, kd.repeat_interleave(h / hkv, 1),
                                                      vd.repeat_interleave(h / hkv, 1),
                                                      std::nullopt, 0.0, causal);
      at::Tensor mine = r.out.narrow(0, a, len).permute({1, 0, 2}).unsqueeze(0);
      EXPECT_LT((o - mine).abs().max().item<double>(), 1e-12) << "document at " << a;
      auto gd = torch::autograd::grad({o}, {qd, kd, vd},
                                      {g.narrow(0, a, len).permute({1, 0, 2}).unsqueeze(0)});
      dq.narrow(0, a, len).copy_(gd[0].squeeze(0).permute({1, 0, 2}));
      dk.narrow(0, a, len).copy_(gd[1].squeeze(0).permute({1, 0, 2}));
      dv.narrow(0, a, len).copy_(gd[2].squeeze(0).permute({1, 0, 2}));
      if (causal) {  // the first token sees only itself: lse = its own scaled score
        at::Tensor self = (q[a] * k[a].repeat_interleave(h / hkv, 0)).sum(-1) / std::sqrt(8.0);
        EXPECT_LT((r.lse.select(1, a) - self).abs().max().item<double>(), 1e-12);
      }
      a += len;
    }
    EXPECT_LT((ref[0] - dq).abs().max().item<double>(), 1e-10);
    EXPECT_LT((ref[1] - dk).abs().max().item<double>(), 1e-10);
    EXPECT_LT((ref[2] - dv).abs().max().item<double>(), 1e-10);
  }
  auto err = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(err([&] {
              K::attention_reference(q, k, v, at::tensor({int64_t(0), int64_t(9)}), true);
            }).find("must run from 0 to 15"),
            std::string::npos);
  EXPECT_NE(err([&] {
              K::attention_reference(q, k.narrow(1, 0, 1).repeat({1, 3, 1}), v, cu, true);
            }).find("k and v must be"),
            std::string::npos);
  EXPECT_NE(
      err([&] {
        K::attention_reference(q, at::randn({t, 3, d}, opt), at::randn({t, 3, d}, opt), cu, true);
      }).find("4 query heads are not a multiple of 3 kv heads"),
      std::string::npos);
}

// The oracle with keys of their own lengths (the kernels' cross-length form, one ring block):
// per sequence, SDPA's full attention of its queries over its keys alone (more keys than queries
// and fewer, a sequence of one query, GQA), its gradients too; unequal lengths under causal, a
// sequence with queries but no keys and mismatched sequence counts are InputErrors.
TEST(AttentionReference, CrossLengthsEqualSdpaPerSequence) {
  at::manual_seed(4);
  const std::vector<int64_t> lq{6, 1, 3, 0}, lk{2, 7, 3, 4};
  const int64_t h = 4, hkv = 2, d = 8;
  std::vector<int64_t> cq{0}, ck{0};
  for (size_t i = 0; i < lq.size(); ++i) {
    cq.push_back(cq.back() + lq[i]);
    ck.push_back(ck.back() + lk[i]);
  }
  auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({cq.back(), h, d}, opt).requires_grad_();
  at::Tensor k = at::randn({ck.back(), hkv, d}, opt).requires_grad_();
  at::Tensor v = at::randn({ck.back(), hkv, d}, opt).requires_grad_();
  const at::Tensor cu_q = at::tensor(cq), cu_k = at::tensor(ck);
  K::AttentionReference r = K::attention_reference(q, k, v, cu_q, cu_k, false);
  ASSERT_EQ(r.out.sizes(), q.sizes());
  ASSERT_EQ(r.lse.sizes(), (std::vector<int64_t>{h, cq.back()}));
  const at::Tensor g = at::randn_like(r.out);
  auto ref = torch::autograd::grad({r.out}, {q, k, v}, {g});
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  for (size_t i = 0; i < lq.size(); ++i) {
    if (lq[i] == 0) continue;
    auto part = [](const at::Tensor& x, int64_t a, int64_t n) {
      return x.narrow(0, a, n).detach().permute({1, 0, 2}).unsqueeze(0).requires_grad_();
    };
    at::Tensor qs = part(q, cq[i], lq[i]), ks = part(k, ck[i], lk[i]), vs = part(v, ck[i], lk[i]);
    at::Tensor o = at::scaled_dot_product_attention(qs, ks.repeat_interleave(h / hkv, 1),
                                                    vs.repeat_interleave(h / hkv, 1));
    EXPECT_LT((o - r.out.narrow(0, cq[i], lq[i]).permute({1, 0, 2}).unsqueeze(0))
                  .abs()
                  .max()
                  .item<double>(),
              1e-12)
        << "sequence " << i;
    auto gd = torch::autograd::grad({o}, {qs, ks, vs},
                                    {g.narrow(0, cq[i], lq[i]).permute({1, 0, 2}).unsqueeze(0)});
    dq.narrow(0, cq[i], lq[i]).copy_(gd[0].squeeze(0).permute({1, 0, 2}));
    dk.narrow(0, ck[i], lk[i]).copy_(gd[1].squeeze(0).permute({1, 0, 2}));
    dv.narrow(0, ck[i], lk[i]).copy_(gd[2].squeeze(0).permute({1, 0, 2}));
  }
  EXPECT_LT((ref[0] - dq).abs().max().item<double>(), 1e-10);
  EXPECT_LT((ref[1] - dk).abs().max().item<double>(), 1e-10);  // sequence 3's keys: 0
  EXPECT_LT((ref[2] - dv).abs().max().item<double>(), 1e-10);
  // Equal lengths give the self-attention form's result, causal too.
  const at::Tensor cu = at::tensor({int64_t(0), int64_t(4), int64_t(10)});
  const at::Tensor qq = q.detach().narrow(0, 0, 10), kk = at::randn({10, hkv, d}, opt),
                   vv = at::randn({10, hkv, d}, opt);
  EXPECT_TRUE(at::equal(K::attention_reference(qq, kk, vv, cu, cu, true).out,
                        K::attention_reference(qq, kk, vv, cu, true).out));
  EXPECT_NE(error_of([&] {
              K::attention_reference(q, k, v, cu_q, cu_k, true);
            }).find("causal sequence 0 has 6 queries and 2 keys"),
            std::string::npos);
  const at::Tensor two = at::tensor({int64_t(0), int64_t(10), int64_t(16)});
  EXPECT_NE(error_of([&] {
              K::attention_reference(q, k, v, cu_q, two, false);
            }).find("4 query sequences against 2 key sequences"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              K::attention_reference(q, k, v, at::tensor({int64_t(0), int64_t(10), int64_t(10)}),
                                     at::tensor({int64_t(0), int64_t(0), int64_t(16)}), false);
            }).find("sequence 0 has 10 queries and no keys"),
            std::string::npos);
}

TEST(Errors, NameTheBadArgument) {
  at::Tensor x = at::randn({4, 8});
  EXPECT_NE(error_of([&] { K::rms_norm(x, at::ones({7}), 1e-6); }).find("weight has shape"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              K::rms_norm(x, at::ones({8}, at::kBFloat16), 1e-6);
            }).find("weight has dtype"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              K::rms_norm(x.to(at::kLong), at::ones({8}, at::kLong), 1e-6);
            }).find("x has dtype"),
            std::string::npos);
  at::Tensor q = at::randn({1, 2, 3, 8});
  EXPECT_NE(error_of([&] {
              K::apply_rotary(q, at::ones({1, 4, 8}), at::ones({1, 3, 8}));
            }).find("cos has shape"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              K::apply_rotary(at::randn({1, 2, 3, 7}), at::ones({1, 3, 7}), at::ones({1, 3, 7}));
            }).find("must be even"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              K::swiglu(at::randn({4, 8}), at::randn({4, 9}));
            }).find("up has shape"),
            std::string::npos);

  AdamState s = adam_state({5, 6, 7}, at::kFloat, at::kBFloat16, 10);
  K::AdamWStep h;
  auto adam_error = [&](AdamState t) {
    return error_of([&] { K::fused_adamw(t.p, t.g, t.m, t.v, t.w, h); });
  };
  AdamState bad = s;
  bad.g[2] = at::randn({8});
  EXPECT_NE(adam_error(bad).find("grads[2] has shape"), std::string::npos) << adam_error(bad);
  bad = s;
  bad.m[1] = bad.m[1].to(at::kBFloat16);
  EXPECT_NE(adam_error(bad).find("exp_avgs[1] must be contiguous float32"), std::string::npos);
  bad = s;
  bad.v[0] = at::empty({5}, at::TensorOptions().device(at::kMeta));
  EXPECT_NE(adam_error(bad).find("exp_avg_sqs[0] is on meta"), std::string::npos)
      << adam_error(bad);
  bad = s;
  bad.w.pop_back();
  EXPECT_NE(adam_error(bad).find("working has 2 tensors"), std::string::npos);
  bad = s;
  bad.g.pop_back();
  EXPECT_NE(adam_error(bad).find("list lengths differ"), std::string::npos);
  bad = s;
  bad.p[1] = at::randn({12}).narrow(0, 0, 6).view({6});
  bad.p[1] = at::randn({6, 2}).select(1, 0);
  EXPECT_NE(adam_error(bad).find("params[1] must be contiguous float32"), std::string::npos);
  h.step = 0;
  EXPECT_NE(adam_error(s).find("step must be >= 1"), std::string::npos);
}

TEST(Dispatch, DevicesWithoutKernelsRunTheReference) {
  EXPECT_TRUE(K::has_fused_kernels(at::ones({1})));
  at::Tensor x = at::empty({3, 16}, at::TensorOptions().device(at::kMeta));
  EXPECT_FALSE(K::has_fused_kernels(x));
  at::Tensor y = K::rms_norm(x, at::empty({16}, x.options()), 1e-6);  // the composite, on meta
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(K::swiglu(x, x).device().type(), at::kMeta);
}
