// Issue 25's attention kernels on the GPU (device calls; skipped without an sm_90 device or a
// build without the sm_90a kernels) against kernels::attention_reference, the fp64 composite,
// on fresh random inputs: every supported head dim, causal and full, GQA ratios 1 / 4 / 8,
// odd sequence lengths (1, 127, 2049), packed documents (of length 1 too), an output buffer
// poisoned with NaN (every row the kernel owns must be written).
//
// Tolerance: the kernel rounds P to bf16 before the P V product (relative error 2^-9 per
// element) and writes bf16 (2^-9); q, k, v are the same bf16 values on both sides. The
// norm-wise relative error of the output is then a few 2^-9 = 2e-3 at most: bound 1e-2. The
// log-sum-exp is fp32 from fp32 scores: absolute error within 1e-3 (scores of order 10).
// Backward: P^T and dS^T are rounded to bf16 before their GEMMs (2^-9 each) and dQ, dK, dV are
// written in bf16 (2^-9); dQ sums fp32 partials of up to 17 key tiles. Norm-wise relative
// error bound 2e-2 (a few times the 2^-9 = 2e-3 per-element rounding).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "colossal/kernels/attention.h"
#include "colossal/kernels/attention_reference.h"
#include "colossal/kernels/fp8.h"

namespace colossal::kernels {
namespace {

bool usable(std::string* why) {
  if (!at::hasCUDA()) {
    *why = "no CUDA device";
    return false;
  }
  at::Tensor probe =
      at::empty({1, 1, 64}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  *why = own_attention_unsupported(probe, probe);
  return why->empty();
}

struct Case {
  std::vector<int64_t> lens;
  int64_t heads, kv_heads, dim;
  bool causal;
};

std::string name(const Case& c) {
  std::string s = "D" + std::to_string(c.dim) + " h" + std::to_string(c.heads) + "/" +
                  std::to_string(c.kv_heads) + (c.causal ? " causal" : " full") + " lens";
  for (int64_t l : c.lens) s += " " + std::to_string(l);
  return s;
}

void check_case(const Case& c) {
  SCOPED_TRACE(name(c));
  std::vector<int64_t> cu{0};
  for (int64_t l : c.lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back();
  auto bf = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor q = at::randn({T, c.heads, c.dim}, bf);
  at::Tensor k = at::randn({T, c.kv_heads, c.dim}, bf);
  at::Tensor v = at::randn({T, c.kv_heads, c.dim}, bf);
  at::Tensor cu_t = at::tensor(cu, at::kLong);
  at::Tensor out = at::full({T, c.heads, c.dim}, NAN, bf);
  set_fp8_amax_capture(true);  // the kernel records max |out| for an FP8 o_proj's cast
  AttentionResult r = attention_forward(q, k, v, cu_t.to(at::kCUDA), 0, c.causal, 0, out);
  set_fp8_amax_capture(false);
  ASSERT_TRUE(r.out.is_same(out));
  ASSERT_TRUE(known_fp8_amax(r.out).defined());
  EXPECT_EQ(known_fp8_amax(r.out).item<float>(), r.out.abs().max().to(at::kFloat).item<float>());
  AttentionReference ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), cu_t, c.causal);
  at::Tensor o = r.out.cpu().to(at::kDouble);
  ASSERT_FALSE(o.isnan().any().item<bool>()) << "rows left unwritten (NaN poison) or NaN results";
  const double err = ((o - ref.out).norm() / ref.out.norm()).item<double>();
  const double lse_err = (r.lse.cpu().to(at::kDouble) - ref.lse).abs().max().item<double>();
  EXPECT_LE(err, 1e-2);
  EXPECT_LE(lse_err, 1e-3);
  std::printf("%-48s out %.2e  lse %.2e\n", name(c).c_str(), err, lse_err);
}

TEST(AttentionCuda, ForwardEqualsTheFp64Reference) {
  std::string why;
  if (!usable(&why)) GTEST_SKIP() << why;
  at::manual_seed(25);
  for (int64_t dim : {64, 128})
    for (bool causal : {true, false}) {
      check_case({{2049}, 4, 4, dim, causal});               // odd length, MHA
      check_case({{127, 1, 300}, 8, 2, dim, causal});        // documents of length 1 and odd, GQA 4
      check_case({{1}, 8, 1, dim, causal});                  // one token, MQA 8
      check_case({{256, 128, 513, 7}, 16, 2, dim, causal});  // GQA 8, tile-aligned and not
    }
}

void check_backward(const Case& c, bool deterministic) {
  SCOPED_TRACE(name(c) + (deterministic ? " deterministic" : ""));
  std::vector<int64_t> cu{0};
  for (int64_t l : c.lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back();
  auto bf = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor q = at::randn({T, c.heads, c.dim}, bf).requires_grad_();
  at::Tensor k = at::randn({T, c.kv_heads, c.dim}, bf).requires_grad_();
  at::Tensor v = at::randn({T, c.kv_heads, c.dim}, bf).requires_grad_();
  at::Tensor dy = at::randn({T, c.heads, c.dim}, bf);
  at::Tensor cu_t = at::tensor(cu, at::kLong);
  at::Tensor y = attention(q, k, v, cu_t.to(at::kCUDA), 0, c.causal, 0, deterministic);
  y.backward(dy);
  at::Tensor qr = q.detach().cpu().to(at::kDouble).requires_grad_();
  at::Tensor kr = k.detach().cpu().to(at::kDouble).requires_grad_();
  at::Tensor vr = v.detach().cpu().to(at::kDouble).requires_grad_();
  AttentionReference ref = attention_reference(qr, kr, vr, cu_t, c.causal);
  ref.out.backward(dy.cpu().to(at::kDouble));
  auto nrel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.cpu().to(at::kDouble) - b).norm() / b.norm()).item<double>();
  };
  for (const at::Tensor* g : {&q.grad(), &k.grad(), &v.grad()})
    ASSERT_FALSE(g->isnan().any().item<bool>()) << "NaN in a gradient";
  const double eq = nrel(q.grad(), qr.grad()), ek = nrel(k.grad(), kr.grad()),
               ev = nrel(v.grad(), vr.grad());
  EXPECT_LE(eq, 2e-2);
  EXPECT_LE(ek, 2e-2);
  EXPECT_LE(ev, 2e-2);
  std::printf("%-48s dq %.2e  dk %.2e  dv %.2e%s\n", name(c).c_str(), eq, ek, ev,
              deterministic ? " (deterministic)" : "");
  if (deterministic) {  // bitwise repeatable
    at::Tensor dq1 = q.grad().clone(), dk1 = k.grad().clone(), dv1 = v.grad().clone();
    q.grad().zero_();
    k.grad().zero_();
    v.grad().zero_();
    attention(q, k, v, cu_t.to(at::kCUDA), 0, c.causal, 0, true).backward(dy);
    EXPECT_TRUE(at::equal(dq1, q.grad()));
    EXPECT_TRUE(at::equal(dk1, k.grad()));
    EXPECT_TRUE(at::equal(dv1, v.grad()));
  }
}

