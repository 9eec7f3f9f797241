// Softmax cross-entropy gradient in place (kernels/cross_entropy.h): argument checks, the ATen
// reference, the CPU loop and the device dispatch (CUDA kernel in cross_entropy.cu).
#include "colossal/kernels/cross_entropy.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "colossal/core/accelerator.h"
#include "kernels/cpu_common.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("cross_entropy_grad");
COLOSSAL_REGISTER_CUDA_KERNEL("softmax_row_stats");
COLOSSAL_REGISTER_CUDA_KERNEL("softmax_grad_given_lse");
#endif

// ---- CPU loops ----
namespace cpu {
namespace {

void cross_entropy_grad(at::Tensor& logits, const at::Tensor& targets, at::Tensor& row_loss,
                        float scale, int64_t ignore_index) {
  const int64_t rows = logits.size(0), V = logits.size(1);
  dispatch(logits.scalar_type(), "cross_entropy_grad", [&](auto tag) {
    using T = decltype(tag);
    T* xp = logits.mutable_data_ptr<T>();
    const int64_t* tp = targets.const_data_ptr<int64_t>();
    float* lp = row_loss.mutable_data_ptr<float>();
    parallel(rows, threads_for(rows * V, kGrain), [&](int, int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* x = xp + r * V;
        const int64_t tgt = tp[r];
        const bool valid = tgt != ignore_index;
        float m = -INFINITY;
        for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<float>(x[j]));
        // fp64 sum of the exps: a serial fp32 sum over a 32000-wide row drifts by ~1e-4
        // relative (seen against the CUDA kernel's tree sum); in fp64 it is exact to fp32.
        double sum = 0.0;
        for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<float>(x[j]) - m);
        const float lse = m + static_cast<float>(std::log(sum));
        lp[r] = valid ? lse - static_cast<float>(x[tgt]) : 0.f;
        const float sc = valid ? scale : 0.f;
        for (int64_t j = 0; j < V; ++j) {
          float p = std::exp(static_cast<float>(x[j]) - lse);
          if (j == tgt) p -= 1.f;
          x[j] = static_cast<T>(p * sc);
        }
      }
    });
  });
}

}  // namespace
}  // namespace cpu

