// Issue 25's attention kernels on the GPU (device calls; skipped without an sm_90 device or a
// build without the sm_90a kernels) against kernels::attention_reference, the fp64 composite,
// on fresh random inputs: every supported head dim, causal and full, GQA ratios 1 / 4 / 8,
// odd sequence lengths (1, 127, 2049), packed documents (of length 1 too), an output buffer
// poisoned with NaN (every row the kernel owns must be written); every schedule
// (AttentionSchedule): the forward's schedules run the same arithmetic in the same order, so
// their outputs must be bitwise equal; the backward's dQ paths differ only in the order of the
// fp32 dQ additions, so dK and dV must be bitwise equal and dQ within the bound.
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

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/kernels/attention.h"
#include "colossal/kernels/attention_reference.h"
#include "colossal/kernels/fp8.h"

namespace colossal::kernels {
namespace {

// After a launch that a hung wait stopped (the kernels trap instead of hanging), say which wait.
class HangReport : public ::testing::Environment {
 public:
  void TearDown() override {
    const std::string hang = attention_hang_report();
    if (!hang.empty()) ADD_FAILURE() << hang;
  }
};
const auto* const hang_report = ::testing::AddGlobalTestEnvironment(new HangReport);

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

// Runs body under each schedule in turn, each in five launch orders: the process's L2 budget
// and backward interleave (these small cases: all heads in one section), then a 1-byte budget
// (sections of one kv head: the CTAs of tile_and_head's other branch) with the backward's
// sections one after another (interleave 0), half interleaved, heaviest first across sections
// (100) and the automatic choice; then restores the process's schedule, budget and interleave.
template <class F>
void for_each_schedule(const std::vector<AttentionSchedule>& schedules, F&& body) {
  const AttentionSchedule saved = attention_schedule();
  const int64_t saved_budget = attention_l2_budget();
  const int64_t saved_interleave = attention_bwd_interleave();
  const std::vector<std::pair<int64_t, int64_t>> orders{{saved_budget, saved_interleave},
                                                        {1, 0},
                                                        {1, 50},
                                                        {1, 100},
                                                        {1, kAttentionBwdInterleaveAuto}};
  for (const AttentionSchedule& s : schedules)
    for (const auto& [budget, interleave] : orders) {
      set_attention_schedule(s);
      set_attention_l2_budget(budget);
      set_attention_bwd_interleave(interleave);
      SCOPED_TRACE("schedule " + to_string(s) + ", L2 budget " + std::to_string(budget) +
                   ", backward interleave " + std::to_string(interleave));
      body(s);
    }
  set_attention_schedule(saved);
  set_attention_l2_budget(saved_budget);
  set_attention_bwd_interleave(saved_interleave);
}

// The forward's schedules (the dQ path is the backward's).
std::vector<AttentionSchedule> forward_schedules() {
  std::vector<AttentionSchedule> v;
  for (const AttentionSchedule& s : attention_schedules())
    if (!s.dq_tma) v.push_back(s);
  return v;
}

// Where a result is wrong, for a failure's message: the worst (token, head) pairs by absolute
// error with the token's sequence and position in it (and that position mod 64 and 128, the
// kernels' tile sizes), so a failure points at a tile edge, a sequence end or a head group.
std::string worst_rows(const at::Tensor& got, const at::Tensor& want,
                       const std::vector<int64_t>& cu, int count = 3) {
  const at::Tensor err = (got.cpu().to(at::kDouble) - want.cpu().to(at::kDouble)).abs();
  const at::Tensor per = err.dim() == 3 ? std::get<0>(err.max(2)) : err;  // [T, H] or [H, T]
  const int64_t heads = got.dim() == 3 ? got.size(1) : got.size(0);
  const at::Tensor flat = per.reshape({-1});
  const auto top = at::topk(flat, std::min<int64_t>(count, flat.numel()));
  std::string s;
  for (int64_t i = 0; i < std::get<1>(top).numel(); ++i) {
    const int64_t idx = std::get<1>(top)[i].item<int64_t>();
    const int64_t t = got.dim() == 3 ? idx / heads : idx % got.size(1);
    const int64_t h = got.dim() == 3 ? idx % heads : idx / got.size(1);
    size_t seq = 0;
    while (seq + 2 < cu.size() && cu[seq + 1] <= t) ++seq;
    const int64_t pos = t - cu[seq];
    s += "\n  token " + std::to_string(t) + " head " + std::to_string(h) + ": sequence " +
         std::to_string(seq) + " (length " + std::to_string(cu[seq + 1] - cu[seq]) + ") position " +
         std::to_string(pos) + " (mod 64: " + std::to_string(pos % 64) +
         ", mod 128: " + std::to_string(pos % 128) + "), |error| " +
         std::to_string(std::get<0>(top)[i].item<double>());
  }
  return s;
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
  AttentionReference ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), cu_t, c.causal);
  at::Tensor first_out, first_lse;
  for_each_schedule(forward_schedules(), [&](const AttentionSchedule& s) {
    at::Tensor out = at::full({T, c.heads, c.dim}, NAN, bf);
    set_fp8_amax_capture(true);  // the kernel records max |out| for an FP8 o_proj's cast
    AttentionResult r = attention_forward(q, k, v, cu_t.to(at::kCUDA), 0, c.causal, 0, out);
    set_fp8_amax_capture(false);
    ASSERT_TRUE(r.out.is_same(out));
    ASSERT_TRUE(known_fp8_amax(r.out).defined());
    EXPECT_EQ(known_fp8_amax(r.out).item<float>(), r.out.abs().max().to(at::kFloat).item<float>());
    at::Tensor o = r.out.cpu().to(at::kDouble);
    ASSERT_FALSE(o.isnan().any().item<bool>()) << "rows left unwritten (NaN poison) or NaN results";
    const double err = ((o - ref.out).norm() / ref.out.norm()).item<double>();
    const double lse_err = (r.lse.cpu().to(at::kDouble) - ref.lse).abs().max().item<double>();
    EXPECT_LE(err, 1e-2) << worst_rows(r.out, ref.out, cu);
    EXPECT_LE(lse_err, 1e-3) << worst_rows(r.lse, ref.lse, cu);
    if (!first_out.defined()) {
      first_out = r.out;
      first_lse = r.lse;
    } else {  // the same arithmetic in the same order as the plain schedule
      EXPECT_TRUE(at::equal(first_out, r.out)) << "output differs from the plain schedule's";
      EXPECT_TRUE(at::equal(first_lse, r.lse)) << "lse differs from the plain schedule's";
    }
    std::printf("%-48s %-9s out %.2e  lse %.2e\n", name(c).c_str(), to_string(s).c_str(), err,
                lse_err);
    std::fflush(stdout);  // a hang's log shows how far the cases got
  });
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
      check_case({{2049, 1000}, 16, 2, dim, causal});  // 400 items: several per persistent CTA
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
  at::Tensor qr = q.detach().cpu().to(at::kDouble).requires_grad_();
  at::Tensor kr = k.detach().cpu().to(at::kDouble).requires_grad_();
  at::Tensor vr = v.detach().cpu().to(at::kDouble).requires_grad_();
  AttentionReference ref = attention_reference(qr, kr, vr, cu_t, c.causal);
  ref.out.backward(dy.cpu().to(at::kDouble));
  // Relative error in the 2-norm. Where the exact gradient vanishes (dQ and dK when every
  // document has one token: a softmax over one key has zero derivative, so the fp64 reference is
  // exactly 0), the error is taken relative to the incoming gradient's norm instead: what the
  // kernel returns there is rounding (dO . V - dO . O with O stored in bf16), held to the same
  // bound.
  const double dy_norm = dy.cpu().to(at::kDouble).norm().item<double>();
  auto nrel = [dy_norm](const at::Tensor& a, const at::Tensor& b) {
    const double err = (a.cpu().to(at::kDouble) - b).norm().item<double>();
    const double ref = b.norm().item<double>();
    return err / (ref > 0 ? ref : dy_norm);
  };
  auto run = [&] {
    q.mutable_grad() = at::Tensor();
    k.mutable_grad() = at::Tensor();
    v.mutable_grad() = at::Tensor();
    attention(q, k, v, cu_t.to(at::kCUDA), 0, c.causal, 0, deterministic).backward(dy);
    return std::vector<at::Tensor>{q.grad(), k.grad(), v.grad()};
  };
  // The dQ paths: atomics and the TMA reduce-add (deterministic mode always orders atomics).
  std::vector<AttentionSchedule> schedules{{AttentionSchedule::Forward::plain, false}};
  if (!deterministic) schedules.push_back({AttentionSchedule::Forward::plain, true});
  std::vector<at::Tensor> first;
  for_each_schedule(schedules, [&](const AttentionSchedule& s) {
    const std::vector<at::Tensor> g = run();
    for (const at::Tensor& t : g) ASSERT_FALSE(t.isnan().any().item<bool>()) << "NaN in a gradient";
    const double eq = nrel(g[0], qr.grad()), ek = nrel(g[1], kr.grad()), ev = nrel(g[2], vr.grad());
    EXPECT_LE(eq, 2e-2) << worst_rows(g[0], qr.grad(), cu);
    EXPECT_LE(ek, 2e-2) << worst_rows(g[1], kr.grad(), cu);
    EXPECT_LE(ev, 2e-2) << worst_rows(g[2], vr.grad(), cu);
    std::printf("%-48s %-14s dq %.2e  dk %.2e  dv %.2e%s\n", name(c).c_str(), to_string(s).c_str(),
                eq, ek, ev, deterministic ? " (deterministic)" : "");
    std::fflush(stdout);
    if (first.empty()) {
      first = g;
    } else {  // dK and dV do not depend on the dQ path
      EXPECT_TRUE(at::equal(first[1], g[1])) << "dk differs between the dQ paths";
      EXPECT_TRUE(at::equal(first[2], g[2])) << "dv differs between the dQ paths";
    }
    if (deterministic) {  // bitwise repeatable
      const std::vector<at::Tensor> again = run();
      EXPECT_TRUE(at::equal(g[0], again[0]));
      EXPECT_TRUE(at::equal(g[1], again[1]));
      EXPECT_TRUE(at::equal(g[2], again[2]));
    }
  });
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

// Keys of their own lengths (attention_forward / attention_backward's cross-length form: one
// block of ring attention), forward and backward against the fp64 reference: sequences with more
// queries than keys and fewer, of length 1 on either side, odd and tile-aligned, GQA 1 / 4 / 8,
// the keys' rows ordered and counted unlike the queries'; the output poisoned with NaN (every
// query row written); every forward schedule bitwise equal; dK and dV equal across the dQ paths;
// deterministic mode repeatable. Tolerances as the self-attention cases above.
void check_cross(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t heads,
                 int64_t kv_heads, int64_t dim, bool causal) {
  std::vector<int64_t> cq{0}, ck{0};
  for (size_t i = 0; i < lq.size(); ++i) {
    cq.push_back(cq.back() + lq[i]);
    ck.push_back(ck.back() + lk[i]);
  }
  std::string label = "cross D" + std::to_string(dim) + " h" + std::to_string(heads) + "/" +
                      std::to_string(kv_heads) + (causal ? " causal" : " full") + " q/k";
  for (size_t i = 0; i < lq.size(); ++i)
    label += " " + std::to_string(lq[i]) + "/" + std::to_string(lk[i]);
  SCOPED_TRACE(label);
  const int64_t T = cq.back(), Tk = ck.back();
  auto bf = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Tensor q = at::randn({T, heads, dim}, bf), k = at::randn({Tk, kv_heads, dim}, bf),
                   v = at::randn({Tk, kv_heads, dim}, bf), dy = at::randn({T, heads, dim}, bf);
  const at::Tensor cu_q = at::tensor(cq, at::kLong), cu_k = at::tensor(ck, at::kLong);
  at::Tensor qr = q.cpu().to(at::kDouble).requires_grad_(),
             kr = k.cpu().to(at::kDouble).requires_grad_(),
             vr = v.cpu().to(at::kDouble).requires_grad_();
  AttentionReference ref = attention_reference(qr, kr, vr, cu_q, cu_k, causal);
  ref.out.backward(dy.cpu().to(at::kDouble));
  const at::Tensor cu_qd = cu_q.to(at::kCUDA), cu_kd = cu_k.to(at::kCUDA);
  auto nrel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.cpu().to(at::kDouble) - b).norm() / b.norm()).item<double>();
  };
  // dK and dV of the first run of each mode (deterministic mode's query tiles differ at head
  // dim 64, so its sums run in another order).
  at::Tensor first_out, first_dk[2], first_dv[2];
  std::vector<AttentionSchedule> schedules = forward_schedules();
  schedules.push_back({AttentionSchedule::Forward::pingpong, true});  // the default's dQ path
  for_each_schedule(schedules, [&](const AttentionSchedule& s) {
    at::Tensor out = at::full({T, heads, dim}, NAN, bf);
    const AttentionResult r = attention_forward(q, k, v, cu_qd, cu_kd, 0, 0, causal, 0, out);
    ASSERT_FALSE(r.out.isnan().any().item<bool>()) << "query rows left unwritten (NaN poison)";
    const double err = nrel(r.out, ref.out);
    const double lse_err = (r.lse.cpu().to(at::kDouble) - ref.lse).abs().max().item<double>();
    EXPECT_LE(err, 1e-2) << worst_rows(r.out, ref.out, cq);
    EXPECT_LE(lse_err, 1e-3) << worst_rows(r.lse, ref.lse, cq);
    for (bool deterministic : {false, true}) {
      if (deterministic && s.dq_tma) continue;
      const AttentionGrads g = attention_backward(q, k, v, r.out, dy, r.lse, cu_qd, cu_kd, 0, 0,
                                                  causal, 0, deterministic);
      for (const at::Tensor& t : {g.dq, g.dk, g.dv})
        ASSERT_FALSE(t.isnan().any().item<bool>()) << "NaN in a gradient";
      EXPECT_EQ(g.dk.sizes(), k.sizes());
      const double eq = nrel(g.dq, qr.grad()), ek = nrel(g.dk, kr.grad()),
                   ev = nrel(g.dv, vr.grad());
      EXPECT_LE(eq, 2e-2) << worst_rows(g.dq, qr.grad(), cq);
      EXPECT_LE(ek, 2e-2) << worst_rows(g.dk, kr.grad(), ck);
      EXPECT_LE(ev, 2e-2) << worst_rows(g.dv, vr.grad(), ck);
      std::printf("%-56s %-14s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e%s\n", label.c_str(),
                  to_string(s).c_str(), err, lse_err, eq, ek, ev,
                  deterministic ? " (deterministic)" : "");
      std::fflush(stdout);
      if (!first_out.defined()) first_out = r.out;
      EXPECT_TRUE(at::equal(first_out, r.out)) << "output differs between schedules";
      if (!first_dk[deterministic].defined()) {
        first_dk[deterministic] = g.dk;
        first_dv[deterministic] = g.dv;
      } else {
        EXPECT_TRUE(at::equal(first_dk[deterministic], g.dk)) << "dk differs between dQ paths";
        EXPECT_TRUE(at::equal(first_dv[deterministic], g.dv)) << "dv differs between dQ paths";
      }
      if (deterministic) {
        const AttentionGrads again =
            attention_backward(q, k, v, r.out, dy, r.lse, cu_qd, cu_kd, 0, 0, causal, 0, true);
        EXPECT_TRUE(at::equal(g.dq, again.dq));
      }
    }
  });
}

