// Optimizer state export -> import -> continued steps must equal uninterrupted steps bitwise,
// for AdamW (fused and foreach, fp32 and bf16 with fp32 masters) and SGD with momentum; plus
// the flat-shard free functions agree with the class and bad states are clear errors.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "colossal/core/error.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/lr_scheduler.h"
#include "colossal/optim/sgd.h"

using namespace colossal;
using namespace colossal::optim;

namespace {
using Factory = std::function<std::unique_ptr<Optimizer>()>;

std::vector<at::Tensor> make_params(at::ScalarType dt) {
  at::manual_seed(0);
  std::vector<at::Tensor> ps = {at::randn({5, 3}), at::randn({7}), at::randn({2, 2, 2})};
  for (auto& p : ps) {
    p = p.to(dt);
    p.set_requires_grad(true);
  }
  return ps;
}

void set_grads(std::vector<at::Tensor>& ps, int step) {
  at::manual_seed(100 + step);
  for (size_t i = 0; i < ps.size(); ++i) {
    // Parameter 1 gets no grad on step 2: its step count must lag and survive the round trip.
    if (i == 1 && step == 2) {
      ps[i].mutable_grad() = at::Tensor();
      continue;
    }
    ps[i].mutable_grad() = at::randn(ps[i].sizes()).to(ps[i].scalar_type());
  }
}

std::unique_ptr<Optimizer> build(const Factory& f, std::vector<at::Tensor>& ps, GroupOptions go) {
  auto opt = f();
  opt->add_param_group({{"a", ps[0]}, {"b", ps[1]}}, go);
  GroupOptions g2 = go;
  g2.weight_decay = 0.0;
  g2.lr = go.lr * 0.5;
  opt->add_param_group({{"c", ps[2]}}, g2);
  return opt;
}

void check_resume_bitwise(const Factory& f, at::ScalarType dt, GroupOptions go) {
  auto ref = make_params(dt);
  auto ref_opt = build(f, ref, go);
  for (int s = 0; s < 6; ++s) {
    set_grads(ref, s);
    ref_opt->step();
  }
  auto a = make_params(dt);
  auto a_opt = build(f, a, go);
  for (int s = 0; s < 3; ++s) {
    set_grads(a, s);
    a_opt->step();
  }
  StateDict sd = a_opt->state_dict();
  // A fresh optimizer over fresh parameters that only know the working values (as after a
  // model checkpoint load): the state (masters included) must carry everything else.
  auto b = make_params(dt);
  for (size_t i = 0; i < b.size(); ++i) {
    c10::NoGradGuard ng;
    b[i].copy_(a[i]);
  }
  auto b_opt = build(f, b, go);
  // Round-trip the state through clones so nothing aliases the old optimizer.
  StateDict copy;
  copy.scalars = json::parse(sd.scalars.dump());
  for (auto& [n, t] : sd.tensors) copy.tensors.emplace_back(n, t.clone());
  b_opt->load_state_dict(copy);
  for (int s = 3; s < 6; ++s) {
    set_grads(b, s);
    b_opt->step();
  }
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(at::equal(ref[i], b[i])) << "param " << i;
  EXPECT_EQ(b_opt->state("b")->step, 5);
  EXPECT_EQ(b_opt->state("a")->step, 6);
}
}  // namespace

TEST(OptimState, AdamWFusedResumeBitwise) {
  GroupOptions go;
  go.lr = 1e-2;
  go.weight_decay = 0.1;
  check_resume_bitwise([] { return std::make_unique<AdamW>(OptimizerOptions{}, AdamWImpl::Fused); },
                       at::kFloat, go);
}

TEST(OptimState, AdamWForEachResumeBitwise) {
  GroupOptions go;
  go.lr = 1e-2;
  go.weight_decay = 0.1;
  check_resume_bitwise(
      [] { return std::make_unique<AdamW>(OptimizerOptions{}, AdamWImpl::ForEach); }, at::kFloat,
      go);
}

TEST(OptimState, AdamWBf16MastersResumeBitwise) {
  GroupOptions go;
  go.lr = 1e-2;
  go.weight_decay = 0.1;
  check_resume_bitwise([] { return std::make_unique<AdamW>(); }, at::kBFloat16, go);
}

