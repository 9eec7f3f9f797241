// Chunked linear + cross-entropy (nn/fused_ce.h) against ATen's unfused
// cross_entropy_loss(linear(h, W).float()): loss and gradients, odd sizes, ignore_index rows,
// fp32 and bf16; the memory it allocates, counted by a CPU allocator hook; CausalLM::forward_loss.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "colossal/models/llama/model.h"
#include "colossal/nn/fused_ce.h"
#include "colossal/nn/init.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;

namespace {

struct Case {
  at::Tensor h, w, t;
};

// hidden [B, S, H] and targets [B, S] with about a sixth of them ignore_index.
Case make_case(int64_t b, int64_t s, int64_t hd, int64_t v, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  Case c;
  c.h = at::randn({b, s, hd}).to(dtype).requires_grad_(true);
  c.w = (at::randn({v, hd}) * 0.3).to(dtype).requires_grad_(true);
  c.t = at::randint(0, v, {b, s}, at::kLong);
  c.t.masked_fill_(at::rand({b, s}) < 1.0 / 6, -100);
  return c;
}

struct Result {
  at::Tensor loss, gh, gw;
};

Result run(const Case& c, bool fused, int64_t chunk, double grad_scale = 1.0) {
  at::Tensor h = c.h.detach().clone().requires_grad_(true);
  at::Tensor w = c.w.detach().clone().requires_grad_(true);
  at::Tensor loss;
  if (fused) {
    FusedCEOptions o;
    o.chunk_tokens = chunk;
    loss = fused_linear_cross_entropy(h, w, c.t, o);
  } else {
    at::Tensor logits = at::linear(h, w).to(at::kFloat);
    loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), c.t.reshape({-1}),
                                  std::nullopt, at::Reduction::Mean, -100);
  }
  (loss * grad_scale).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

// max |a - b| / max(max |b|, tiny)
double rel(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
  return (a32 - b32).abs().max().item<double>() / std::max(b32.abs().max().item<double>(), 1e-30);
}

}  // namespace

// fp32: equal within fp32 rounding. Bound: 2e-6 of the largest value (the sums reassociate over
// chunks; float eps is 1.2e-7 and the longest reduction here is 517 terms).
TEST(FusedCE, MatchesAtenFp32OddSizes) {
  Case c = make_case(3, 67, 40, 517, at::kFloat, 1);  // 201 tokens, odd vocab
  Result ref = run(c, false, 0, 0.37);
  for (int64_t chunk : {0, 1, 64, 100, 201, 4096}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    Result f = run(c, true, chunk, 0.37);
    EXPECT_EQ(f.loss.scalar_type(), at::kFloat);
    EXPECT_LT(rel(f.loss, ref.loss), 2e-6);
    EXPECT_LT(rel(f.gh, ref.gh), 2e-6);
    EXPECT_LT(rel(f.gw, ref.gw), 2e-6);
  }
}

// bf16: both compute the logits in bf16 and the softmax in fp32, so they differ by bf16 rounding
// of dlogits/products (2^-8 relative). Checked against the bf16 reference at 2e-2 of the
// largest value and, tighter, against an fp32 ground truth: the fused error is no larger than
// twice the unfused one (it accumulates dW over chunks in fp32).
TEST(FusedCE, MatchesAtenBf16) {
  Case c = make_case(2, 75, 64, 301, at::kBFloat16, 2);
  Result ref = run(c, false, 0);
  Result f = run(c, true, 32);
  EXPECT_EQ(f.gh.scalar_type(), at::kBFloat16);
  EXPECT_EQ(f.gw.scalar_type(), at::kBFloat16);
  EXPECT_LT(rel(f.loss, ref.loss), 2e-3);
  EXPECT_LT(rel(f.gh, ref.gh), 2e-2);
  EXPECT_LT(rel(f.gw, ref.gw), 2e-2);
  Case c32{c.h.detach().to(at::kFloat), c.w.detach().to(at::kFloat), c.t};
  Result truth = run(c32, false, 0);
  EXPECT_LE(rel(f.gw, truth.gw), 2 * rel(ref.gw, truth.gw) + 1e-3);
  EXPECT_LE(rel(f.gh, truth.gh), 2 * rel(ref.gh, truth.gh) + 1e-3);
}

