// Micro-benchmark: chunked fused linear + cross-entropy (nn/fused_ce.h) against the unfused
// cross_entropy_loss(linear(h, W).float()) on CPU, forward + backward. Prints the time of each
// and their peak extra memory (bytes alive at once, counted by a CPU allocator hook).
//   bench_fused_ce [tokens=8192] [hidden=512] [vocab=32000] [chunk=1024] [fp32|bf16] [reps=3]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "colossal/nn/fused_ce.h"

namespace {

struct Counting final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0}, peak{0};
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

Counting counter;

void Counting::release(void* p) {
  Counting& a = counter;
  std::pair<c10::DataPtr, int64_t> entry;
  {
    std::lock_guard<std::mutex> g(a.mu);
    auto it = a.table.find(p);
    entry = std::move(it->second);
    a.table.erase(it);
  }
  a.live -= entry.second;
}  // entry.first frees the memory

}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, int64_t d) { return argc > i ? std::atoll(argv[i]) : d; };
  const int64_t n = arg(1, 8192), hd = arg(2, 512), v = arg(3, 32000), chunk = arg(4, 1024);
  const std::string dt = argc > 5 ? argv[5] : "fp32";
  const int reps = static_cast<int>(arg(6, 3));
  const at::ScalarType dtype = dt == "bf16" ? at::kBFloat16 : at::kFloat;
  at::manual_seed(0);
  at::Tensor h0 = at::randn({n, hd}).to(dtype), w0 = (at::randn({v, hd}) * 0.05).to(dtype);
  at::Tensor t = at::randint(0, v, {n}, at::kLong);
  auto once = [&](bool fused) {
    at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    counter.base = c10::GetCPUAllocator();
    counter.live = 0;
    counter.peak = 0;
    c10::SetCPUAllocator(&counter, 100);
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor loss;
    if (fused) {
      colossal::nn::FusedCEOptions o;
      o.chunk_tokens = chunk;
      loss = colossal::nn::fused_linear_cross_entropy(h, w, t, o);
    } else {
      loss = at::cross_entropy_loss(at::linear(h, w).to(at::kFloat), t);
    }
    loss.backward();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    c10::SetCPUAllocator(counter.base, 100);
    return std::make_pair(s, counter.peak.load());
  };
  std::printf("tokens %lld hidden %lld vocab %lld chunk %lld %s, threads %d\n", (long long)n,
              (long long)hd, (long long)v, (long long)chunk, dt.c_str(), at::get_num_threads());
  for (bool fused : {false, true}) {
    once(fused);  // warm-up
    double best = 1e30;
    int64_t peak = 0;
    for (int r = 0; r < reps; ++r) {
      auto [s, p] = once(fused);
      best = std::min(best, s);
      peak = std::max(peak, p);
    }
    std::printf("%-8s fwd+bwd %8.1f ms  peak extra %8.1f MiB\n", fused ? "fused" : "unfused",
                best * 1e3, peak / 1048576.0);
  }
  return 0;
}