TEST(AttentionCuda, CrossLengthsEqualTheFp64Reference) {
  std::string why;
  if (!usable(&why)) GTEST_SKIP() << why;
  at::manual_seed(27);
  for (int64_t dim : {64, 128}) {
    check_cross({4096}, {2048}, 4, 4, dim, false);  // a ring's 2c x c block
    check_cross({2048}, {4096}, 4, 1, dim, false);  // and its c x 2c block, MQA
    check_cross({1, 300, 129, 64}, {257, 1, 640, 64}, 8, 2, dim, false);  // GQA 4, odd, 1
    check_cross({127, 513}, {127, 513}, 16, 2, dim, true);  // causal: equal lengths, GQA 8
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

// Runs everywhere: the failure messages' locator names the token, head and position.
TEST(AttentionCuda, WorstRowsPointAtTheWrongToken) {
  const std::vector<int64_t> cu{0, 100, 100, 300};
  at::Tensor want = at::zeros({300, 4, 8}, at::kDouble);
  at::Tensor got = want.clone();
  got[230][2][5] = 1.0;  // sequence 2 (the 0-length one is skipped), position 130
  const std::string s = worst_rows(got, want, cu, 1);
  EXPECT_NE(
      s.find("token 230 head 2: sequence 2 (length 200) position 130 (mod 64: 2, mod 128: 2)"),
      std::string::npos)
      << s;
  at::Tensor lse_want = at::zeros({4, 300}, at::kDouble), lse_got = lse_want.clone();
  lse_got[1][99] = 1.0;
  EXPECT_NE(worst_rows(lse_got, lse_want, cu, 1).find("token 99 head 1: sequence 0"),
            std::string::npos);
}

// Runs everywhere: the schedule names round-trip, and a bad one is an InputError naming it.
TEST(AttentionCuda, SchedulesParseAndNameTheBadPart) {
  for (const AttentionSchedule& s : attention_schedules())
    EXPECT_EQ(parse_attention_schedule(to_string(s)), s) << to_string(s);
  EXPECT_EQ(attention_schedules().size(), 6u);
  const AttentionSchedule dq = parse_attention_schedule("dq_tma");
  EXPECT_EQ(dq.forward, AttentionSchedule::Forward::plain);
  EXPECT_TRUE(dq.dq_tma);
  EXPECT_EQ(to_string(parse_attention_schedule("dq_tma+pingpong")), "pingpong+dq_tma");
  for (const char* bad : {"", "fast", "overlap+", "overlap+pingpong", "dq_tma+dq_tma", "Overlap"}) {
    try {
      parse_attention_schedule(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("attention schedule '" + std::string(bad) + "'"),
                std::string::npos)
          << e.what();
    }
  }
  const AttentionSchedule saved = attention_schedule();
  set_attention_schedule({AttentionSchedule::Forward::overlap, true});
  EXPECT_EQ(to_string(attention_schedule()), "overlap+dq_tma");
  set_attention_schedule(saved);
}

// Runs everywhere: the head sections for the benchmark's shapes (W1: 8 x 2048 tokens, 32 / 4
// heads, dim 64; W2: 4096 tokens, 32 / 32, dim 128) under the default 24 MiB, whole kv head
// groups, the clamps, and a bad budget named.
TEST(AttentionCuda, HeadSectionsFitTheL2Budget) {
  const int64_t mib = int64_t(1) << 20;
  // W2: K and V are 2 MiB a kv head (12 fit), Q, dO and dQ 4 MiB (6 fit).
  AttentionSections w2 = attention_sections(4096, 32, 32, 128, 24 * mib);
  EXPECT_EQ(w2.fwd_heads, 12);
  EXPECT_EQ(w2.bwd_kv_heads, 6);
  // W1: K and V 4 MiB a kv head (all 4 fit: 32 query heads); a group's Q, dO, dQ 64 MiB (1).
  AttentionSections w1 = attention_sections(8 * 2048, 32, 4, 64, 24 * mib);
  EXPECT_EQ(w1.fwd_heads, 32);
  EXPECT_EQ(w1.bwd_kv_heads, 1);
  // Sections of whole groups: 3 kv heads of group 8 are 24 query heads.
  EXPECT_EQ(attention_sections(8 * 2048, 64, 8, 64, 12 * mib).fwd_heads, 24);
  // Budget 0 or no tokens: one section; a budget under one kv head: one kv head.
  for (const AttentionSections s :
       {attention_sections(4096, 32, 8, 128, 0), attention_sections(0, 32, 8, 128, 24 * mib)}) {
    EXPECT_EQ(s.fwd_heads, 32);
    EXPECT_EQ(s.bwd_kv_heads, 8);
  }
  AttentionSections tiny = attention_sections(4096, 32, 8, 128, 1);
  EXPECT_EQ(tiny.fwd_heads, 4);
  EXPECT_EQ(tiny.bwd_kv_heads, 1);
  EXPECT_THROW(attention_sections(4096, 32, 5, 128, mib), InputError);  // 32 % 5 != 0
  EXPECT_THROW(attention_sections(4096, 32, 8, 128, -1), InputError);
  EXPECT_THROW(set_attention_l2_budget(-1), InputError);
}

// Runs everywhere: the work lists hold every tile with work exactly once, with the work a
// token-level count gives, heaviest first, a sequence's backward key tiles in order.
TEST(AttentionCuda, WorkListsCoverEveryTileHeaviestFirst) {
  const std::vector<int64_t> lens{1, 127, 0, 128, 129, 300, 2049, 64, 0};
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    // tiles[(seq, block)] = work, by brute force over the (query, key) pairs each tile sees.
    auto oracle = [&](int64_t own, int64_t other, bool own_is_query) {
      std::map<std::pair<int32_t, int32_t>, int64_t> want;
      for (size_t s = 0; s < lens.size(); ++s) {
        const int64_t len = lens[s];
        std::map<int64_t, std::set<int64_t>> seen;  // block -> the other side's blocks
        for (int64_t q = 0; q < len; ++q)
          for (int64_t k = 0; k <= (causal ? q : len - 1); ++k) {
            const int64_t mine = own_is_query ? q : k, theirs = own_is_query ? k : q;
            seen[mine / own].insert(theirs / other);
          }
        for (const auto& [block, set] : seen)
          want[{static_cast<int32_t>(s), static_cast<int32_t>(block)}] =
              static_cast<int64_t>(set.size());
      }
      return want;
    };
    for (bool forward : {true, false}) {
      SCOPED_TRACE(forward ? "forward" : "backward");
      const std::vector<AttentionTile> got =
          forward ? attention_forward_tiles(cu, causal) : attention_backward_tiles(cu, causal);
      const auto want = forward ? oracle(128, 128, true) : oracle(128, 64, false);
      std::map<std::pair<int32_t, int32_t>, int64_t> have;
      for (size_t i = 0; i < got.size(); ++i) {
        const AttentionTile& t = got[i];
        EXPECT_TRUE(have.emplace(std::make_pair(t.seq, t.block), t.work).second)
            << "tile (" << t.seq << ", " << t.block << ") twice";
        if (i > 0) {
          EXPECT_GE(got[i - 1].work, t.work) << "not heaviest first at " << i;
        }
      }
      EXPECT_EQ(have, want);
      if (!forward) {  // a sequence's key tiles in increasing order
        std::map<int32_t, int32_t> last;
        for (const AttentionTile& t : got) {
          auto it = last.find(t.seq);
          if (it != last.end()) {
            EXPECT_LT(it->second, t.block) << "sequence " << t.seq;
          }
          last[t.seq] = t.block;
        }
      }
    }
  }
  EXPECT_TRUE(attention_forward_tiles({0, 0, 0}, true).empty());
}

// Runs everywhere: the work lists of keys with their own lengths. The forward cuts the queries
// and counts the key tiles each reads; the backward cuts the keys and counts the 64-query tiles
// that see each (full attention: every pair of a sequence). Unequal sequence counts: InputError.
TEST(AttentionCuda, WorkListsOfCrossLengths) {
  const std::vector<int64_t> lq{1, 4096, 2048, 300, 129}, lk{257, 2048, 4096, 1, 640};
  std::vector<int64_t> cq{0}, ck{0};
  for (size_t i = 0; i < lq.size(); ++i) {
    cq.push_back(cq.back() + lq[i]);
    ck.push_back(ck.back() + lk[i]);
  }
  auto ceil = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  for (bool forward : {true, false}) {
    SCOPED_TRACE(forward ? "forward" : "backward");
    const std::vector<AttentionTile> got =
        forward ? attention_forward_tiles(cq, ck, false) : attention_backward_tiles(cq, ck, false);
    std::map<std::pair<int32_t, int32_t>, int64_t> want, have;
    for (size_t s = 0; s < lq.size(); ++s) {
      const int64_t cut = forward ? lq[s] : lk[s], other = forward ? lk[s] : lq[s];
      for (int64_t b = 0; b < ceil(cut, 128); ++b)
        want[{static_cast<int32_t>(s), static_cast<int32_t>(b)}] = ceil(other, forward ? 128 : 64);
    }
    for (size_t i = 0; i < got.size(); ++i) {
      have[{got[i].seq, got[i].block}] = got[i].work;
      if (i > 0) {
        EXPECT_GE(got[i - 1].work, got[i].work) << "not heaviest first at " << i;
      }
    }
    EXPECT_EQ(have, want);
  }
  // Equal lengths give the self-attention lists.
  const std::vector<int64_t> cu{0, 300, 2349};
  for (bool causal : {true, false}) {
    EXPECT_EQ(attention_forward_tiles(cu, cu, causal).size(),
              attention_forward_tiles(cu, causal).size());
    const auto a = attention_backward_tiles(cu, cu, causal),
               b = attention_backward_tiles(cu, causal);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].work, b[i].work);
  }
  EXPECT_THROW(attention_forward_tiles({0, 5, 9}, {0, 9}, false), InputError);
}

