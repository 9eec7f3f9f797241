// CPU Adam, scalar kernel: the reference order of operations that the AVX kernels repeat lane by
// lane (no fused multiply-add anywhere, so every path gives the same bits).
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam_kernels.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace colossal::optim::detail {
namespace {

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even (NaN -> quiet NaN), as c10::BFloat16's conversion does.
uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

void adam_kernel_scalar(const AdamKernelArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float g;
    switch (a.grad_dtype) {
      case AdamDtype::BF16:
        g = bf16_to_float(static_cast<const uint16_t*>(a.grad)[i]);
        break;
      case AdamDtype::F16:
        g = static_cast<float>(static_cast<const c10::Half*>(a.grad)[i]);
        break;
      default:
        g = static_cast<const float*>(a.grad)[i];
    }
    g = g * a.grad_scale;
    float p = a.param[i] * a.decay;
    float m = a.beta1 * a.exp_avg[i] + a.one_minus_beta1 * g;
    float v = a.beta2 * a.exp_avg_sq[i] + a.one_minus_beta2 * (g * g);
    float denom = std::sqrt(v) * a.inv_bc2_sqrt + a.eps;
    p = p - (a.step_size * m) / denom;
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    switch (a.out_dtype) {
      case AdamDtype::BF16:
        static_cast<uint16_t*>(a.out)[i] = float_to_bf16(p);
        break;
      case AdamDtype::F16:
        static_cast<c10::Half*>(a.out)[i] = c10::Half(p);
        break;
      case AdamDtype::F32:
        static_cast<float*>(a.out)[i] = p;
        break;
      default:
        break;
    }
  }
}

}  // namespace colossal::optim::detail
