// CUDA kernels of the FP8 casts with current scaling (kernels/fp8.h): the amax (of the tensor
// or of each row), the scales from it on the device, then one pass that writes the fp8 data and,
// when asked, its transpose through a shared-memory tile. The scale and the products are the
// reference's fp32 operations (__fdiv_rn, __frcp_rn, __fmul_rn), and the conversion rounds to
// nearest even and saturates like ATen's, so the output equals the reference bit for bit.
#include <cuda_fp8.h>

#include <vector>

#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

constexpr int kBlock = 256;
constexpr int kTile = 32;

// Tensorwise amax: a grid-stride max of |x|, one atomicMax per block on the fp32 bits (|x| >= 0,
// so the bit patterns order as the values). NaN propagates as the largest pattern.
template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ amax) {
  __shared__ float red[32];
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(to_f(x[i])));
  m = block_max<kBlock>(m, red);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(m));
}

// The same over 16-byte packs (n a multiple of the pack, x 16-byte aligned).
template <typename T>
__global__ void amax_vec_kernel(const T* __restrict__ x, int64_t packs, float* __restrict__ amax) {
  constexpr int V = vec_of<T>();
  __shared__ float red[32];
  float m = 0.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  constexpr int kInFlight = 4;  // packs loaded before any is reduced
  for (; i + (kInFlight - 1) * stride < packs; i += kInFlight * stride) {
    float v[kInFlight][V];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) load<T, V>(x + (i + u * stride) * V, v[u]);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
#pragma unroll
      for (int k = 0; k < V; ++k) m = fmaxf(m, fabsf(v[u][k]));
  }
  for (; i < packs; i += stride) {
    float v[V];
    load<T, V>(x + i * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) m = fmaxf(m, fabsf(v[k]));
  }
  m = block_max<kBlock>(m, red);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(m));
}

// Rowwise amax: one block per row (grid-stride over rows).
template <typename T>
__global__ void amax_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                 float* __restrict__ amax) {
  __shared__ float red[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * cols;
    float m = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(to_f(row[c])));
    m = block_max<kBlock>(m, red);
    if (threadIdx.x == 0) amax[r] = m;
  }
}

// scale = fp8_max / max(amax, 1e-12): the reference's fp32 division, for every cast kernel.
__device__ __forceinline__ float scale_from_amax(float a, float fp8_max) {
  return isnan(a) ? a : __fdiv_rn(fp8_max, fmaxf(a, 1e-12f));  // NaN propagates, as clamp_min's
}

// scale and inv_scale = 1 / scale, per entry.
__global__ void scales_kernel(const float* __restrict__ amax, int64_t count, float fp8_max,
                              float* __restrict__ scale, float* __restrict__ inv_scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float s = scale_from_amax(amax[i], fp8_max);
    scale[i] = s;
    inv_scale[i] = __frcp_rn(s);
  }
}

template <bool E5M2>
__device__ __forceinline__ uint8_t to_fp8(float v, float fp8_max) {
  if (!isnan(v)) v = fminf(fmaxf(v, -fp8_max), fp8_max);
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3));
}

// One kTile x kTile tile per block (blockDim kTile x 8): out = fp8(x * scale) row-major, and
// out_t its transpose, both written with consecutive threads on consecutive bytes.
template <typename T, bool E5M2>
__global__ void cast_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, bool rowwise,
                            const float* __restrict__ scale, float fp8_max,
                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t ld_t) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = blockIdx.y * int64_t(kTile), c0 = blockIdx.x * int64_t(kTile);
  for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
    const int64_t r = r0 + dy, c = c0 + threadIdx.x;
    if (r < rows && c < cols) {
      const float s = rowwise ? scale[r] : scale[0];
      const uint8_t q = to_fp8<E5M2>(__fmul_rn(to_f(x[r * cols + c]), s), fp8_max);
      out[r * cols + c] = q;
      tile[dy][threadIdx.x] = q;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  for (int dx = threadIdx.y; dx < kTile; dx += blockDim.y) {
    const int64_t c = c0 + dx, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out_t[c * ld_t + r] = tile[threadIdx.x][dx];
  }
}