// Runs everywhere: how many parts a tall cross-length block's queries are cut into for the
// backward. The cases are ring attention's: rank 3 of an 8-rank ring over 32k tokens has blocks
// of 4,096 queries x 2,048 keys, 16 key tiles of 128.
TEST(AttentionCuda, BackwardQueryPartsFillOneWave) {
  // 4 kv heads: 64 CTAs on 132 SMs; two parts give 128 (one wave), three 192 (two waves).
  EXPECT_EQ(attention_backward_query_parts(1, 4096, 2048, 4, 132), 2);
  // 32 kv heads: 512 CTAs already fill the SMs.
  EXPECT_EQ(attention_backward_query_parts(1, 4096, 2048, 32, 132), 1);
  // One kv head: 16 CTAs, up to 8 parts by the SMs; 64 query tiles divide by 8.
  EXPECT_EQ(attention_backward_query_parts(1, 4096, 2048, 1, 132), 8);
  // 16 query tiles: parts of at least kAttentionBwdMinPartTiles (4) tiles, so 4 at most.
  EXPECT_EQ(attention_backward_query_parts(2, 1024, 512, 1, 132), 4);
  // Parts are equal whole tiles: 20 tiles at 5 CTAs allow 26 parts by the SMs, and 5 is the most
  // that cut 20 tiles into parts of at least 4.
  EXPECT_EQ(attention_backward_query_parts(1, 1280, 640, 1, 132), 5);
  // Queries that are not whole 64-row tiles, or too few tiles to cut, stay whole.
  EXPECT_EQ(attention_backward_query_parts(1, 4000, 2000, 4, 132), 1);
  EXPECT_EQ(attention_backward_query_parts(1, 448, 128, 1, 132), 1);  // 7 tiles: no equal cut
  EXPECT_EQ(attention_backward_query_parts(1, 256, 128, 1, 132), 1);  // 4 tiles: one part's worth
  EXPECT_EQ(attention_backward_query_parts(1, 0, 128, 1, 132), 1);
  EXPECT_EQ(attention_backward_query_parts(0, 4096, 2048, 4, 132), 1);
  // More SMs, more parts (a card of 264 SMs: four parts of 64 CTAs).
  EXPECT_EQ(attention_backward_query_parts(1, 4096, 2048, 4, 264), 4);
  EXPECT_EQ(attention_multiprocessors(at::Device(at::kCPU)), 132);
}

