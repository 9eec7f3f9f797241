// CPU Adam kernel vs an fp64 ATen AdamW reference (torch.optim.AdamW's formula), on every path
// this CPU has (scalar, AVX2, AVX-512), on sizes that are not multiples of the vector width,
// with and without weight decay and grad_divisor, over several steps; the bf16/fp16 gradient
// and output variants; bitwise agreement of the paths and thread counts; the CPUAdam class vs
// AdamW, checkpoints interchanging; clear errors on bad input.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/optim/cpu_adam.h"

using namespace colossal;
using namespace colossal::optim;

namespace {

std::vector<CpuAdamPath> paths() {
  std::vector<CpuAdamPath> out;
  for (auto p : {CpuAdamPath::Scalar, CpuAdamPath::AVX2, CpuAdamPath::AVX512})
    if (cpu_adam_path_available(p)) out.push_back(p);
  return out;
}

// The fp64 reference step (the order of operations of torch.optim.AdamW).
void reference_step(at::Tensor& p, at::Tensor& m, at::Tensor& v, at::Tensor g, int64_t step,
                    const AdamWHyper& h, double divisor) {
  g = g / divisor;
  p.mul_(1.0 - h.lr * h.weight_decay);
  m.lerp_(g, 1.0 - h.beta1);
  v.mul_(h.beta2).addcmul_(g, g, 1.0 - h.beta2);
  double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  auto denom = (v.sqrt() / std::sqrt(bc2)).add_(h.eps);
  p.addcdiv_(m, denom, -h.lr / bc1);
}

// |got - want| <= 1e-6 * |want| + atol, where atol = 1e-6 * mean|want| absorbs the cancellation
// of elements that pass near zero (an fp32 result of a difference of two O(x) terms carries an
// absolute error of O(ulp(x)), not of its own size). Returns the worst ratio error / bound.
double worst(const at::Tensor& got, const at::Tensor& want) {
  auto w = want.to(at::kDouble);
  auto err = (got.to(at::kDouble) - w).abs();
  double atol = 1e-6 * w.abs().mean().item<double>();
  auto bound = w.abs() * 1e-6 + atol;
  return (err / bound).max().item<double>();
}

struct Case {
  int64_t n;
  double wd, divisor;
};

class CpuAdamPaths : public ::testing::TestWithParam<CpuAdamPath> {};

TEST_P(CpuAdamPaths, Fp32MatchesFp64Reference) {
  const CpuAdamPath path = GetParam();
  std::vector<Case> cases;
  for (int64_t n : {1, 7, 8, 15, 16, 17, 31, 33, 100})
    for (double wd : {0.0, 0.1})
      for (double div : {1.0, 4.0}) cases.push_back({n, wd, div});
  cases.push_back({1000003, 0.01, 3.0});
  for (const auto& c : cases) {
    at::manual_seed(c.n);
    auto p = at::randn({c.n}), m = at::zeros({c.n}), v = at::zeros({c.n});
    auto rp = p.to(at::kDouble), rm = m.to(at::kDouble), rv = v.to(at::kDouble);
    AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, c.wd};
    for (int64_t step = 1; step <= 4; ++step) {
      auto g = at::randn({c.n}) * 0.5;
      cpu_adam_update(p, g, m, v, step, h, c.divisor, {}, path);
      reference_step(rp, rm, rv, g.to(at::kDouble), step, h, c.divisor);
    }
    SCOPED_TRACE(::testing::Message() << cpu_adam_path_name(path) << " n=" << c.n << " wd=" << c.wd
                                      << " div=" << c.divisor);
    EXPECT_LE(worst(p, rp), 1.0);
    EXPECT_LE(worst(m, rm), 1.0);
    EXPECT_LE(worst(v, rv), 1.0);
  }
}

// bf16/fp16 gradients upcast in the kernel; the output buffer holds exactly the RNE cast of the
// updated fp32 master (what master.to(dtype) gives).
TEST_P(CpuAdamPaths, HalfGradsAndOutputEqualUpcastStepDowncast) {
  const CpuAdamPath path = GetParam();
  for (auto dt : {at::kBFloat16, at::kHalf})
    for (int64_t n : {1, 9, 23, 4099}) {
      at::manual_seed(n);
      auto p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
      auto rp = p.to(at::kDouble), rm = m.to(at::kDouble), rv = v.to(at::kDouble);
      auto out = at::empty({n}, at::TensorOptions().dtype(dt));
      AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.05};
      for (int64_t step = 1; step <= 3; ++step) {
        auto g = (at::randn({n}) * 1024).to(dt);
        cpu_adam_update(p, g, m, v, step, h, 1024.0, out, path);
        reference_step(rp, rm, rv, g.to(at::kDouble), step, h, 1024.0);
        SCOPED_TRACE(::testing::Message()
                     << cpu_adam_path_name(path) << " " << dt << " n=" << n << " step " << step);
        EXPECT_TRUE(at::equal(out, p.to(dt)));
      }
      EXPECT_LE(worst(p, rp), 1.0);
      EXPECT_LE(worst(m, rm), 1.0);
      EXPECT_LE(worst(v, rv), 1.0);
    }
}