// The wide cast: a kWide x kWide tile per block of kBlock threads, each thread converting 8
// consecutive elements of a row (one 16-byte load of bf16/fp16, two of fp32) into one 8-byte
// store; the transpose goes through shared memory and leaves as 8-byte stores of 8 consecutive
// rows of one column. cols a multiple of 8 (and rows too with a transpose), x 16-byte and the
// outputs 8-byte aligned. The scale comes straight from the amax (the scales kernel's operation,
// so the same bits); the blocks of the first tile column write the inverse scales.
constexpr int kWide = 64;
template <typename T, bool E5M2, bool TRANS>
__global__ void __launch_bounds__(kBlock)
    cast_wide_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, bool rowwise,
                     const float* __restrict__ amax, float fp8_max, uint8_t* __restrict__ out,
                     uint8_t* __restrict__ out_t, int64_t ld_t, float* __restrict__ inv_scale) {
  constexpr int kPad = 68;  // bytes per shared row: 4-byte aligned, column reads spread over banks
  __shared__ uint8_t tile[TRANS ? kWide : 1][kPad];
  const int64_t r0 = blockIdx.y * int64_t(kWide), c0 = blockIdx.x * int64_t(kWide);
  const float ts = rowwise ? 0.f : scale_from_amax(amax[0], fp8_max);
  const int tc = (threadIdx.x % 8) * 8;
  constexpr int kPasses = kWide / (kBlock / 8);  // rows per thread, all loaded before any store
  float v[kPasses][8];
  bool in[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int lr = threadIdx.x / 8 + p * (kBlock / 8);
    const int64_t r = r0 + lr, c = c0 + tc;
    in[p] = r < rows && c < cols;
    if (!in[p]) continue;
    if constexpr (sizeof(T) == 4) {
      load<T, 4>(x + r * cols + c, reinterpret_cast<float(&)[4]>(v[p][0]));
      load<T, 4>(x + r * cols + c + 4, reinterpret_cast<float(&)[4]>(v[p][4]));
    } else {
      load<T, 8>(x + r * cols + c, v[p]);
    }
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    if (!in[p]) continue;
    const int lr = threadIdx.x / 8 + p * (kBlock / 8);
    const int64_t r = r0 + lr, c = c0 + tc;
    const float s = rowwise ? scale_from_amax(amax[r], fp8_max) : ts;
    if (rowwise && blockIdx.x == 0 && tc == 0) inv_scale[r] = __frcp_rn(s);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      lo |= uint32_t(to_fp8<E5M2>(__fmul_rn(v[p][k], s), fp8_max)) << (8 * k);
      hi |= uint32_t(to_fp8<E5M2>(__fmul_rn(v[p][k + 4], s), fp8_max)) << (8 * k);
    }
    *reinterpret_cast<uint2*>(out + r * cols + c) = make_uint2(lo, hi);
    if constexpr (TRANS) {
      *reinterpret_cast<uint32_t*>(&tile[lr][tc]) = lo;
      *reinterpret_cast<uint32_t*>(&tile[lr][tc + 4]) = hi;
    }
  }
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    inv_scale[0] = __frcp_rn(ts);
  if constexpr (TRANS) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kWide * kWide / 8; idx += kBlock) {
      const int lc = idx / 8, lr = (idx % 8) * 8;
      const int64_t c = c0 + lc, r = r0 + lr;
      if (c >= cols || r >= rows) continue;
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        lo |= uint32_t(tile[lr + k][lc]) << (8 * k);
        hi |= uint32_t(tile[lr + 4 + k][lc]) << (8 * k);
      }
      *reinterpret_cast<uint2*>(out_t + c * ld_t + r) = make_uint2(lo, hi);
    }
  }
}

}  // namespace

