// CPU Adam: argument checks, run-time path choice (CPU features, COLOSSAL_CPU_ADAM) and the
// split over threads; the per-ISA kernels are in cpu_adam_{scalar,avx2,avx512}.cpp.
#include "colossal/optim/cpu_adam.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <unistd.h>
#include <vector>

#include "colossal/core/error.h"
#include "cpu_adam_kernels.h"

namespace colossal::optim {
namespace {

using detail::AdamDtype;

bool cpu_has(CpuAdamPath path) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (path) {
    case CpuAdamPath::AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("avx2");
    case CpuAdamPath::AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default:
      return true;
  }
#else
  return path == CpuAdamPath::Scalar || path == CpuAdamPath::Auto;
#endif
}

CpuAdamPath detect_default() {
  CpuAdamPath best = cpu_has(CpuAdamPath::AVX512) ? CpuAdamPath::AVX512
                     : cpu_has(CpuAdamPath::AVX2) ? CpuAdamPath::AVX2
                                                  : CpuAdamPath::Scalar;
  const char* env = std::getenv("COLOSSAL_CPU_ADAM");
  if (!env || !*env) return best;
  std::string s(env);
  CpuAdamPath want;
  if (s == "scalar")
    want = CpuAdamPath::Scalar;
  else if (s == "avx2")
    want = CpuAdamPath::AVX2;
  else if (s == "avx512")
    want = CpuAdamPath::AVX512;
  else
    throw InputError(
        str("COLOSSAL_CPU_ADAM='", s, "' is not a CPU Adam path; use scalar, avx2 or avx512"));
  COLOSSAL_CHECK_INPUT(cpu_has(want), "COLOSSAL_CPU_ADAM=", s, " but this CPU lacks ", s,
                       "; unset it or pick scalar/avx2");
  return want;
}

AdamDtype dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return AdamDtype::F32;
    case at::kBFloat16:
      return AdamDtype::BF16;
    case at::kHalf:
      return AdamDtype::F16;
    default:
      COLOSSAL_CHECK(false, "cpu_adam_update: ", what,
                     " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return AdamDtype::None;
}

void check_fp32(const at::Tensor& t, const at::Tensor& param, const char* what) {
  COLOSSAL_CHECK(
      t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
      "cpu_adam_update: ", what, " must be a contiguous float32 CPU tensor, got ",
      t.defined() ? t.toString() : std::string("undefined"),
      t.defined() && !t.is_contiguous() ? " (not contiguous)" : "");
  COLOSSAL_CHECK(t.numel() == param.numel(), "cpu_adam_update: ", what, " has ", t.numel(),
                 " elements, param ", param.numel());
}

void check_half_or_fp32(const at::Tensor& t, const at::Tensor& param, const char* what) {
  COLOSSAL_CHECK(t.device().is_cpu() && t.is_contiguous(), "cpu_adam_update: ", what,
                 " must be a contiguous CPU tensor, got ", t.toString(), " on ", t.device());
  COLOSSAL_CHECK(t.numel() == param.numel(), "cpu_adam_update: ", what, " has ", t.numel(),
                 " elements, param ", param.numel());
}

// The least work worth a thread of its own (~2 MB of traffic).
constexpr int64_t kMinPerThread = 1 << 16;

// Persistent workers (started on first use, as many as ever asked for), so a step does not pay
// thread starts. run(n, fn) calls fn(0..n-1), fn(0) on the caller, and returns when all are done;
// one run at a time. A forked child gets a fresh pool (threads do not survive fork).
class WorkerPool {
 public:
  static WorkerPool& get() {
    static std::mutex mu;
    static WorkerPool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lk(mu);
    if (!pool || owner != ::getpid()) {
      pool = new WorkerPool;  // never freed: workers block until the process ends
      owner = ::getpid();
    }
    return *pool;
  }