// The downcast alone, on awkward values: ties, denormals, huge values, infinities. With lr = 0
// the step leaves the master as it is, so the output must equal at::Tensor::to of the input.
TEST_P(CpuAdamPaths, DowncastRoundsLikeATen) {
  const CpuAdamPath path = GetParam();
  at::manual_seed(3);
  auto bits = at::randint(0, 1 << 30, {5000}, at::TensorOptions().dtype(at::kInt));
  bits = bits * 4 + at::randint(0, 4, {5000}, at::TensorOptions().dtype(at::kInt));
  auto p = bits.view(at::kFloat).clone();
  p = at::where(p.isfinite(), p, at::zeros_like(p));  // random finite floats of every exponent
  std::vector<float> special = {0.f,
                                -0.f,
                                1.0f + 1.0f / 256,  // a bf16 tie, rounds to even (down)
                                1.0f + 3.0f / 256,  // a bf16 tie, rounds to even (up)
                                1e-40f,
                                -3e-39f,
                                std::numeric_limits<float>::denorm_min(),
                                3.3e38f,
                                std::numeric_limits<float>::max(),
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                65519.f,
                                65520.f,
                                6e-8f,
                                2.9e-8f};
  p = at::cat({p, at::tensor(special)});
  auto p0 = p.clone();
  auto n = p.numel();
  AdamWHyper h{0.0, 0.9, 0.999, 1e-8, 0.0};
  for (auto dt : {at::kBFloat16, at::kHalf}) {
    auto out = at::empty({n}, at::TensorOptions().dtype(dt));
    cpu_adam_update(p, at::zeros({n}), at::zeros({n}), at::zeros({n}), 1, h, 1.0, out, path);
    EXPECT_TRUE(at::equal(p, p0));
    auto want = p0.to(dt);
    auto same = (out.view(at::kShort) == want.view(at::kShort));
    EXPECT_TRUE(same.all().item<bool>()) << cpu_adam_path_name(path) << " " << dt << ": "
                                         << (~same).sum().item<int64_t>() << " values differ";
  }
}

INSTANTIATE_TEST_SUITE_P(Available, CpuAdamPaths, ::testing::ValuesIn(paths()),
                         [](const auto& info) { return cpu_adam_path_name(info.param); });

// Every path and every thread count give the same bits (same operations in the same order, no
// FMA contraction), for every gradient and output dtype.
TEST(CpuAdam, PathsAndThreadsAgreeBitwise) {
  const int64_t n = 300007;
  const int threads = at::get_num_threads();
  for (auto gdt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::manual_seed(7);
    auto p0 = at::randn({n}), m0 = at::randn({n}) * 0.1, v0 = at::rand({n}) * 0.01;
    auto g = at::randn({n}).to(gdt);
    at::Tensor ref_p, ref_m, ref_v, ref_o;
    for (auto path : paths())
      for (int t : {1, 2, 3}) {
        at::set_num_threads(t);
        auto p = p0.clone(), m = m0.clone(), v = v0.clone();
        auto o = at::empty({n}, at::TensorOptions().dtype(at::kBFloat16));
        cpu_adam_update(p, g, m, v, 5, AdamWHyper{1e-3, 0.9, 0.999, 1e-8, 0.1}, 2.0, o, path);
        if (!ref_p.defined()) {
          ref_p = p, ref_m = m, ref_v = v, ref_o = o;
          continue;
        }
        SCOPED_TRACE(::testing::Message()
                     << cpu_adam_path_name(path) << " threads " << t << " " << gdt);
        EXPECT_TRUE(at::equal(p, ref_p));
        EXPECT_TRUE(at::equal(m, ref_m));
        EXPECT_TRUE(at::equal(v, ref_v));
        EXPECT_TRUE(at::equal(o, ref_o));
      }
  }
  at::set_num_threads(threads);
}

// Large updates use at::get_num_threads() threads, small ones fewer (never zero).
TEST(CpuAdam, ThreadCountFollowsATen) {
  const int threads = at::get_num_threads();
  at::set_num_threads(3);
  EXPECT_EQ(cpu_adam_num_threads(100'000'000), 3);
  EXPECT_EQ(cpu_adam_num_threads(1), 1);
  EXPECT_EQ(cpu_adam_num_threads(0), 1);
  at::set_num_threads(1);
  EXPECT_EQ(cpu_adam_num_threads(100'000'000), 1);
  at::set_num_threads(threads);
}