TEST(AttentionCuda, BackwardEqualsTheFp64Reference) {
  std::string why;
  if (!usable(&why)) GTEST_SKIP() << why;
  at::manual_seed(26);
  for (int64_t dim : {64, 128})
    for (bool causal : {true, false}) {
      check_backward({{2049}, 4, 4, dim, causal}, false);
      check_backward({{127, 1, 300}, 8, 2, dim, causal}, false);
      check_backward({{1}, 8, 1, dim, causal}, false);
      check_backward({{256, 128, 513, 7}, 16, 2, dim, causal}, true);
    }
}

// Runs everywhere (make test too): off an sm_90 device, or in a build without the kernels, the
// op says why instead of computing anything, and the dispatcher gets the same reason.
TEST(AttentionCuda, SaysWhyItDoesNotRunOnTheCpu) {
  at::Tensor q = at::randn({8, 4, 64}).to(at::kBFloat16),
             k = at::randn({8, 2, 64}).to(at::kBFloat16);
  at::Tensor cu = at::tensor(std::vector<int64_t>{0, 8}, at::kLong);
  const std::string why = own_attention_unsupported(q, k);
  EXPECT_FALSE(why.empty());
  try {
    attention_forward(q, k, k, cu, 0, true);
    ADD_FAILURE() << "attention_forward ran on the CPU";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

TEST(AttentionCuda, NamedErrors) {
  std::string why;
  if (!usable(&why)) GTEST_SKIP() << why;
  auto bf = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor q = at::randn({8, 4, 64}, bf), k = at::randn({8, 3, 64}, bf);
  at::Tensor cu = at::tensor(std::vector<int64_t>{0, 8}, at::kLong);
  EXPECT_THROW(attention_forward(q, k, k, cu, 0, true), std::exception);  // 4 heads, 3 kv heads
  at::Tensor k2 = at::randn({8, 2, 64}, bf);
  at::Tensor bad = at::tensor(std::vector<int64_t>{0, 5}, at::kLong);
  EXPECT_THROW(attention_forward(q, k2, k2, bad, 0, true), std::exception);  // does not end at T
  at::Tensor q96 = at::randn({8, 4, 96}, bf), k96 = at::randn({8, 2, 96}, bf);
  EXPECT_FALSE(own_attention_unsupported(q96, k96).empty());
  EXPECT_THROW(attention_forward(q96, k96, k96, cu, 0, true), std::exception);
}

}  // namespace
}  // namespace colossal::kernels