void fp8_cast(const void* x, int64_t rows, int64_t cols, bool rowwise, bool e5m2, float fp8_max,
              float* amax, float* scale, float* inv_scale, uint8_t* out, uint8_t* out_t, DType dt,
              Stream stream, bool amax_given) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  const int64_t count = rowwise ? rows : 1;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    constexpr int V = vec_of<T>();
    if (rowwise) {
      const int grid = int(std::min<int64_t>(rows, int64_t(sm_count()) * 16));
      amax_rows_kernel<T><<<grid, kBlock, 0, stream>>>(xt, rows, cols, amax);
    } else if (amax_given) {
      // The producer of x recorded its amax (kernels::known_fp8_amax).
    } else {
      check(cudaMemsetAsync(amax, 0, sizeof(float), stream), "fp8 amax reset");
      if (n % V == 0 && aligned(x, 16))
        amax_vec_kernel<T>
            <<<grid_for((n / V + 3) / 4, kBlock), kBlock, 0, stream>>>(xt, n / V, amax);
      else
        amax_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream>>>(xt, n, amax);
    }
    check_launch("fp8 amax");
    const bool wide = cols % 8 == 0 && (out_t == nullptr || rows % 8 == 0) && aligned(x, 16) &&
                      aligned(out, 8) && (out_t == nullptr || aligned(out_t, 8));
    if (wide) {
      const dim3 grid(unsigned((cols + kWide - 1) / kWide), unsigned((rows + kWide - 1) / kWide));
      auto go = [&](auto kernel) {
        kernel<<<grid, kBlock, 0, stream>>>(xt, rows, cols, rowwise, amax, fp8_max, out, out_t,
                                            rows, inv_scale);
      };
      if (out_t)
        e5m2 ? go(cast_wide_kernel<T, true, true>) : go(cast_wide_kernel<T, false, true>);
      else
        e5m2 ? go(cast_wide_kernel<T, true, false>) : go(cast_wide_kernel<T, false, false>);
      check_launch("fp8 cast");
      // `scale` is the caller's scratch: the wide path computes the scales in place.
      (void)scale;
      return;
    }
    scales_kernel<<<grid_for(count, kBlock), kBlock, 0, stream>>>(amax, count, fp8_max, scale,
                                                                  inv_scale);
    check_launch("fp8 scales");
    const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile));
    const dim3 block(kTile, 8);
    if (e5m2)
      cast_kernel<T, true>
          <<<grid, block, 0, stream>>>(xt, rows, cols, rowwise, scale, fp8_max, out, out_t, rows);
    else
      cast_kernel<T, false>
          <<<grid, block, 0, stream>>>(xt, rows, cols, rowwise, scale, fp8_max, out, out_t, rows);
    check_launch("fp8 cast");
  });
}

void fp8_cast_rows_concat(const std::vector<const void*>& xs, const std::vector<int64_t>& rows,
                          int64_t cols, bool e5m2, float fp8_max, float* amax, float* scale,
                          float* inv_scale, uint8_t* out, uint8_t* out_t, DType dt, Stream stream,
                          bool amax_given) {
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  if (total == 0 || cols == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = vec_of<T>();
    // One amax over every part (the atomicMax accumulates), then one scale for all.
    if (!amax_given) check(cudaMemsetAsync(amax, 0, sizeof(float), stream), "fp8 amax reset");
    for (size_t i = 0; i < xs.size() && !amax_given; ++i) {
      const T* xt = static_cast<const T*>(xs[i]);
      const int64_t n = rows[i] * cols;
      if (n == 0) continue;
      if (n % V == 0 && aligned(xt, 16))
        amax_vec_kernel<T><<<grid_for(n / V, kBlock), kBlock, 0, stream>>>(xt, n / V, amax);
      else
        amax_kernel<T><<<grid_for(n, kBlock), kBlock, 0, stream>>>(xt, n, amax);
    }
    check_launch("fp8 amax");
    scales_kernel<<<1, kBlock, 0, stream>>>(amax, 1, fp8_max, scale, inv_scale);
    check_launch("fp8 scales");
    // Each part into its rows of `out` and its columns of `out_t` (row stride: the total).
    int64_t off = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      const T* xt = static_cast<const T*>(xs[i]);
      const int64_t r = rows[i];
      uint8_t* o = out + off * cols;
      uint8_t* ot = out_t ? out_t + off : nullptr;
      off += r;
      if (r == 0) continue;
      const bool wide = cols % 8 == 0 &&
                        (ot == nullptr || (r % 8 == 0 && (off - r) % 8 == 0 && total % 8 == 0)) &&
                        aligned(xt, 16) && aligned(o, 8) && (ot == nullptr || aligned(ot, 8));
      if (wide) {
        const dim3 grid(unsigned((cols + kWide - 1) / kWide), unsigned((r + kWide - 1) / kWide));
        auto go = [&](auto kernel) {
          kernel<<<grid, kBlock, 0, stream>>>(xt, r, cols, false, amax, fp8_max, o, ot, total,
                                              inv_scale);
        };
        if (ot)
          e5m2 ? go(cast_wide_kernel<T, true, true>) : go(cast_wide_kernel<T, false, true>);
        else
          e5m2 ? go(cast_wide_kernel<T, true, false>) : go(cast_wide_kernel<T, false, false>);
      } else {
        const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((r + kTile - 1) / kTile));
        const dim3 block(kTile, 8);
        if (e5m2)
          cast_kernel<T, true>
              <<<grid, block, 0, stream>>>(xt, r, cols, false, scale, fp8_max, o, ot, total);
        else
          cast_kernel<T, false>
              <<<grid, block, 0, stream>>>(xt, r, cols, false, scale, fp8_max, o, ot, total);
      }
      check_launch("fp8 cast");
    }
  });
}

}  // namespace colossal::kernels::cuda