// Runs everywhere: the backward's launch order is a permutation of tile_and_head's numbering;
// interleave 0 is that numbering, 100 heaviest first across sections; at every setting a
// sequence's key tiles of one kv head start in increasing order (deterministic mode's waits).
TEST(AttentionCuda, BackwardOrderInterleavesSectionsKeepingTileOrder) {
  const std::vector<int64_t> lens{300, 2049, 1, 640, 129};
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  // tile_and_head (src/kernels_sm90/common.cuh), written out again as the oracle.
  auto tile_head = [](int64_t b, int64_t tiles, int64_t heads, int64_t section) {
    if (section <= 0 || section >= heads) return std::make_pair(b / heads, b % heads);
    const int64_t per = tiles * section, sec = b / per, rest = b - sec * per;
    const int64_t n = std::min(section, heads - sec * section);
    return std::make_pair(rest / n, sec * section + rest % n);
  };
  for (bool causal : {true, false})
    for (int64_t kv_heads : {1, 3, 8})
      for (int64_t section : {0, 1, 2, 3, 8})
        for (int64_t interleave : {0, 25, 50, 100}) {
          SCOPED_TRACE(std::string(causal ? "causal" : "full") + ", kv heads " +
                       std::to_string(kv_heads) + ", section " + std::to_string(section) +
                       ", interleave " + std::to_string(interleave));
          const std::vector<AttentionTile> tiles = attention_backward_tiles(cu, causal);
          const int64_t n = static_cast<int64_t>(tiles.size());
          const std::vector<int32_t> order =
              attention_backward_order(tiles, kv_heads, section, interleave);
          ASSERT_EQ(static_cast<int64_t>(order.size()), n * kv_heads);
          std::vector<int32_t> sorted = order;
          std::sort(sorted.begin(), sorted.end());
          for (int64_t i = 0; i < n * kv_heads; ++i) ASSERT_EQ(sorted[i], i) << "not a permutation";
          const int64_t sec = section <= 0 || section >= kv_heads ? kv_heads : section;
          std::map<std::pair<int32_t, int64_t>, int32_t> last;  // (sequence, kv head) -> tile
          for (int64_t i = 0; i < n * kv_heads; ++i) {
            const auto [tile, head] = tile_head(order[i], n, kv_heads, section);
            if (interleave == 0) {
              EXPECT_EQ(order[i], i) << "interleave 0 is tile_and_head's numbering";
            }
            if (i > 0 && (interleave == 100 || sec == kv_heads)) {
              const auto [prev, prev_head] = tile_head(order[i - 1], n, kv_heads, section);
              EXPECT_GE(tiles[prev].work, tiles[tile].work) << "not heaviest first at " << i;
            }
            const std::pair<int32_t, int64_t> key{tiles[tile].seq, head};
            auto it = last.find(key);
            if (it != last.end()) {
              EXPECT_LT(it->second, tiles[tile].block)
                  << "sequence " << key.first << ", kv head " << head << ": key tiles out of order";
            }
            last[key] = tiles[tile].block;
          }
        }
  // Two sections of one kv head, tiles of work 4, 3, 2, 1 (one causal sequence of 4 key tiles
  // at 64-query steps: 8, 6, 4, 2): at 50 the second section's heaviest tile comes right after
  // the first section's tiles of at least half the heaviest work.
  const std::vector<AttentionTile> four = attention_backward_tiles({0, 512}, true);
  ASSERT_EQ(four.size(), 4u);
  EXPECT_EQ(attention_backward_order(four, 2, 1, 50),
            (std::vector<int32_t>{0, 1, 2, 4, 3, 5, 6, 7}));
  EXPECT_EQ(attention_backward_order(four, 2, 1, 100),
            (std::vector<int32_t>{0, 4, 1, 5, 2, 6, 3, 7}));
  EXPECT_EQ(attention_backward_order(four, 2, 1, 0),
            (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_THROW(attention_backward_order(four, 2, 1, 101), InputError);
  EXPECT_THROW(attention_backward_order(four, 0, 1, 50), InputError);
  EXPECT_THROW(set_attention_bwd_interleave(-2), InputError);
  EXPECT_THROW(set_attention_bwd_interleave(101), InputError);
}

// Runs everywhere: the automatic interleave keeps the sections where their order already keeps
// 132 SMs busy and interleaves them where it does not. Expected values from an independent count
// (scripts/attn_order_sim.py's launch order and list scheduling, CTA cost work x group + 2):
// W1 dense (8 x 2048, 4 kv heads in sections of one, group 8) 97.0 % busy at interleave 0, the
// best; W2 B1 (1 x 4096, 32 kv heads in sections of 6, group 1) 87.0 % at 0, 90.5 % at 50 and
// 93.6 % at 60 (99.1 % at 100, past the cap); W2 B4 dense (4 x 4096, sections of one) 99.8 %
// at 0.
TEST(AttentionCuda, BackwardOrderAutoInterleavesOnlyWhereTheSectionsLeaveSMsIdle) {
  auto dense = [](int64_t sequences, int64_t len) {
    std::vector<int64_t> cu{0};
    for (int64_t i = 0; i < sequences; ++i) cu.push_back(cu.back() + len);
    return attention_backward_tiles(cu, true);
  };
  EXPECT_EQ(attention_bwd_interleave_auto(dense(8, 2048), 4, 1, 8, 132), 0);
  EXPECT_EQ(attention_bwd_interleave_auto(dense(1, 4096), 32, 6, 1, 132), kAttentionBwdAutoMax);
  static_assert(kAttentionBwdAutoMax == 60, "the expected values are counted for a cap of 60");
  EXPECT_EQ(attention_bwd_interleave_auto(dense(4, 4096), 32, 1, 1, 132), 0);
  // Deterministic mode: its own setting wherever there is more than one section.
  EXPECT_EQ(attention_bwd_interleave_auto(dense(8, 2048), 4, 1, 8, 132, true),
            kAttentionBwdAutoDeterministic);
  EXPECT_EQ(attention_bwd_interleave_auto(dense(4, 4096), 32, 1, 1, 132, true),
            kAttentionBwdAutoDeterministic);
  EXPECT_EQ(attention_bwd_interleave_auto(dense(1, 4096), 32, 32, 1, 132, true), 0);
  // One section (or none): every interleave is the same order.
  EXPECT_EQ(attention_bwd_interleave_auto(dense(1, 4096), 32, 32, 1, 132), 0);
  EXPECT_EQ(attention_bwd_interleave_auto(dense(1, 4096), 32, 0, 1, 132), 0);
  EXPECT_EQ(attention_bwd_interleave_auto({}, 4, 1, 8, 132), 0);
  EXPECT_THROW(attention_bwd_interleave_auto(dense(1, 256), 2, 1, 0, 132), InputError);
  EXPECT_THROW(attention_bwd_interleave_auto(dense(1, 256), 2, 1, 1, 0), InputError);
  const int64_t saved = attention_bwd_interleave();
  set_attention_bwd_interleave(kAttentionBwdInterleaveAuto);
  EXPECT_EQ(attention_bwd_interleave(), kAttentionBwdInterleaveAuto);
  set_attention_bwd_interleave(saved);
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
  // A [1, H, D] view whose row stride TMA cannot take (not a multiple of 16 bytes) is copied.
  at::Tensor wide = at::randn({1, 4 * 64 + 3}, bf);
  at::Tensor q1 = wide.narrow(1, 0, 4 * 64).view({1, 4, 64});
  at::Tensor k1 = at::randn({1, 2, 64}, bf);
  at::Tensor cu1 = at::tensor(std::vector<int64_t>{0, 1}, at::kLong);
  at::Tensor y1 = attention_forward(q1, k1, k1, cu1, 0, true).out;
  EXPECT_TRUE(at::allclose(y1.to(at::kFloat),
                           k1.repeat_interleave(2, 1).to(at::kFloat)));  // one key: out = v
  // Keys of their own lengths: each error names the offsets and the sequence.
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no InputError");
  };
  const at::Tensor k5 = at::randn({5, 2, 64}, bf);
  auto offs = [](std::vector<int64_t> v) { return at::tensor(v, at::kLong); };
  EXPECT_NE(error([&] {
              attention_forward(q, k5, k5, offs({0, 8}), offs({0, 4}), 0, 0, false);
            }).find("cu_seqlens_k must start at 0 and end at the rows, 5"),
            std::string::npos);
  EXPECT_NE(error([&] {
              attention_forward(q, k5, k5, offs({0, 8}), offs({0, 2, 5}), 0, 0, false);
            }).find("cu_seqlens_q holds 1 sequences, cu_seqlens_k 2"),
            std::string::npos);
  EXPECT_NE(error([&] {
              attention_forward(q, k5, k5, offs({0, 8, 8}), offs({0, 2, 5}), 0, 0, false);
            }).find("sequence 1 has 0 queries and 3 keys"),
            std::string::npos);
  EXPECT_NE(error([&] {
              attention_forward(q, k5, k5, offs({0, 8}), offs({0, 5}), 0, 0, true);
            }).find("causal sequence 0 has 8 queries and 5 keys"),
            std::string::npos);
  EXPECT_NE(error([&] {
              attention_forward(q, k5, k5, offs({0, 8}), offs({0, 5}), 0, 4, false);
            }).find("max_seqlen_k 4 is shorter"),
            std::string::npos);
  EXPECT_NE(error([&] {
              attention_backward(q, k5, k5, q, q, at::zeros({4, 8}, bf.dtype(at::kFloat)),
                                 offs({0, 8}), at::Tensor(), 0, 0, false);
            }).find("cu_seqlens_k is undefined"),
            std::string::npos);
}

}  // namespace
}  // namespace colossal::kernels
