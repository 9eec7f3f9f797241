// Internal to src/kernels/: helpers of the CPU loops in the per-op files. The loops do fp32
// math and round to the working dtype where the ATen composite rounds, so the results match it
// (see kernels/fused.h). Large inputs are split over std::threads (LibTorch's own intra-op pool
// is not used from project code).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "colossal/core/error.h"

namespace colossal::kernels::cpu {

inline int max_threads() {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, std::min(hw, at::get_num_threads()));
}

// Elements per thread below which a thread is not worth starting (spawn ~ tens of us).
constexpr int64_t kGrain = int64_t(1) << 18;

// Threads for n work items of which each thread should get at least `grain`.
inline int threads_for(int64_t n, int64_t grain) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(max_threads(), n / std::max<int64_t>(1, grain))));
}

// f(thread, begin, end) over [0, n) in `nt` contiguous slices; slice 0 runs on this thread.
template <class F>
void parallel(int64_t n, int nt, const F& f) {
  if (nt <= 1) {
    f(0, int64_t(0), n);
    return;
  }
  const int64_t chunk = (n + nt - 1) / nt;
  std::vector<std::thread> pool;
  pool.reserve(nt - 1);
  for (int t = 1; t < nt; ++t) {
    const int64_t b = std::min(n, t * chunk), e = std::min(n, (t + 1) * chunk);
    pool.emplace_back([&f, t, b, e] { f(t, b, e); });
  }
  f(0, int64_t(0), std::min(n, chunk));
  for (auto& th : pool) th.join();
}

// The value an op with result dtype T stores for the fp32 result x.
template <typename T>
inline float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// f(T{}) for the element type of st (float, bfloat16, half); InputError naming `name` else.
template <typename F>
void dispatch(at::ScalarType st, const char* name, F&& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      throw InputError(str(name, ": dtype ", st, " is not supported (float, bfloat16, half)"));
  }
}

}  // namespace colossal::kernels::cpu