TEST(OptimState, SGDMomentumResumeBitwise) {
  GroupOptions go;
  go.lr = 0.05;
  go.momentum = 0.9;
  go.dampening = 0.1;
  go.weight_decay = 0.01;
  check_resume_bitwise([] { return std::make_unique<SGD>(); }, at::kFloat, go);
  go.dampening = 0;
  go.nesterov = true;
  check_resume_bitwise([] { return std::make_unique<SGD>(); }, at::kBFloat16, go);
}

TEST(OptimState, MastersKeepPrecisionAndWorkingFollows) {
  auto ps = make_params(at::kBFloat16);
  AdamW opt;
  GroupOptions go;
  go.lr = 1e-4;  // updates far below bf16 resolution: only the master can accumulate them
  opt.add_param_group({{"a", ps[0]}}, go);
  at::Tensor before = opt.master("a").clone();
  for (int s = 0; s < 3; ++s) {
    ps[0].mutable_grad() = at::ones_like(ps[0]);
    opt.step();
  }
  EXPECT_FALSE(at::equal(before, opt.master("a")));
  EXPECT_TRUE(at::equal(ps[0], opt.master("a").to(at::kBFloat16)));
  EXPECT_EQ(opt.master("a").scalar_type(), at::kFloat);
}

TEST(OptimState, FlatShardFunctionsMatchClass) {
  // The free function over flat shards of the concatenated parameters equals per-tensor steps.
  auto ps = make_params(at::kFloat);
  AdamW opt(OptimizerOptions{}, AdamWImpl::ForEach);
  GroupOptions go;
  go.lr = 1e-2;
  go.weight_decay = 0.1;
  opt.add_param_group({{"a", ps[0]}, {"b", ps[1]}, {"c", ps[2]}}, go);
  std::vector<at::Tensor> flat_parts;
  for (auto& p : ps) flat_parts.push_back(p.detach().reshape(-1));
  at::Tensor flat = at::cat(flat_parts);
  at::Tensor m = at::zeros_like(flat), v = at::zeros_like(flat);
  int64_t half = flat.numel() / 2;
  for (int s = 0; s < 3; ++s) {
    set_grads(ps, s == 2 ? 0 : s);  // every param gets a grad
    std::vector<at::Tensor> gparts;
    for (auto& p : ps) gparts.push_back(p.grad().reshape(-1));
    at::Tensor gflat = at::cat(gparts);
    opt.step();
    const AdamWHyper& h = go;  // a group passes as its AdamW hyper-parameters
    // Two "ranks" each update their own shard.
    adamw_update({flat.slice(0, 0, half)}, {gflat.slice(0, 0, half)}, {m.slice(0, 0, half)},
                 {v.slice(0, 0, half)}, s + 1, h, AdamWImpl::ForEach);
    adamw_update({flat.slice(0, half)}, {gflat.slice(0, half)}, {m.slice(0, half)},
                 {v.slice(0, half)}, s + 1, h, AdamWImpl::ForEach);
  }
  std::vector<at::Tensor> now;
  for (auto& p : ps) now.push_back(p.detach().reshape(-1));
  EXPECT_TRUE(at::equal(at::cat(now), flat));
}

TEST(OptimState, GradDivisorEqualsPreDividedGrads) {
  at::manual_seed(3);
  at::Tensor p1 = at::randn({64}), p2 = p1.clone(), g = at::randn({64}) * 1024;
  at::Tensor m1 = at::zeros({64}), v1 = at::zeros({64}), m2 = m1.clone(), v2 = v1.clone();
  AdamWHyper h;
  adamw_update({p1}, {g.clone()}, {m1}, {v1}, 1, h, AdamWImpl::Fused, 1024.0);
  adamw_update({p2}, {g / 1024.0}, {m2}, {v2}, 1, h, AdamWImpl::Fused);
  EXPECT_TRUE(at::allclose(p1, p2, 1e-6, 1e-7));
  at::Tensor p3 = at::randn({64}), p4 = p3.clone(), m3 = at::zeros({64}), v3 = at::zeros({64}),
             m4 = at::zeros({64}), v4 = at::zeros({64});
  adamw_update({p3}, {g.clone()}, {m3}, {v3}, 1, h, AdamWImpl::ForEach, 1024.0);
  adamw_update({p4}, {g / 1024.0}, {m4}, {v4}, 1, h, AdamWImpl::ForEach);
  EXPECT_TRUE(at::allclose(p3, p4, 1e-6, 1e-7));
}

