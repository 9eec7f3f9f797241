// CPU Adam benchmark (C++ side of bench/cpu_adam.sh): one JSON line per measurement, median of
// `repeats` interleaved rounds after one warm-up round, all at the given thread count.
//   copy          dst.copy_(src) and a threaded memcpy of n fp32 (the machine's memory
//                 bandwidth; 8 bytes per element: read + write)
//   fp32          the plain step: fp32 param, grad, exp_avg, exp_avg_sq (28 bytes per parameter:
//                 param, m, v read and written, grad read)
//   bf16          the offload step: bf16 grad in, fp32 master, m, v updated, bf16 param written
//                 (also 28 bytes: 24 fp32 + 2 grad + 2 out)
// for the CPU Adam paths asked for, and for ATen's at::_fused_adamw_ (what
// torch.optim.AdamW(fused=True) runs; for bf16 it needs upcast + step + downcast).
// usage: bench_cpu_adam [n=100000000] [threads=1] [repeats=7] [paths=auto,avx2,scalar]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "colossal/optim/cpu_adam.h"

using namespace colossal::optim;

namespace {

void report(const std::string& impl, const std::string& mode, int64_t n, int threads,
            double seconds, double bytes_per_elem) {
  std::printf(
      "{\"side\": \"cpp\", \"impl\": \"%s\", \"mode\": \"%s\", \"n\": %lld, \"threads\": %d, "
      "\"median_s\": %.6f, \"elems_per_s\": %.4e, \"gb_per_s\": %.3f}\n",
      impl.c_str(), mode.c_str(), static_cast<long long>(n), threads, seconds, n / seconds,
      n * bytes_per_elem / seconds / 1e9);
  std::fflush(stdout);
}

CpuAdamPath parse_path(const std::string& s) {
  if (s == "auto") return cpu_adam_default_path();
  if (s == "avx512") return CpuAdamPath::AVX512;
  if (s == "avx2") return CpuAdamPath::AVX2;
  if (s == "scalar") return CpuAdamPath::Scalar;
  std::fprintf(stderr, "unknown path '%s' (auto, avx512, avx2, scalar)\n", s.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::stoll(argv[1]) : 100'000'000;
  const int threads = argc > 2 ? std::stoi(argv[2]) : 1;
  const int repeats = argc > 3 ? std::stoi(argv[3]) : 7;
  const std::string path_list = argc > 4 ? argv[4] : "auto";
  at::set_num_threads(threads);
  c10::NoGradGuard no_grad;
  at::manual_seed(0);

  struct Case {
    std::string impl, mode;
    double bytes;
    std::function<void()> fn;
    std::vector<double> times;
  };
  std::vector<Case> cases;

  auto src = at::rand({n}), dst = at::zeros({n});
  const float* s = src.data_ptr<float>();
  float* d = dst.data_ptr<float>();
  cases.push_back({"aten", "copy", 8.0, [&] { dst.copy_(src); }, {}});
  // A memcpy split over `threads` std::threads (at::parallel_for would run serially here: it is
  // parallel only in files built with OpenMP).
  cases.push_back({"memcpy",
                   "copy",
                   8.0,
                   [&] {
                     const int64_t chunk = (n + threads - 1) / threads;
                     std::vector<std::thread> ws;
                     for (int64_t b = chunk; b < n; b += chunk)
                       ws.emplace_back([=] {
                         std::memcpy(d + b, s + b,
                                     static_cast<size_t>(std::min(n, b + chunk) - b) * 4);
                       });
                     std::memcpy(d, s, static_cast<size_t>(std::min(n, chunk)) * 4);
                     for (auto& w : ws) w.join();
                   },
                   {}});

  auto p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  auto g = at::randn({n}) * 1e-2;
  auto g16 = g.to(at::kBFloat16);
  auto out16 = at::zeros({n}, at::kBFloat16);
  AdamWHyper h{1e-4, 0.9, 0.999, 1e-8, 0.01};
  int64_t step = 0;

  std::stringstream ss(path_list);
  for (std::string name; std::getline(ss, name, ',');) {
    CpuAdamPath path = parse_path(name);
    std::string impl = std::string("cpu_adam_") + cpu_adam_path_name(path);
    cases.push_back({impl,
                     "fp32",
                     28.0,
                     [&, path] { cpu_adam_update(p, g, m, v, ++step, h, 1.0, {}, path); },
                     {}});
    cases.push_back({impl,
                     "bf16",
                     28.0,
                     [&, path] { cpu_adam_update(p, g16, m, v, ++step, h, 1.0, out16, path); },
                     {}});
  }

  // ATen's fused AdamW (torch.optim.AdamW(fused=True) calls this kernel); for the offload step
  // it needs an upcast of the gradient and a downcast of the weights around it.
  auto step_t = at::zeros({}, at::kFloat);
  auto fused = [&] {
    step_t.add_(1);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step_t}, h.lr, h.beta1, h.beta2, h.weight_decay,
                      h.eps, false, false, std::nullopt, std::nullopt);
  };
  cases.push_back({"aten_fused_adamw", "fp32", 28.0, fused, {}});
  cases.push_back({"aten_fused_adamw",
                   "bf16",
                   28.0,
                   [&] {
                     g.copy_(g16);
                     fused();
                     out16.copy_(p);
                   },
                   {}});

  // Interleaved rounds (one warm-up round), so load from other processes on a shared machine
  // hits every case alike; medians per case.
  for (int r = 0; r <= repeats; ++r)
    for (auto& c : cases) {
      auto t0 = std::chrono::steady_clock::now();
      c.fn();
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) c.times.push_back(t);
    }
  for (auto& c : cases) {
    std::sort(c.times.begin(), c.times.end());
    report(c.impl, c.mode, n, threads, c.times[c.times.size() / 2], c.bytes);
  }
  return 0;
}
