// Internal to src/kernels/: the device helpers every <op>.cu shares (dtype conversion, vector
// loads and stores, block reductions, dtype dispatch, multi-tensor block lookup) and the error
// checks of the launch wrappers. Plain CUDA runtime, no ATen (see cuda_kernels.h).
//
// Rounding: products and sums that the ATen composite rounds to the working dtype are rounded
// in the kernels at the same points (__fmul_rn/__fadd_rn keep nvcc from contracting them into
// FMAs), so the elementwise ops reproduce the composite; reductions accumulate in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda_kernels.h"

namespace colossal::kernels::cuda::detail {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("colossal kernels: ") + what + ": " +
                             cudaGetErrorString(e));
}
inline void check_launch(const char* what) {
  check(cudaGetLastError(), what);
}

// Multiprocessors of the current device (queried once per device; one cache for every .cu
// file, as an inline function's statics are shared).
inline int sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 0 && dev < 64) {
    if (const int n = cache[dev].load(std::memory_order_relaxed)) return n;
  }
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "SM count");
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// ---- dtype helpers ----
template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  __device__ static float to(float x) { return x; }
  __device__ static float from(float x) { return x; }
};
template <>
struct Cvt<__nv_bfloat16> {
  __device__ static float to(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Cvt<__half> {
  __device__ static float to(__half x) { return __half2float(x); }
  __device__ static __half from(float x) { return __float2half_rn(x); }
};
template <typename T>
__device__ float to_f(T x) {
  return Cvt<T>::to(x);
}
template <typename T>
__device__ T from_f(float x) {
  return Cvt<T>::from(x);
}
// x rounded to T and back (the value a T-typed ATen op would have produced).
template <typename T>
__device__ float rnd(float x) {
  return Cvt<T>::to(Cvt<T>::from(x));
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};
template <typename T, int N>
__device__ void load(const T* p, float (&out)[N]) {
  Pack<T, N> k = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(k.v[i]);
}
template <typename T, int N>
__device__ void store(T* p, const float (&in)[N]) {
  Pack<T, N> k;
#pragma unroll
  for (int i = 0; i < N; ++i) k.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = k;
}

inline bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Sums of N values over the block at once (one pair of barriers for all of them); every thread
// gets the totals. `red` is 32 * N floats of shared memory.
template <int BLOCK, int N>
__device__ void block_sums(float (&v)[N], float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], o);
  __syncthreads();  // red may still be read by a previous call
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int j = 0; j < N; ++j) red[32 * j + threadIdx.x / 32] = v[j];
  __syncthreads();
  const bool in = threadIdx.x % 32 < BLOCK / 32;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = in ? red[32 * j + threadIdx.x % 32] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], o);
}

template <int BLOCK>
__device__ float block_sum(float v, float* red) {
  float a[1] = {v};
  block_sums<BLOCK, 1>(a, red);
  return a[0];
}

template <typename F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32:
      f(float{});
      break;
    case DType::BF16:
      f(__nv_bfloat16{});
      break;
    case DType::F16:
      f(__half{});
      break;
  }
}

// Elements of T in one 16-byte pack.
template <typename T>
constexpr int vec_of() {
  return 16 / int(sizeof(T));
}

// A grid-stride launch's grid for `total` items of `block` threads: enough blocks to cover
// them, at most 16 per multiprocessor.
inline int grid_for(int64_t total, int block) {
  const int64_t want = (total + block - 1) / block;
  return int(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(sm_count()) * 16)));
}

// The block's maximum of v (every thread gets it); `red` is 32 floats of shared memory.
template <int BLOCK>
__device__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = threadIdx.x % 32 < BLOCK / 32 ? red[threadIdx.x % 32] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}

// Multi-tensor launches: block_start[i] is the first block of tensor i (ascending, count
// entries); returns the tensor whose block range holds blockIdx.x.
__device__ __forceinline__ int tensor_of_block(const int64_t* block_start, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (block_start[mid] <= int64_t(blockIdx.x))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace colossal::kernels::cuda::detail
