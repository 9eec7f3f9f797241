// CUDA kernels of the weight dequantisation (kernels/quant.h): NF4 blockwise (with or without
// double quantisation) and FP8 e4m3 rows, written straight in the compute dtype. Each output is
// the fp32 product of a level and its scale rounded once to the dtype, as the ATen reference
// computes it (__fmul_rn / __fadd_rn: no contraction), so the two agree bit for bit.
#include <cuda_fp8.h>

#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

struct Levels {
  float v[16];
};

// The scale of NF4 block b: fp32 constants, or dynamic-map codes times the second-level scale
// plus the offset (double quantisation), in the reference's order of operations.
__device__ __forceinline__ float nf4_scale(int64_t b, const float* absmax,
                                           const uint8_t* absmax_codes, const float* absmax2,
                                           const float* dmap, float offset, int64_t blocksize2) {
  if (absmax_codes == nullptr) return absmax[b];
  return __fadd_rn(__fmul_rn(dmap[absmax_codes[b]], absmax2[b / blocksize2]), offset);
}

// VEC: 8 values (4 code bytes, one block: blocksize % 8 == 0, n % 8 == 0) per thread per step,
// written with 16-byte stores; otherwise one byte (2 values) per step.
template <typename T, bool VEC>
__global__ void nf4_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                           const uint8_t* __restrict__ absmax_codes,
                           const float* __restrict__ absmax2, const float* __restrict__ dmap,
                           float offset, Levels lv, T* __restrict__ out, int64_t n,
                           int64_t blocksize, int64_t blocksize2) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < n / 8; g += stride) {
      const int64_t i = g * 8;
      const uint32_t word = reinterpret_cast<const uint32_t*>(codes)[g];
      const float s =
          nf4_scale(i / blocksize, absmax, absmax_codes, absmax2, dmap, offset, blocksize2);
      float vals[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t byte = (word >> (8 * k)) & 0xffu;  // little-endian: byte k = values 2k, 2k+1
        vals[2 * k] = __fmul_rn(lv.v[byte >> 4], s);
        vals[2 * k + 1] = __fmul_rn(lv.v[byte & 15u], s);
      }
      constexpr int V = vec_of<T>();
#pragma unroll
      for (int k = 0; k < 8; k += V) {
        float part[V];
#pragma unroll
        for (int j = 0; j < V; ++j) part[j] = vals[k + j];
        store<T, V>(out + i + k, part);
      }
    }
  } else {
    for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < (n + 1) / 2; p += stride) {
      const uint32_t byte = codes[p];
      const int64_t i = 2 * p;
      out[i] = from_f<T>(__fmul_rn(lv.v[byte >> 4], nf4_scale(i / blocksize, absmax, absmax_codes,
                                                              absmax2, dmap, offset, blocksize2)));
      if (i + 1 < n)
        out[i + 1] = from_f<T>(
            __fmul_rn(lv.v[byte & 15u], nf4_scale((i + 1) / blocksize, absmax, absmax_codes,
                                                  absmax2, dmap, offset, blocksize2)));
    }
  }
}

template <typename T>
__global__ void fp8_rows_kernel(const __nv_fp8_e4m3* __restrict__ codes,
                                const float* __restrict__ scale, T* __restrict__ out, int64_t n,
                                int64_t cols) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    out[i] = from_f<T>(__fmul_rn(static_cast<float>(codes[i]), scale[i / cols]));
}

}  // namespace

void nf4_dequantize(const uint8_t* codes, const float* absmax, const uint8_t* absmax_codes,
                    const float* absmax2, const float* dmap, float offset, const float* levels,
                    void* out, int64_t n, int64_t blocksize, int64_t blocksize2, DType dt,
                    Stream stream) {
  if (n == 0) return;
  Levels lv;
  for (int k = 0; k < 16; ++k) lv.v[k] = levels[k];
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = n % 8 == 0 && blocksize % 8 == 0 && aligned(codes, 4) && aligned(out, 16);
    const int grid = grid_for(vec ? n / 8 : (n + 1) / 2, 256);
    auto go = [&](auto kernel) {
      kernel<<<grid, 256, 0, stream>>>(codes, absmax, absmax_codes, absmax2, dmap, offset, lv,
                                       static_cast<T*>(out), n, blocksize, blocksize2);
    };
    vec ? go(nf4_kernel<T, true>) : go(nf4_kernel<T, false>);
  });
  check_launch("nf4 dequantize");
}

void fp8_rows_dequantize(const uint8_t* codes, const float* scale, void* out, int64_t rows,
                         int64_t cols, DType dt, Stream stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    fp8_rows_kernel<T><<<grid_for(n, 256), 256, 0, stream>>>(
        reinterpret_cast<const __nv_fp8_e4m3*>(codes), scale, static_cast<T*>(out), n, cols);
  });
  check_launch("fp8 rows dequantize");
}

}  // namespace colossal::kernels::cuda