// Many back-to-back threaded steps (the persistent workers are reused, thread counts change
// between calls) end where the same steps on one thread end.
TEST(CpuAdam, RepeatedThreadedStepsEqualOneThread) {
  const int threads = at::get_num_threads();
  at::manual_seed(5);
  auto g = at::randn({300001}).to(at::kBFloat16);
  auto p1 = at::randn({300001}), m1 = at::zeros({300001}), v1 = at::zeros({300001});
  auto p2 = p1.clone(), m2 = m1.clone(), v2 = v1.clone();
  auto o1 = at::empty({300001}, at::kBFloat16), o2 = o1.clone();
  AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01};
  for (int64_t step = 1; step <= 60; ++step) {
    at::set_num_threads(1);
    cpu_adam_update(p1, g, m1, v1, step, h, 1.0, o1);
    at::set_num_threads(2 + static_cast<int>(step % 3));
    cpu_adam_update(p2, g, m2, v2, step, h, 1.0, o2);
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(p1, p2));
  EXPECT_TRUE(at::equal(v1, v2));
  EXPECT_TRUE(at::equal(o1, o2));
}

// The list form updates views of one flat buffer (how ZeRO holds its shard) like separate calls.
TEST(CpuAdam, ListOverViewsOfAFlatBuffer) {
  auto flat = at::randn({100}), m = at::zeros({100}), v = at::zeros({100}), g = at::randn({100});
  auto p2 = flat.clone(), m2 = m.clone(), v2 = v.clone();
  AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.0};
  cpu_adam_update({flat.slice(0, 0, 37), flat.slice(0, 37, 100)},
                  {g.slice(0, 0, 37), g.slice(0, 37, 100)}, {m.slice(0, 0, 37), m.slice(0, 37)},
                  {v.slice(0, 0, 37), v.slice(0, 37)}, 1, h);
  cpu_adam_update(p2, g, m2, v2, 1, h);
  EXPECT_TRUE(at::equal(flat, p2));
  EXPECT_TRUE(at::equal(m, m2));
}

// The list form runs one parallel loop over all tensors end to end (chunks straddle tensor
// boundaries): many tensors of mixed sizes, grad dtypes and outputs equal one call per tensor.
TEST(CpuAdam, ListOfManyTensorsEqualsSeparateCalls) {
  const int threads = at::get_num_threads();
  at::set_num_threads(3);
  at::manual_seed(11);
  std::vector<at::Tensor> P, G, M, V, O, P2, M2, V2, O2;
  const at::ScalarType gdts[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (int i = 0; i < 60; ++i) {
    int64_t n = i % 7 == 0 ? 40000 + i : 1 + (i * 131) % 3000;
    P.push_back(at::randn({n}));
    G.push_back(at::randn({n}).to(gdts[i % 3]));
    M.push_back(at::randn({n}) * 0.1);
    V.push_back(at::rand({n}) * 0.01);
    O.push_back(i % 4 == 0 ? at::Tensor() : at::zeros({n}, at::kBFloat16));
    P2.push_back(P.back().clone());
    M2.push_back(M.back().clone());
    V2.push_back(V.back().clone());
    O2.push_back(O.back().defined() ? O.back().clone() : at::Tensor());
  }
  AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.1};
  cpu_adam_update(P, G, M, V, 3, h, 2.0, O);
  for (size_t i = 0; i < P.size(); ++i)
    cpu_adam_update(P2[i], G[i], M2[i], V2[i], 3, h, 2.0, O2[i]);
  for (size_t i = 0; i < P.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i);
    EXPECT_TRUE(at::equal(P[i], P2[i]));
    EXPECT_TRUE(at::equal(M[i], M2[i]));
    EXPECT_TRUE(at::equal(V[i], V2[i]));
    if (O[i].defined()) {
      EXPECT_TRUE(at::equal(O[i], O2[i]));
    }
  }
  at::set_num_threads(threads);
}

std::vector<at::Tensor> make_params(at::ScalarType dt) {
  at::manual_seed(0);
  std::vector<at::Tensor> ps = {at::randn({5, 3}), at::randn({17}), at::randn({2, 2, 2})};
  for (auto& p : ps) {
    p = p.to(dt);
    p.set_requires_grad(true);
  }
  return ps;
}

void add_params(Optimizer& opt, const std::vector<at::Tensor>& ps, double wd) {
  std::vector<NamedParam> named;
  for (size_t i = 0; i < ps.size(); ++i) named.push_back({"p" + std::to_string(i), ps[i]});
  GroupOptions g;
  g.lr = 1e-2;
  g.weight_decay = wd;
  opt.add_param_group(named, g);
}

void set_grads(const std::vector<at::Tensor>& ps, int step) {
  at::manual_seed(100 + step);
  for (auto& p : ps) p.mutable_grad() = at::randn(p.sizes()).to(p.scalar_type());
}