  void run(int n, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> run_lk(run_mu_);
    std::unique_lock<std::mutex> lk(mu_);
    while (static_cast<int>(threads_.size()) < n - 1)
      threads_.emplace_back([this, g = generation_] { work(g); });  // joins this run
    fn_ = &fn;
    tasks_ = n;
    next_ = 1;
    pending_ = n - 1;
    ++generation_;
    lk.unlock();
    work_cv_.notify_all();
    fn(0);
    lk.lock();
    while (next_ < tasks_) {  // help with tasks no worker has claimed yet
      int i = next_++;
      lk.unlock();
      fn(i);
      lk.lock();
      --pending_;
    }
    done_cv_.wait(lk, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work(uint64_t seen) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      while (next_ < tasks_) {
        int i = next_++;
        lk.unlock();
        (*fn_)(i);
        lk.lock();
        if (--pending_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0, next_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
};

// Runs f(begin, end) over [0, n) split into cpu_adam_num_threads(n) contiguous chunks (multiples
// of 64 elements). Not at::parallel_for: that is an inline template which runs in parallel only
// in files compiled with -fopenmp (it tests _OPENMP), and project code is not, so there it
// silently runs on one thread.
template <class F>
void run_parallel(int64_t n, const F& f) {
  const int64_t threads = cpu_adam_num_threads(n);
  if (threads <= 1) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
  const int64_t chunk = ((n + threads - 1) / threads + 63) / 64 * 64;
  const int tasks = static_cast<int>((n + chunk - 1) / chunk);
  WorkerPool::get().run(tasks, [&](int t) {
    const int64_t b = t * chunk;
    f(b, std::min(n, b + chunk));
  });
}

}  // namespace

const char* cpu_adam_path_name(CpuAdamPath path) {
  switch (path) {
    case CpuAdamPath::Auto:
      return "auto";
    case CpuAdamPath::Scalar:
      return "scalar";
    case CpuAdamPath::AVX2:
      return "avx2";
    case CpuAdamPath::AVX512:
      return "avx512";
  }
  return "?";
}

bool cpu_adam_path_available(CpuAdamPath path) {
  return cpu_has(path);
}

int64_t cpu_adam_num_threads(int64_t numel) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), numel / kMinPerThread));
}

CpuAdamPath cpu_adam_default_path() {
  static const CpuAdamPath path = detect_default();
  return path;
}

namespace {

using Kernel = void (*)(const detail::AdamKernelArgs&, int64_t, int64_t);

Kernel resolve_kernel(CpuAdamPath path) {
  if (path == CpuAdamPath::Auto) path = cpu_adam_default_path();
  COLOSSAL_CHECK(cpu_has(path), "cpu_adam_update: path ", cpu_adam_path_name(path),
                 " is not available on this CPU");
  return path == CpuAdamPath::AVX512 ? detail::adam_kernel_avx512
         : path == CpuAdamPath::AVX2 ? detail::adam_kernel_avx2
                                     : detail::adam_kernel_scalar;
}

// Checks one tensor set and fills the kernel arguments for it.
detail::AdamKernelArgs make_args(const at::Tensor& param, const at::Tensor& grad,
                                 const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                 int64_t step, const AdamWHyper& h, double grad_divisor,
                                 const at::Tensor& param_out) {
  check_fp32(param, param, "param");
  check_fp32(exp_avg, param, "exp_avg");
  check_fp32(exp_avg_sq, param, "exp_avg_sq");
  COLOSSAL_CHECK(grad.defined(), "cpu_adam_update: grad is undefined");
  check_half_or_fp32(grad, param, "grad");
  COLOSSAL_CHECK(step >= 1, "cpu_adam_update: step must be >= 1 (counted after increment), got ",
                 step);
  COLOSSAL_CHECK(grad_divisor > 0 && std::isfinite(grad_divisor),
                 "cpu_adam_update: grad_divisor must be finite and > 0, got ", grad_divisor);
  detail::AdamKernelArgs a{};
  a.param = param.data_ptr<float>();
  a.exp_avg = exp_avg.data_ptr<float>();
  a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  a.grad = grad.data_ptr();
  a.grad_dtype = dtype_of(grad, "grad");
  a.out = nullptr;
  a.out_dtype = AdamDtype::None;
  if (param_out.defined()) {
    check_half_or_fp32(param_out, param, "param_out");
    a.out = param_out.data_ptr();
    a.out_dtype = dtype_of(param_out, "param_out");
  }
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  a.grad_scale = static_cast<float>(1.0 / grad_divisor);
  a.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  a.beta1 = static_cast<float>(h.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  a.step_size = static_cast<float>(h.lr / bc1);
  a.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  a.eps = static_cast<float>(h.eps);
  return a;
}

}  // namespace

void cpu_adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, int64_t step, const AdamWHyper& h,
                     double grad_divisor, const at::Tensor& param_out, CpuAdamPath path) {
  const auto a = make_args(param, grad, exp_avg, exp_avg_sq, step, h, grad_divisor, param_out);
  const Kernel kernel = resolve_kernel(path);
  run_parallel(param.numel(), [&](int64_t begin, int64_t end) { kernel(a, begin, end); });
}

