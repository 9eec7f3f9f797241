// Multi-tensor AdamW (kernels/adamw.h): argument checks, the ATen reference, the CPU loop (the
// arithmetic of ATen's CPU fused AdamW for fp32 state) and the CUDA dispatch (kernel in
// adamw.cu, one launch per dtype group of up to cuda::kAdamWMaxTensors tensors).
#include "colossal/kernels/adamw.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/fp8.h"
#include "kernels/cpu_common.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("fused_adamw");
#endif

// ---- CPU loops ----
namespace cpu {
namespace {

// The arithmetic of ATen's CPU fused AdamW for fp32 state.
template <typename G, typename W>
void adamw_impl(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                const at::Tensor& work, const AdamWStep& hy) {
  constexpr bool kWork = !std::is_same_v<W, void>;
  const int64_t n = p.numel();
  float* pp = p.mutable_data_ptr<float>();
  float* mp = m.mutable_data_ptr<float>();
  float* vp = v.mutable_data_ptr<float>();
  const G* gp = g.const_data_ptr<G>();
  W* wp = nullptr;
  if constexpr (kWork) wp = static_cast<W*>(work.data_ptr());
  const double step = static_cast<double>(static_cast<float>(hy.step));
  const double bc1 = 1 - std::pow(hy.beta1, step), bc2 = 1 - std::pow(hy.beta2, step);
  const float neg_step = static_cast<float>(-(hy.lr / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float keep = static_cast<float>(1 - hy.lr * hy.weight_decay);
  const float c1 = static_cast<float>(1 - hy.beta1), b2 = static_cast<float>(hy.beta2),
              c2 = static_cast<float>(1 - hy.beta2), eps = static_cast<float>(hy.eps),
              div = static_cast<float>(hy.grad_divisor);
  const bool divide = hy.grad_divisor != 1.0, decay = hy.weight_decay != 0.0;
  const bool small = std::abs(c1) < 0.5f;  // exp_avg.lerp_(grad, 1 - beta1), as ATen splits it
  parallel(n, threads_for(n, 1 << 18), [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float gr = static_cast<float>(gp[i]);
      if (divide) gr = gr / div;
      float pv = pp[i];
      if (decay) pv = pv * keep;
      const float mv = small ? std::fma(c1, gr - mp[i], mp[i]) : std::fma(c1 - 1.f, gr - mp[i], gr);
      const float vv = std::fma(c2 * gr, gr, vp[i] * b2);  // contracted, as ATen's loop
      const float denom = std::sqrt(vv) / bc2_sqrt + eps;
      pv = pv + neg_step * mv / denom;
      pp[i] = pv;
      mp[i] = mv;
      vp[i] = vv;
      if constexpr (kWork) wp[i] = static_cast<W>(pv);
    }
  });
}

// One tensor's AdamW step (arguments validated by the caller).
void adamw(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
           const at::Tensor& work, const AdamWStep& hyper) {
  dispatch(g.scalar_type(), "fused_adamw grad", [&](auto gtag) {
    using G = decltype(gtag);
    if (!work.defined()) {
      adamw_impl<G, void>(p, g, m, v, work, hyper);
    } else {
      dispatch(work.scalar_type(), "fused_adamw working",
               [&](auto wtag) { adamw_impl<G, decltype(wtag)>(p, g, m, v, work, hyper); });
    }
  });
}

}  // namespace
}  // namespace cpu

namespace {

using namespace detail;

void check_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& working,
                 const AdamWStep& hy) {
  const size_t n = params.size();
  COLOSSAL_CHECK_INPUT(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                       "fused_adamw: list lengths differ: params ", n, ", grads ", grads.size(),
                       ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size());
  COLOSSAL_CHECK_INPUT(working.empty() || working.size() == n, "fused_adamw: working has ",
                       working.size(), " tensors; expected none or ", n);
  COLOSSAL_CHECK_INPUT(hy.step >= 1, "fused_adamw: step must be >= 1, got ", hy.step);
  COLOSSAL_CHECK_INPUT(hy.grad_divisor != 0.0 && std::isfinite(hy.grad_divisor),
                       "fused_adamw: grad_divisor must be finite and non-zero, got ",
                       hy.grad_divisor);
  if (n == 0) return;
  COLOSSAL_CHECK_INPUT(params[0].defined(), "fused_adamw: params[0] is undefined");
  const c10::Device dev = params[0].device();
  auto check_state = [&](const at::Tensor& t, const char* list, size_t i, const at::Tensor& p) {
    COLOSSAL_CHECK_INPUT(t.defined(), "fused_adamw: ", list, "[", i, "] is undefined");
    COLOSSAL_CHECK_INPUT(t.device() == dev, "fused_adamw: ", list, "[", i, "] is on ", t.device(),
                         " but params[0] is on ", dev);
    COLOSSAL_CHECK_INPUT(t.sizes() == p.sizes(), "fused_adamw: ", list, "[", i, "] has shape ",
                         t.sizes(), " but params[", i, "] has ", p.sizes());
  };
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    COLOSSAL_CHECK_INPUT(p.defined(), "fused_adamw: params[", i, "] is undefined");
    check_state(p, "params", i, p);
    COLOSSAL_CHECK_INPUT(p.scalar_type() == at::kFloat && p.is_contiguous(), "fused_adamw: params[",
                         i,
                         "] must be contiguous float32 (master "
                         "weights), got ",
                         p.scalar_type());
    check_state(exp_avgs[i], "exp_avgs", i, p);
    check_state(exp_avg_sqs[i], "exp_avg_sqs", i, p);
    for (const at::Tensor* st : {&exp_avgs[i], &exp_avg_sqs[i]})
      COLOSSAL_CHECK_INPUT(st->scalar_type() == at::kFloat && st->is_contiguous(),
                           "fused_adamw: ", st == &exp_avgs[i] ? "exp_avgs[" : "exp_avg_sqs[", i,
                           "] must be contiguous float32, got ", st->scalar_type());
    check_state(grads[i], "grads", i, p);
    COLOSSAL_CHECK_INPUT(float_type(grads[i].scalar_type()), "fused_adamw: grads[", i,
                         "] has dtype ", grads[i].scalar_type(),
                         "; expected float, bfloat16 or half");
    if (!working.empty()) {
      check_state(working[i], "working", i, p);
      COLOSSAL_CHECK_INPUT(float_type(working[i].scalar_type()) && working[i].is_contiguous(),
                           "fused_adamw: working[", i,
                           "] must be contiguous bfloat16, half or float, got ",
                           working[i].scalar_type());
    }
  }
}

}  // namespace