// The class equals AdamW (fp32, and bf16 with fp32 masters), and its checkpoints load into AdamW.
TEST(CpuAdam, ClassMatchesAdamWAndStateInterchanges) {
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    auto a = make_params(dt), b = make_params(dt);
    CPUAdam cpu;
    AdamW ref;
    add_params(cpu, a, 0.1);
    add_params(ref, b, 0.1);
    for (int s = 1; s <= 3; ++s) {
      set_grads(a, s);
      set_grads(b, s);
      cpu.step(2.0);
      ref.step(2.0);
    }
    for (size_t i = 0; i < a.size(); ++i) {
      if (dt == at::kFloat) {
        EXPECT_LE(worst(a[i].detach(), b[i].detach()), 1.0);
      } else {
        EXPECT_LE(worst(cpu.master("p" + std::to_string(i)), ref.master("p" + std::to_string(i))),
                  1.0);
      }
      EXPECT_LE(worst(cpu.state("p" + std::to_string(i))->tensors.at("exp_avg"),
                      ref.state("p" + std::to_string(i))->tensors.at("exp_avg")),
                1.0);
    }
    // CPUAdam -> AdamW and back: the next step continues from the loaded state.
    auto c = make_params(dt);
    AdamW resumed;
    add_params(resumed, c, 0.1);
    resumed.load_state_dict(cpu.state_dict());
    CPUAdam back;
    auto d = make_params(dt);
    add_params(back, d, 0.1);
    back.load_state_dict(ref.state_dict());
    EXPECT_EQ(resumed.state("p0")->step, 3);
    EXPECT_EQ(back.state("p1")->step, 3);
  }
}

// COLOSSAL_CPU_ADAM caps the path Auto picks (CTest runs this test again with the variable set
// to scalar, avx2 and a bad value); a path the CPU lacks or an unknown name is an InputError.
TEST(CpuAdam, DefaultPathFollowsEnv) {
  const char* env = std::getenv("COLOSSAL_CPU_ADAM");
  std::string want = env ? env : "";
  if (want.empty()) {
    auto best = cpu_adam_path_available(CpuAdamPath::AVX512) ? CpuAdamPath::AVX512
                : cpu_adam_path_available(CpuAdamPath::AVX2) ? CpuAdamPath::AVX2
                                                             : CpuAdamPath::Scalar;
    EXPECT_EQ(cpu_adam_default_path(), best);
    return;
  }
  bool known = want == "scalar" || want == "avx2" || want == "avx512";
  bool available = (want == "scalar") ||
                   (want == "avx2" && cpu_adam_path_available(CpuAdamPath::AVX2)) ||
                   (want == "avx512" && cpu_adam_path_available(CpuAdamPath::AVX512));
  if (!known || !available) {
    EXPECT_THROW(cpu_adam_default_path(), InputError);
    return;
  }
  EXPECT_EQ(std::string(cpu_adam_path_name(cpu_adam_default_path())), want);
  // Auto now runs that path: the same bits as asking for it by name.
  auto p = at::randn({1001}), m = at::zeros({1001}), v = at::zeros({1001}), g = at::randn({1001});
  auto p2 = p.clone(), m2 = m.clone(), v2 = v.clone();
  cpu_adam_update(p, g, m, v, 1, AdamWHyper{});
  cpu_adam_update(p2, g, m2, v2, 1, AdamWHyper{}, 1.0, {}, cpu_adam_default_path());
  EXPECT_TRUE(at::equal(p, p2));
}

TEST(CpuAdam, BadInputIsAClearError) {
  auto p = at::zeros({10}), m = at::zeros({10}), v = at::zeros({10}), g = at::zeros({10});
  AdamWHyper h;
  EXPECT_THROW(cpu_adam_update(p.to(at::kDouble), g, m, v, 1, h), Error);
  EXPECT_THROW(cpu_adam_update(p, g, m, at::zeros({9}), 1, h), Error);
  EXPECT_THROW(cpu_adam_update(p, at::zeros({20}).slice(0, 0, 20, 2), m, v, 1, h), Error);
  EXPECT_THROW(cpu_adam_update(p, g.to(at::kInt), m, v, 1, h), Error);
  EXPECT_THROW(cpu_adam_update(p, g, m, v, 0, h), Error);
  EXPECT_THROW(cpu_adam_update(p, g, m, v, 1, h, 0.0), Error);
  EXPECT_THROW(cpu_adam_update(p, g, m, v, 1, h, 1.0, at::zeros({10}, at::kInt)), Error);
  try {
    cpu_adam_update(p, g, m, v, 1, h, 1.0, at::zeros({3}, at::kBFloat16));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("param_out"), std::string::npos) << e.what();
  }
}

}  // namespace