void cpu_adam_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& exp_avg_sqs, int64_t step,
                     const AdamWHyper& hyper, double grad_divisor,
                     const std::vector<at::Tensor>& params_out, CpuAdamPath path) {
  COLOSSAL_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                     exp_avg_sqs.size() == params.size() &&
                     (params_out.empty() || params_out.size() == params.size()),
                 "cpu_adam_update: list lengths differ (params ", params.size(), ", grads ",
                 grads.size(), ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size(),
                 ", params_out ", params_out.size(), ")");
  if (params.empty()) return;
  const Kernel kernel = resolve_kernel(path);
  // One parallel loop over all tensors' elements laid end to end, so many small tensors (the
  // shards of a ZeRO rank) are split over the threads too.
  std::vector<detail::AdamKernelArgs> args;
  std::vector<int64_t> offsets{0};  // offsets[i]: first element of tensor i in the joint range
  args.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    args.push_back(make_args(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], step, hyper,
                             grad_divisor, params_out.empty() ? at::Tensor() : params_out[i]));
    offsets.push_back(offsets.back() + params[i].numel());
  }
  run_parallel(offsets.back(), [&](int64_t begin, int64_t end) {
    size_t i = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) -
                                   offsets.begin()) -
               1;
    for (; i < args.size() && offsets[i] < end; ++i) {
      int64_t lo = std::max(begin, offsets[i]) - offsets[i];
      int64_t hi = std::min(end, offsets[i + 1]) - offsets[i];
      if (lo < hi) kernel(args[i], lo, hi);
    }
  });
}

void CPUAdam::update(const GroupOptions& g, std::vector<at::Tensor>& params,
                     std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) {
  const AdamWHyper& h = g;
  // One call per step count (parameters that skipped steps have their own); tensors the kernel
  // does not serve (not CPU fp32 contiguous) go through adamw_update.
  std::map<int64_t, std::vector<size_t>> by_step;
  for (size_t i = 0; i < params.size(); ++i) by_step[states[i]->step].push_back(i);
  for (auto& [step, idx] : by_step) {
    std::vector<at::Tensor> P, G, M, V, CP, CG, CM, CV;
    for (size_t i : idx) {
      const at::Tensor& m = states[i]->tensors.at("exp_avg");
      const at::Tensor& v = states[i]->tensors.at("exp_avg_sq");
      auto fits = [&](const at::Tensor& t) {
        return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
      };
      if (fits(params[i]) && fits(m) && fits(v) && grads[i].device().is_cpu() &&
          grads[i].is_contiguous()) {
        CP.push_back(params[i]);
        CG.push_back(grads[i]);
        CM.push_back(m);
        CV.push_back(v);
      } else {
        P.push_back(params[i]);
        G.push_back(grads[i]);
        M.push_back(m);
        V.push_back(v);
      }
    }
    if (!CP.empty()) cpu_adam_update(CP, CG, CM, CV, step, h, grad_divisor(), {}, path_);
    if (!P.empty()) adamw_update(P, G, M, V, step, h, AdamWImpl::Auto, grad_divisor());
  }
}

}  // namespace colossal::optim