void fused_adamw_reference(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& working, const AdamWStep& hy) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, working, hy);
  if (params.empty()) return;
  at::NoGradGuard ng;
  std::vector<at::Tensor> g;
  g.reserve(grads.size());
  for (const at::Tensor& t : grads) {
    at::Tensor f = t.to(at::kFloat);
    g.push_back(hy.grad_divisor != 1.0 ? f / hy.grad_divisor : f);
  }
  if (hy.weight_decay != 0) at::_foreach_mul_(params, 1 - hy.lr * hy.weight_decay);
  at::_foreach_lerp_(exp_avgs, g, 1 - hy.beta1);
  at::_foreach_mul_(exp_avg_sqs, hy.beta2);
  at::_foreach_addcmul_(exp_avg_sqs, g, g, 1 - hy.beta2);
  const double step = static_cast<double>(hy.step);
  const double bc1 = 1 - std::pow(hy.beta1, step), bc2 = 1 - std::pow(hy.beta2, step);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(exp_avg_sqs);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, hy.eps);
  at::_foreach_addcdiv_(params, exp_avgs, denom, -hy.lr / bc1);
  for (size_t i = 0; i < working.size(); ++i) working[i].copy_(params[i]);
}

void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& working,
                 const AdamWStep& hy) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, working, hy);
  if (params.empty()) return;
  const Path path = path_for(params[0]);
  if (path == Path::Reference) {
    fused_adamw_reference(params, grads, exp_avgs, exp_avg_sqs, working, hy);
    return;
  }
  at::NoGradGuard ng;
  const size_t n = params.size();
  // FP8 known amaxes: the working copies' amax, for the weight casts of the next forward.
  const bool record = fp8_amax_capture() && !working.empty();
  if (path == Path::Cpu) {
    for (size_t i = 0; i < n; ++i) {
      cpu::adamw(params[i], grads[i].contiguous(), exp_avgs[i], exp_avg_sqs[i],
                 working.empty() ? at::Tensor() : working[i], hy);
      if (record) record_computed_fp8_amax(working[i]);
    }
    return;
  }
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(params[0].device());
  const cuda::Stream stream = stream_of(params[0]);
  std::vector<at::Tensor> keep;  // contiguous copies of strided grads live until launched
  std::vector<cuda::AdamWTensor> run;
  cuda::DType gdt = cuda::DType::F32, wdt = cuda::DType::F32;
  auto flush = [&] {
    if (!run.empty()) cuda::adamw(run.data(), static_cast<int>(run.size()), gdt, wdt, hy, stream);
    run.clear();
  };
  at::Tensor amax = record ? fp8_amax_slot(params[0], static_cast<int64_t>(n)) : at::Tensor();
  for (size_t i = 0; i < n; ++i) {
    at::Tensor g = grads[i].is_contiguous() ? grads[i] : keep.emplace_back(grads[i].contiguous());
    const cuda::DType g_dt = cuda_dtype(g.scalar_type());
    const cuda::DType w_dt =
        working.empty() ? cuda::DType::F32 : cuda_dtype(working[i].scalar_type());
    if (!run.empty() && (g_dt != gdt || w_dt != wdt)) flush();  // one launch per dtype group
    gdt = g_dt;
    wdt = w_dt;
    if (params[i].numel() == 0) continue;
    run.push_back({params[i].mutable_data_ptr<float>(), exp_avgs[i].mutable_data_ptr<float>(),
                   exp_avg_sqs[i].mutable_data_ptr<float>(), g.const_data_ptr(),
                   working.empty() ? nullptr : working[i].mutable_data_ptr(), params[i].numel(),
                   record ? amax.mutable_data_ptr<float>() + i : nullptr});
  }
  flush();
  if (record)
    for (size_t i = 0; i < n; ++i)
      if (params[i].numel() > 0)
        record_fp8_amax(working[i], amax.narrow(0, static_cast<int64_t>(i), 1));
#endif
}

}  // namespace colossal::kernels
