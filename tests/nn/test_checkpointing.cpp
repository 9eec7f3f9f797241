// Activation checkpointing: the same loss and gradients as keeping every activation (full and
// attention-only recompute), RNG replay for random blocks, and fewer bytes alive after forward
// (measured by a counting CPU allocator installed for the test).
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/checkpointing.h"
#include "colossal/nn/init.h"
#include "common/tiny_llama.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;

namespace {

ModelConfig small_config() {
  return tests::tiny_llama(3, 96);
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& c) {
  auto m = std::make_shared<CausalLM>(c);
  InitOptions io;
  io.seed = 7;
  io.std = 0.2;
  init_parameters(*m, io);
  return m;
}

struct StepResult {
  double loss;
  std::map<std::string, at::Tensor> grads;
};

StepResult train_step(CheckpointMode mode, const at::Tensor& ids) {
  auto m = make_model(small_config());
  m->set_activation_checkpointing(mode);
  at::Tensor loss = causal_lm_loss(m->forward(ids), ids);
  loss.backward();
  StepResult r{loss.item<double>(), {}};
  for (const auto& p : m->named_parameters()) r.grads[p.key()] = p.value().grad().clone();
  return r;
}

// Counts live bytes of every CPU allocation while installed.
struct CountingAllocator : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0};
  struct Ctx {
    c10::DataPtr inner;
    size_t n;
    CountingAllocator* owner;
  };
  static void free_ctx(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->live -= static_cast<int64_t>(ctx->n);
    delete ctx;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    live += static_cast<int64_t>(n);
    auto* ctx = new Ctx{std::move(inner), n, this};
    return {data, ctx, &free_ctx, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

TEST(Checkpointing, FullAndAttentionEqualNoRecompute) {
  at::manual_seed(3);
  at::Tensor ids = at::randint(0, 96, {2, 16}, at::kLong);
  StepResult ref = train_step(CheckpointMode::None, ids);
  for (auto mode : {CheckpointMode::Full, CheckpointMode::Attention}) {
    const int64_t before = checkpoint_recompute_count();
    StepResult r = train_step(mode, ids);
    // The recompute runs the same ops on the same inputs: the forward is bitwise equal.
    EXPECT_EQ(r.loss, ref.loss) << to_string(mode);
    // One recompute per decoder layer.
    EXPECT_EQ(checkpoint_recompute_count() - before, 3) << to_string(mode);
    ASSERT_EQ(r.grads.size(), ref.grads.size());
    double worst = 0;
    for (const auto& [name, g] : ref.grads) {
      // Gradient sums may be formed in another order across the checkpoint boundary: <= 1e-6 rel.
      const at::Tensor& h = r.grads.at(name);
      double rel = (h - g).abs().max().item<double>() / (g.abs().max().item<double>() + 1e-30);
      EXPECT_LE(rel, 1e-6) << to_string(mode) << " " << name;
      worst = std::max(worst, rel);
    }
    std::printf("%s: largest relative gradient difference %.3g\n", to_string(mode), worst);
  }
}

// forward_deferred (the fused-kernel path's layer form: residual adds left to the next norm's
// forward_add) computes the same function as forward(): chained over the layers into the final
// norm, outputs and weight gradients equal the plain chain (on CPU forward_add is the add and
// the norm, so bitwise; on CUDA tests/kernels/test_model_cuda.cpp compares the fused model).
TEST(Checkpointing, DeferredResidualEqualsForward) {
  at::manual_seed(5);
  auto m = make_model(small_config());
  at::Tensor x0 = at::randn({2, 16, 32});
  auto [cos, sin] = m->model->rotary_emb->forward_range(0, 16, at::kCPU, at::kFloat);
  LayerContext ctx;
  ctx.cos = cos;
  ctx.sin = sin;
  ctx.seq = SequenceInfo{0, 0, 16, 16};
  auto run = [&](bool deferred) {
    m->zero_grad();
    at::Tensor x = x0, delta;
    for (auto& layer : m->model->layers->layers) {
      if (deferred) {
        std::tie(x, delta) = layer->forward_deferred(x, delta, ctx);
      } else {
        x = layer->forward(x, ctx);
      }
    }
    at::Tensor y =
        deferred ? m->model->norm->forward_add(x, delta).second : m->model->norm->forward(x);
    (y * y).sum().backward();
    std::map<std::string, at::Tensor> g;
    for (const auto& p : m->named_parameters())
      if (p.value().grad().defined()) g[p.key()] = p.value().grad().clone();
    return std::make_pair(y.detach(), g);
  };
  auto [y_plain, g_plain] = run(false);
  auto [y_def, g_def] = run(true);
  EXPECT_TRUE(at::equal(y_plain, y_def));
  ASSERT_EQ(g_plain.size(), g_def.size());
  for (const auto& [name, g] : g_plain) EXPECT_TRUE(at::equal(g, g_def.at(name))) << name;
  // The rotary tables of a fixed range are built once and reused.
  auto again = m->model->rotary_emb->forward_range(0, 16, at::kCPU, at::kFloat);
  EXPECT_TRUE(again.first.is_same(cos));
  auto other = m->model->rotary_emb->forward_range(1, 17, at::kCPU, at::kFloat);
  EXPECT_TRUE(at::equal(other.first.narrow(1, 0, 15), cos.narrow(1, 1, 15)));
}

TEST(Checkpointing, ReplaysRngOfRandomBlocks) {
  at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  auto fn = [&](const at::Tensor& in) { return at::dropout(at::matmul(in, w), 0.5, true).tanh(); };
  at::manual_seed(11);
  at::Tensor y_ref = fn(x);
  y_ref.sum().backward();
  at::Tensor gw = w.grad().clone(), gx = x.grad().clone();
  w.mutable_grad().reset();
  x.mutable_grad().reset();
  at::manual_seed(11);
  at::Tensor y = checkpoint(fn, x, {w});
  at::Tensor after_forward = at::rand({4});  // the RNG stream continues as without recompute
  y.sum().backward();
  EXPECT_TRUE(at::equal(y, y_ref));
  EXPECT_TRUE(at::allclose(w.grad(), gw, 1e-6, 0));
  EXPECT_TRUE(at::allclose(x.grad(), gx, 1e-6, 0));
  at::manual_seed(11);
  (void)fn(x.detach());
  EXPECT_TRUE(at::equal(after_forward, at::rand({4})));
}

TEST(Checkpointing, NoGradAndModeNames) {
  at::Tensor x = at::randn({3}).requires_grad_(true);
  {
    at::NoGradGuard ng;
    at::Tensor y = checkpoint([](const at::Tensor& in) { return in * 2; }, x, {});
    EXPECT_FALSE(y.requires_grad());
  }
  EXPECT_EQ(checkpoint_mode_from_string("attention"), CheckpointMode::Attention);
  EXPECT_THROW(checkpoint_mode_from_string("selective"), InputError);
}

TEST(Checkpointing, KeepsFewerBytesAfterForward) {
  CountingAllocator counter;
  counter.base = c10::GetCPUAllocator();
  ModelConfig c = small_config();
  c.hidden_size = 64;
  c.intermediate_size = 256;
  c.head_dim = 16;
  at::manual_seed(5);
  at::Tensor ids = at::randint(0, 96, {4, 128}, at::kLong);
  std::map<CheckpointMode, int64_t> held;
  uint8_t priority = 100;  // SetCPUAllocator ignores a priority below the current one
  for (auto mode : {CheckpointMode::None, CheckpointMode::Attention, CheckpointMode::Full}) {
    auto m = make_model(c);
    m->set_activation_checkpointing(mode);
    c10::SetCPUAllocator(&counter, ++priority);
    const int64_t start = counter.live.load();
    at::Tensor loss = causal_lm_loss(m->forward(ids), ids);
    held[mode] = counter.live.load() - start;  // activations kept for backward (+ the loss)
    loss.backward();
    loss = at::Tensor();
    c10::SetCPUAllocator(counter.base, ++priority);
  }
  std::printf("bytes alive after forward: none %lld, attention %lld, full %lld\n",
              static_cast<long long>(held[CheckpointMode::None]),
              static_cast<long long>(held[CheckpointMode::Attention]),
              static_cast<long long>(held[CheckpointMode::Full]));
  EXPECT_LT(held[CheckpointMode::Attention], held[CheckpointMode::None]);
  EXPECT_LT(held[CheckpointMode::Full], held[CheckpointMode::Attention]);
}
