// CPU Adam, AVX-512 kernel (F + BW + VL, F16C): 16 lanes, masked tails. Compiled for those ISAs
// by a target pragma below the includes only, so nothing shared with baseline code (inline
// functions of headers) is built with AVX-512 instructions; run only when the CPU has them.
//
// bf16 stores round to nearest even with integer arithmetic rather than VCVTNEPS2BF16, which
// treats denormal inputs as zero and would differ from at::Tensor::to(kBFloat16) there.

#include <cstdint>

#include "cpu_adam_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
// GCC 12 flags the deliberately undefined registers inside its own intrinsics (_mm*_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#define COLOSSAL_TARGET_AVX512
#elif defined(__clang__)
#define COLOSSAL_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif

namespace colossal::optim::detail {
namespace {

COLOSSAL_TARGET_AVX512 inline __m512 load_grad(const AdamKernelArgs& a, int64_t i, __mmask16 k) {
  switch (a.grad_dtype) {
    case AdamDtype::BF16: {
      __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(a.grad) + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case AdamDtype::F16: {
      __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(a.grad) + i);
      return _mm512_cvtph_ps(h);
    }
    default:
      return _mm512_maskz_loadu_ps(k, static_cast<const float*>(a.grad) + i);
  }
}

COLOSSAL_TARGET_AVX512 inline void store_out(const AdamKernelArgs& a, int64_t i, __mmask16 k,
                                             __m512 p) {
  switch (a.out_dtype) {
    case AdamDtype::BF16: {
      __m512i u = _mm512_castps_si512(p);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
      __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
      r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
      _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(a.out) + i, k, r);
      break;
    }
    case AdamDtype::F16: {
      __m256i h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + i, k, h);
      break;
    }
    case AdamDtype::F32:
      _mm512_mask_storeu_ps(static_cast<float*>(a.out) + i, k, p);
      break;
    default:
      break;
  }
}

}  // namespace

COLOSSAL_TARGET_AVX512 void adam_kernel_avx512(const AdamKernelArgs& a, int64_t begin,
                                               int64_t end) {
  const __m512 grad_scale = _mm512_set1_ps(a.grad_scale), decay = _mm512_set1_ps(a.decay);
  const __m512 b1 = _mm512_set1_ps(a.beta1), omb1 = _mm512_set1_ps(a.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(a.beta2), omb2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 step_size = _mm512_set1_ps(a.step_size), inv_bc2 = _mm512_set1_ps(a.inv_bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(a.eps);
  for (int64_t i = begin; i < end; i += 16) {
    int64_t left = end - i;
    __mmask16 k =
        left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    __m512 g = _mm512_mul_ps(load_grad(a, i, k), grad_scale);
    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, a.param + i), decay);
    __m512 m = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_maskz_loadu_ps(k, a.exp_avg + i)),
                             _mm512_mul_ps(omb1, g));
    __m512 v = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_maskz_loadu_ps(k, a.exp_avg_sq + i)),
                             _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
    __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), inv_bc2), eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
    _mm512_mask_storeu_ps(a.param + i, k, p);
    _mm512_mask_storeu_ps(a.exp_avg + i, k, m);
    _mm512_mask_storeu_ps(a.exp_avg_sq + i, k, v);
    store_out(a, i, k, p);
  }
}

}  // namespace colossal::optim::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#else  // not x86: never selected (cpu_adam_path_available is false), defined for the linker

namespace colossal::optim::detail {
void adam_kernel_avx512(const AdamKernelArgs& a, int64_t begin, int64_t end) {
  adam_kernel_scalar(a, begin, end);
}
}  // namespace colossal::optim::detail

#endif