namespace {

using namespace detail;

void check_xent(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale) {
  check_dtype("cross_entropy_grad_", "logits", logits);
  COLOSSAL_CHECK_INPUT(logits.dim() == 2 && logits.is_contiguous(),
                       "cross_entropy_grad_: logits must be a contiguous [n, V] tensor, got ",
                       logits.sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
  COLOSSAL_CHECK_INPUT(targets.defined() && targets.scalar_type() == at::kLong &&
                           targets.dim() == 1 && targets.size(0) == logits.size(0),
                       "cross_entropy_grad_: targets must be int64 [", logits.size(0), "], got ",
                       targets.defined() ? targets.sizes() : at::IntArrayRef{});
  COLOSSAL_CHECK_INPUT(targets.device() == logits.device(), "cross_entropy_grad_: targets is on ",
                       targets.device(), " but logits is on ", logits.device());
  if (scale.defined())
    COLOSSAL_CHECK_INPUT(scale.numel() == 1 && scale.scalar_type() == at::kFloat &&
                             scale.device() == logits.device(),
                         "cross_entropy_grad_: scale must be one fp32 element on ", logits.device(),
                         ", got ", scale.scalar_type(), " ", scale.sizes(), " on ", scale.device());
}

}  // namespace

at::Tensor cross_entropy_grad_reference_(at::Tensor& logits, const at::Tensor& targets,
                                         int64_t ignore_index, const at::Tensor& scale) {
  at::Tensor valid = targets != ignore_index;
  at::Tensor tc = at::where(valid, targets, 0).unsqueeze(1);
  at::Tensor logp = at::log_softmax(logits.to(at::kFloat), 1);
  at::Tensor loss = -logp.gather(1, tc).squeeze(1) * valid;
  at::Tensor vf = valid.to(at::kFloat).unsqueeze(1);
  logp.exp_();
  logp.scatter_add_(1, tc, -vf);
  logp.mul_(scale.defined() ? vf * scale : vf);
  logits.copy_(logp);
  return loss;
}

at::Tensor cross_entropy_grad_(at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                               const at::Tensor& scale) {
  check_xent(logits, targets, scale);
  const Path path = path_for(logits);
  if (path == Path::Reference)
    return cross_entropy_grad_reference_(logits, targets, ignore_index, scale);
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  if (path == Path::Cpu) {
    const int64_t V = logits.size(1);
    at::Tensor bad = (targets != ignore_index) & ((targets < 0) | (targets >= V));
    COLOSSAL_CHECK_INPUT(!bad.any().item<bool>(), "cross_entropy_grad_: a target is outside [0, ",
                         V, ") (and not ignore_index ", ignore_index, ")");
    cpu::cross_entropy_grad(logits, targets, loss, scale.defined() ? scale.item<float>() : 1.f,
                            ignore_index);
    return loss;
  }
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(logits.device());
  cuda::cross_entropy_grad(
      logits.mutable_data_ptr(), targets.const_data_ptr<int64_t>(), loss.mutable_data_ptr<float>(),
      scale.defined() ? scale.const_data_ptr<float>() : nullptr, logits.size(0), logits.size(1),
      ignore_index, cuda_dtype(logits.scalar_type()), stream_of(logits));
#endif
  return loss;
}

at::Tensor softmax_row_stats_(const at::Tensor& logits) {
  check_dtype("softmax_row_stats_", "logits", logits);
  COLOSSAL_CHECK_INPUT(logits.dim() == 2 && logits.is_contiguous(),
                       "softmax_row_stats_: logits must be a contiguous [n, V] tensor, got ",
                       logits.sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
#ifdef COLOSSAL_WITH_CUDA
  const int64_t n = logits.size(0);
  if (path_for(logits) == Path::Cuda && logits.size(1) > 0) {
    const auto f32 = logits.options().dtype(at::kFloat);
    c10::DeviceGuard guard(logits.device());
    at::Tensor stats = at::empty({n, 2}, f32);
    cuda::softmax_row_stats(logits.const_data_ptr(), stats.mutable_data_ptr<float>(), n,
                            logits.size(1), cuda_dtype(logits.scalar_type()), stream_of(logits));
    return stats;
  }
#endif
  return softmax_row_stats_reference_(logits);
}

at::Tensor softmax_row_stats_reference_(const at::Tensor& logits) {
  const int64_t n = logits.size(0);
  const auto f32 = logits.options().dtype(at::kFloat);
  if (logits.size(1) == 0)
    return at::stack({at::full({n}, -INFINITY, f32), at::zeros({n}, f32)}, 1);
  at::Tensor x = logits.to(at::kFloat);
  at::Tensor m = std::get<0>(x.max(1, /*keepdim=*/true));
  return at::cat({m, (x - m).exp_().sum(1, /*keepdim=*/true)}, 1);
}

void softmax_grad_given_lse_(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                             const at::Tensor& row_scale) {
  check_dtype("softmax_grad_given_lse_", "logits", logits);
  COLOSSAL_CHECK_INPUT(logits.dim() == 2 && logits.is_contiguous(),
                       "softmax_grad_given_lse_: logits must be a contiguous [n, V] tensor, got ",
                       logits.sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
  const int64_t n = logits.size(0), V = logits.size(1);
  auto row_vector = [&](const at::Tensor& t, at::ScalarType st, const char* name) {
    COLOSSAL_CHECK_INPUT(t.defined() && t.scalar_type() == st && t.dim() == 1 && t.size(0) == n &&
                             t.is_contiguous() && t.device() == logits.device(),
                         "softmax_grad_given_lse_: ", name, " must be a contiguous ", st, " [", n,
                         "] on ", logits.device(), ", got ",
                         t.defined() ? t.sizes() : at::IntArrayRef{});
  };
  row_vector(targets, at::kLong, "targets");
  row_vector(lse, at::kFloat, "lse");
  row_vector(row_scale, at::kFloat, "row_scale");
  if (V == 0) return;
#ifdef COLOSSAL_WITH_CUDA
  if (path_for(logits) == Path::Cuda) {
    c10::DeviceGuard guard(logits.device());
    cuda::softmax_grad_given_lse(logits.mutable_data_ptr(), targets.const_data_ptr<int64_t>(),
                                 lse.const_data_ptr<float>(), row_scale.const_data_ptr<float>(), n,
                                 V, cuda_dtype(logits.scalar_type()), stream_of(logits));
    return;
  }
#endif
  softmax_grad_given_lse_reference_(logits, targets, lse, row_scale);
}

void softmax_grad_given_lse_reference_(at::Tensor& logits, const at::Tensor& targets,
                                       const at::Tensor& lse, const at::Tensor& row_scale) {
  const int64_t V = logits.size(1);
  if (V == 0) return;
  at::Tensor p = (logits.to(at::kFloat) - lse.unsqueeze(1)).exp_();
  at::Tensor owned = (targets >= 0) & (targets < V);
  p.scatter_add_(1, at::where(owned, targets, 0).unsqueeze(1), -owned.to(at::kFloat).unsqueeze(1));
  p.mul_(row_scale.unsqueeze(1));
  logits.copy_(p);
}

}  // namespace colossal::kernels