// fp16 with a loss scale (as the fp16 optimizer runs it): 1/count is applied after the scale,
// so long batches do not underflow dlogits. Against an fp32 ground truth the fused error stays
// within twice the unfused one (both round logits and dlogits to fp16, ~1e-3 relative).
TEST(FusedCE, Fp16WithLossScale) {
  // 8192 tokens, vocab 2001: softmax entries / count are ~6e-8, below fp16's smallest subnormal.
  Case c = make_case(8, 1024, 16, 2001, at::kHalf, 6);
  const double scale = 65536;
  Result ref = run(c, false, 0, scale);
  Result f = run(c, true, 1024, scale);
  EXPECT_EQ(f.gw.scalar_type(), at::kHalf);
  Case c32{c.h.detach().to(at::kFloat), c.w.detach().to(at::kFloat), c.t};
  Result truth = run(c32, false, 0, scale);
  EXPECT_LT(rel(f.loss, truth.loss), 2e-3);
  EXPECT_LE(rel(f.gh, truth.gh), 2 * rel(ref.gh, truth.gh) + 1e-3);
  EXPECT_LE(rel(f.gw, truth.gw), 2 * rel(ref.gw, truth.gw) + 1e-3);
  std::printf("fp16 rel err gh: fused %.2e unfused %.2e; gw: fused %.2e unfused %.2e\n",
              rel(f.gh, truth.gh), rel(ref.gh, truth.gh), rel(f.gw, truth.gw),
              rel(ref.gw, truth.gw));
}

TEST(FusedCE, IgnoredRowsAndNoGrad) {
  Case c = make_case(1, 9, 8, 13, at::kFloat, 3);
  c.t.fill_(-100);
  at::Tensor ref =
      at::cross_entropy_loss(at::linear(c.h.detach(), c.w.detach()).reshape({-1, 13}),
                             c.t.reshape({-1}), std::nullopt, at::Reduction::Mean, -100);
  EXPECT_TRUE(std::isnan(ref.item<double>()));
  at::NoGradGuard ng;
  at::Tensor f = fused_linear_cross_entropy(c.h, c.w, c.t);
  EXPECT_TRUE(std::isnan(f.item<double>()));
  EXPECT_FALSE(f.requires_grad());
}

TEST(FusedCE, RejectsBadShapes) {
  Case c = make_case(1, 4, 8, 13, at::kFloat, 4);
  EXPECT_ANY_THROW(fused_linear_cross_entropy(c.h, c.w.t(), c.t));
  EXPECT_ANY_THROW(fused_linear_cross_entropy(c.h, c.w, c.t.narrow(1, 0, 3)));
  EXPECT_ANY_THROW(fused_linear_cross_entropy(c.h, c.w.to(at::kDouble), c.t));
}

namespace {

// Wraps the CPU allocator: counts live bytes, their peak, and the largest single allocation.
struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0}, peak{0}, largest{0};
  // The context is the data pointer itself (raw_allocate, used by oneDNN, requires it); the
  // wrapped allocation is found again in a table.
  std::mutex mu;
  std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>> table;
  static void release(void* p);
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    c10::Device dev = inner.device();
    const int64_t now = live += static_cast<int64_t>(n);
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
    int64_t l = largest.load();
    while (static_cast<int64_t>(n) > l && !largest.compare_exchange_weak(l, n)) {
    }
    {
      std::lock_guard<std::mutex> g(mu);
      table.emplace(data, std::make_pair(std::move(inner), static_cast<int64_t>(n)));
    }
    return {data, data, &release, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator& counter() {
  static CountingAllocator a;  // outlives every tensor it allocated
  return a;
}

void CountingAllocator::release(void* p) {
  CountingAllocator& a = counter();
  std::pair<c10::DataPtr, int64_t> entry;
  {
    std::lock_guard<std::mutex> g(a.mu);
    auto it = a.table.find(p);
    entry = std::move(it->second);
    a.table.erase(it);
  }
  a.live -= entry.second;
}  // entry.first frees the memory

// Runs fn with the counting allocator installed; returns {peak live bytes, largest allocation}.
template <class F>
std::pair<int64_t, int64_t> measure(F fn) {
  CountingAllocator& a = counter();
  a.base = c10::GetCPUAllocator();
  a.live = 0;
  a.peak = 0;
  a.largest = 0;
  c10::SetCPUAllocator(&a, /*priority=*/100);
  fn();
  c10::SetCPUAllocator(a.base, /*priority=*/100);
  return {a.peak.load(), a.largest.load()};
}

}  // namespace