TEST(OptimState, BadStatesAreInputErrors) {
  auto ps = make_params(at::kFloat);
  GroupOptions go;
  auto a = build([] { return std::make_unique<AdamW>(); }, ps, go);
  set_grads(ps, 0);
  a->step();
  StateDict sd = a->state_dict();
  auto sgd = build([] { return std::make_unique<SGD>(); }, ps, go);
  EXPECT_THROW(sgd->load_state_dict(sd), InputError);  // wrong optimizer type
  auto b = build([] { return std::make_unique<AdamW>(); }, ps, go);
  StateDict missing = sd;
  missing.tensors.erase(missing.tensors.begin());
  EXPECT_THROW(b->load_state_dict(missing), InputError);
  StateDict bad_shape = sd;
  bad_shape.tensors[0].second = at::zeros({1});
  EXPECT_THROW(b->load_state_dict(bad_shape), InputError);
  try {
    b->load_state_dict(bad_shape);
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(bad_shape.tensors[0].first), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(a->add_param_group({{"a", at::zeros({1})}}, go), InputError);  // duplicate name
}

TEST(LRSchedule, StateSaveLoadResumes) {
  at::Tensor p = at::zeros({1});
  SGD o1, o2;
  GroupOptions go;
  go.lr = 0.3;
  o1.add_param_group({{"p", p}}, go);
  o2.add_param_group({{"p", p}}, go);
  LRScheduleOptions so;
  so.kind = ScheduleKind::Cosine;
  so.warmup_steps = 3;
  so.total_steps = 20;
  so.min_lr_ratio = 0.1;
  LRScheduler s1(o1, so);
  for (int i = 0; i < 7; ++i) s1.step();
  // o2's lr was already rescaled by its own scheduler; load must restore the base lrs.
  LRScheduler s2(o2, so);
  s2.step();
  s2.load_state_dict(json::parse(s1.state_dict().dump()));
  for (int i = 0; i < 5; ++i) {
    s1.step();
    s2.step();
    EXPECT_EQ(s1.lrs()[0], s2.lrs()[0]);
  }
  EXPECT_THROW(schedule_kind_from_string("step"), InputError);
  LRScheduleOptions bad;
  bad.kind = ScheduleKind::Linear;
  EXPECT_THROW(LRScheduler(o1, bad), InputError);
}

// On a CUDA machine (skipped elsewhere): the fused CUDA AdamW step (fp32, and bf16 with fp32
// masters) equals the CPU foreach step, so ZeRO/Gemini can mix CPU and GPU shards.
TEST(OptimState, CudaMatchesCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    auto cpu = make_params(dt);
    std::vector<at::Tensor> gpu;
    for (auto& p : cpu) {
      gpu.push_back(p.detach().to(at::kCUDA));
      gpu.back().set_requires_grad(true);
    }
    GroupOptions go;
    go.lr = 1e-2;
    go.weight_decay = 0.1;
    auto oc = build([] { return std::make_unique<AdamW>(OptimizerOptions{}, AdamWImpl::ForEach); },
                    cpu, go);
    auto og = build([] { return std::make_unique<AdamW>(OptimizerOptions{}, AdamWImpl::Fused); },
                    gpu, go);
    for (int s = 0; s < 4; ++s) {
      set_grads(cpu, s);
      for (size_t i = 0; i < cpu.size(); ++i)
        gpu[i].mutable_grad() =
            cpu[i].grad().defined() ? cpu[i].grad().to(at::kCUDA) : at::Tensor();
      oc->step();
      og->step();
    }
    const char* names[] = {"a", "b", "c"};
    for (size_t i = 0; i < cpu.size(); ++i) {
      at::Tensor mc = oc->master(names[i]), mg = og->master(names[i]);
      if (mc.defined()) {
        EXPECT_TRUE(at::allclose(mc, mg.cpu(), 1e-6, 1e-7)) << "master " << i;
      }
      EXPECT_TRUE(at::allclose(cpu[i].to(at::kFloat), gpu[i].cpu().to(at::kFloat),
                               dt == at::kFloat ? 1e-6 : 8e-3, 1e-7))
          << "param " << i << " dtype " << dt;
    }
  }
}
