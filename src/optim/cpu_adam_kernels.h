// Internal: the per-ISA CPU Adam kernels (cpu_adam_scalar/avx2/avx512.cpp) and their arguments.
// Kept free of inline code: the AVX files compile their bodies with wider target options, and
// an inline function instantiated there could be picked by the linker for baseline callers.
#pragma once

#include <cstdint>

namespace colossal::optim::detail {

enum class AdamDtype : int { None = 0, F32 = 1, BF16 = 2, F16 = 3 };

struct AdamKernelArgs {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  AdamDtype grad_dtype;
  void* out;  // nullptr: none
  AdamDtype out_dtype;
  // Per-step constants (computed once in double, rounded to float):
  float grad_scale;  // 1 / grad_divisor
  float decay;       // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float eps;
};

// Each updates elements [begin, end) of the arrays in `a`.
void adam_kernel_scalar(const AdamKernelArgs& a, int64_t begin, int64_t end);
void adam_kernel_avx2(const AdamKernelArgs& a, int64_t begin, int64_t end);
void adam_kernel_avx512(const AdamKernelArgs& a, int64_t begin, int64_t end);

}  // namespace colossal::optim::detail