// The chunk loop never allocates [tokens, vocab]: every allocation is at most one fp32 chunk of
// logits or a gradient-sized buffer, and the peak is a few chunks plus the gradients, while the
// unfused path peaks above two full fp32 logits.
TEST(FusedCE, PeakMemoryIsOneChunk) {
  const int64_t n = 2048, hd = 32, v = 1000, chunk = 128;
  Case c = make_case(1, n, hd, v, at::kFloat, 5);
  auto step = [&](bool fused) {
    at::Tensor h = c.h.detach().clone().requires_grad_(true);
    at::Tensor w = c.w.detach().clone().requires_grad_(true);
    return measure([&] {
      at::Tensor loss;
      if (fused) {
        FusedCEOptions o;
        o.chunk_tokens = chunk;
        loss = fused_linear_cross_entropy(h, w, c.t, o);
      } else {
        loss = at::cross_entropy_loss(at::linear(h, w).reshape({-1, v}), c.t.reshape({-1}),
                                      std::nullopt, at::Reduction::Mean, -100);
      }
      loss.backward();
    });
  };
  auto [fused_peak, fused_largest] = step(true);
  auto [unfused_peak, unfused_largest] = step(false);
  const int64_t f32 = 4, full = n * v * f32, one_chunk = chunk * v * f32;
  const int64_t grads = (n * hd + v * hd) * f32;
  EXPECT_GE(unfused_largest, full);  // the hook sees the unfused logits
  EXPECT_GE(unfused_peak, 2 * full);
  EXPECT_LE(fused_largest, std::max({one_chunk, n * hd * f32, v * hd * f32}));
  // grads (saved + returned) and at most 4 chunk-sized temporaries alive at once.
  EXPECT_LE(fused_peak, 2 * grads + 4 * one_chunk + 64 * 1024);
  std::printf("peak extra bytes: fused %lld, unfused %lld\n", (long long)fused_peak,
              (long long)unfused_peak);
}

namespace {

ModelConfig tiny_config(bool tied) {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 101;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.layer_sliding.assign(2, false);
  c.tie_word_embeddings = tied;
  return c;
}

}  // namespace

// CausalLM::forward_loss == cross_entropy(forward(ids)) with the same parameter gradients,
// tied and untied heads.
TEST(FusedCE, CausalLMForwardLoss) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    auto m = std::make_shared<CausalLM>(tiny_config(tied));
    InitOptions io;
    io.seed = 7;
    io.std = 0.2;
    init_parameters(*m, io);
    at::manual_seed(8);
    at::Tensor ids = at::randint(0, 101, {2, 13}, at::kLong);
    at::Tensor targets = at::randint(0, 101, {2, 13}, at::kLong);
    targets.index_put_({0, 3}, -100);
    auto params = m->parameters();
    at::Tensor logits = m->forward(ids);
    at::Tensor ref =
        at::cross_entropy_loss(logits.reshape({-1, 101}).to(at::kFloat), targets.reshape({-1}),
                               std::nullopt, at::Reduction::Mean, -100);
    ref.backward();
    std::vector<at::Tensor> ref_grads;
    for (auto& p : params) {
      ref_grads.push_back(p.grad().clone());
      p.mutable_grad() = at::Tensor();
    }
    at::Tensor loss = m->forward_loss(ids, targets, /*chunk_tokens=*/5);
    loss.backward();
    EXPECT_LT(rel(loss, ref), 2e-6);
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_LT(rel(params[i].grad(), ref_grads[i]), 1e-5) << i;
  }
}
