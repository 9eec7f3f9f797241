// CPU Adam, AVX2 kernel (AVX2, F16C): 8 lanes; the tail goes through the same vector code on
// zero-padded stack copies. Compiled for those ISAs by a target pragma below the includes only
// (nothing shared with baseline code is built with AVX2); run only when the CPU has them.

#include <cstdint>
#include <cstring>

#include "cpu_adam_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
// GCC 12 flags the deliberately undefined registers inside its own intrinsics (_mm*_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#define COLOSSAL_TARGET_AVX2
#elif defined(__clang__)
#define COLOSSAL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace colossal::optim::detail {
namespace {

COLOSSAL_TARGET_AVX2 inline __m256 load_grad(AdamDtype dt, const void* src) {
  switch (dt) {
    case AdamDtype::BF16: {
      __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(src));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case AdamDtype::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(src)));
    default:
      return _mm256_loadu_ps(static_cast<const float*>(src));
  }
}

COLOSSAL_TARGET_AVX2 inline void store_out(AdamDtype dt, void* dst, __m256 p) {
  switch (dt) {
    case AdamDtype::BF16: {
      __m256i u = _mm256_castps_si256(p);
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
      __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storeu_si128(static_cast<__m128i*>(dst), packed);
      break;
    }
    case AdamDtype::F16:
      _mm_storeu_si128(static_cast<__m128i*>(dst),
                       _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
    case AdamDtype::F32:
      _mm256_storeu_ps(static_cast<float*>(dst), p);
      break;
    default:
      break;
  }
}

size_t dtype_size(AdamDtype dt) {
  return dt == AdamDtype::F32 ? 4 : 2;
}

struct Consts {
  __m256 grad_scale, decay, b1, omb1, b2, omb2, step_size, inv_bc2, eps;
};

// 8 elements at the given addresses.
COLOSSAL_TARGET_AVX2 inline void step8(const Consts& c, const AdamKernelArgs& a, float* param,
                                       float* exp_avg, float* exp_avg_sq, const void* grad,
                                       void* out) {
  __m256 g = _mm256_mul_ps(load_grad(a.grad_dtype, grad), c.grad_scale);
  __m256 p = _mm256_mul_ps(_mm256_loadu_ps(param), c.decay);
  __m256 m = _mm256_add_ps(_mm256_mul_ps(c.b1, _mm256_loadu_ps(exp_avg)), _mm256_mul_ps(c.omb1, g));
  __m256 v = _mm256_add_ps(_mm256_mul_ps(c.b2, _mm256_loadu_ps(exp_avg_sq)),
                           _mm256_mul_ps(c.omb2, _mm256_mul_ps(g, g)));
  __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), c.inv_bc2), c.eps);
  p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(c.step_size, m), denom));
  _mm256_storeu_ps(param, p);
  _mm256_storeu_ps(exp_avg, m);
  _mm256_storeu_ps(exp_avg_sq, v);
  if (out) store_out(a.out_dtype, out, p);
}

}  // namespace

COLOSSAL_TARGET_AVX2 void adam_kernel_avx2(const AdamKernelArgs& a, int64_t begin, int64_t end) {
  Consts c{_mm256_set1_ps(a.grad_scale), _mm256_set1_ps(a.decay),
           _mm256_set1_ps(a.beta1),      _mm256_set1_ps(a.one_minus_beta1),
           _mm256_set1_ps(a.beta2),      _mm256_set1_ps(a.one_minus_beta2),
           _mm256_set1_ps(a.step_size),  _mm256_set1_ps(a.inv_bc2_sqrt),
           _mm256_set1_ps(a.eps)};
  const size_t gsz = dtype_size(a.grad_dtype);
  const size_t osz = a.out ? dtype_size(a.out_dtype) : 0;
  auto* grad = static_cast<const char*>(a.grad);
  auto* out = static_cast<char*>(a.out);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8)
    step8(c, a, a.param + i, a.exp_avg + i, a.exp_avg_sq + i, grad + i * gsz,
          out ? out + i * osz : nullptr);
  if (i < end) {
    const size_t n = static_cast<size_t>(end - i);
    alignas(32) float p[8] = {}, m[8] = {}, v[8] = {};
    alignas(32) char g[32] = {}, o[32] = {};
    std::memcpy(p, a.param + i, n * 4);
    std::memcpy(m, a.exp_avg + i, n * 4);
    std::memcpy(v, a.exp_avg_sq + i, n * 4);
    std::memcpy(g, grad + i * gsz, n * gsz);
    step8(c, a, p, m, v, g, out ? o : nullptr);
    std::memcpy(a.param + i, p, n * 4);
    std::memcpy(a.exp_avg + i, m, n * 4);
    std::memcpy(a.exp_avg_sq + i, v, n * 4);
    if (out) std::memcpy(out + i * osz, o, n * osz);
  }
}

}  // namespace colossal::optim::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#else  // not x86: never selected (cpu_adam_path_available is false), defined for the linker

namespace colossal::optim::detail {
void adam_kernel_avx2(const AdamKernelArgs& a, int64_t begin, int64_t end) {
  adam_kernel_scalar(a, begin, end);
}
}  // namespace colossal::optim::detail

#endif
