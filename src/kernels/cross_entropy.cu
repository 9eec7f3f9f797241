// CUDA kernel of the in-place softmax cross-entropy gradient (kernels/cross_entropy.h) for
// sm_90: one block per row; launched through the wrapper declared in cuda_kernels.h.
#include <cstdio>

#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

constexpr int kXentBlock = 512;

// One block per row of x [rows, V]: the row's logsumexp in fp32 (one online max/sum pass),
// loss = lse - x[target], then x := (softmax(x) - onehot(target)) * scale rounded to T.
template <typename T, int VEC>
__global__ void __launch_bounds__(kXentBlock)
    xent_kernel(T* __restrict__ x_all, const int64_t* __restrict__ targets,
                float* __restrict__ row_loss, const float* __restrict__ scale, int64_t V,
                int64_t ignore_index) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  T* x = x_all + row * V;
  const int64_t tgt = targets[row];
  const bool valid = tgt != ignore_index;
  if (valid && (tgt < 0 || tgt >= V)) {
    if (threadIdx.x == 0)
      printf("colossal cross_entropy: target %lld of row %lld is outside [0, %lld)\n",
             static_cast<long long>(tgt), static_cast<long long>(row), static_cast<long long>(V));
    __trap();
  }
  float m = -INFINITY, s = 0.f;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < V; j += int64_t(kXentBlock) * VEC) {
    float v[VEC];
    load<T, VEC>(x + j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (v[k] > m) {
        s = s * expf(m - v[k]) + 1.f;
        m = v[k];
      } else {
        s += expf(v[k] - m);
      }
    }
  }
  const float M = block_max<kXentBlock>(m, red);
  const float S = block_sum<kXentBlock>(m == -INFINITY ? 0.f : s * expf(m - M), red);
  const float lse = M + logf(S);
  if (threadIdx.x == 0) row_loss[row] = valid ? lse - to_f(x[tgt]) : 0.f;
  __syncthreads();  // x[tgt] is read before any thread overwrites it
  const float sc = valid ? (scale ? *scale : 1.f) : 0.f;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < V; j += int64_t(kXentBlock) * VEC) {
    float v[VEC];
    load<T, VEC>(x + j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float p = expf(v[k] - lse);
      if (j + k == tgt) p -= 1.f;
      v[k] = p * sc;
    }
    store<T, VEC>(x + j, v);
  }
}

// One block per row: the row's max and sum of exp(x - max) (one online pass), fp32.
template <typename T, int VEC>
__global__ void __launch_bounds__(kXentBlock)
    row_stats_kernel(const T* __restrict__ x_all, float* __restrict__ stats, int64_t V) {
  __shared__ float red[32];
  const T* x = x_all + blockIdx.x * V;
  float m = -INFINITY, s = 0.f;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < V; j += int64_t(kXentBlock) * VEC) {
    float v[VEC];
    load<T, VEC>(x + j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (v[k] > m) {
        s = s * expf(m - v[k]) + 1.f;
        m = v[k];
      } else {
        s += expf(v[k] - m);
      }
    }
  }
  const float M = block_max<kXentBlock>(m, red);
  const float S = block_sum<kXentBlock>(m == -INFINITY ? 0.f : s * expf(m - M), red);
  if (threadIdx.x == 0) {
    stats[2 * blockIdx.x] = M;
    stats[2 * blockIdx.x + 1] = S;
  }
}

// One block per row: x := (exp(x - lse) - onehot(target)) * row_scale, rounded to T.
template <typename T, int VEC>
__global__ void __launch_bounds__(kXentBlock)
    grad_given_lse_kernel(T* __restrict__ x_all, const int64_t* __restrict__ targets,
                          const float* __restrict__ lse_all, const float* __restrict__ row_scale,
                          int64_t V) {
  const int64_t row = blockIdx.x;
  T* x = x_all + row * V;
  const int64_t tgt = targets[row];
  const float lse = lse_all[row], sc = row_scale[row];
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < V; j += int64_t(kXentBlock) * VEC) {
    float v[VEC];
    load<T, VEC>(x + j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float p = expf(v[k] - lse);
      if (j + k == tgt) p -= 1.f;
      v[k] = p * sc;
    }
    store<T, VEC>(x + j, v);
  }
}

}  // namespace

void softmax_row_stats(const void* logits, float* stats, int64_t rows, int64_t V, DType dt,
                       Stream stream) {
  if (rows == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VV = vec_of<T>();
    if (V % VV == 0 && aligned(logits, 16))
      row_stats_kernel<T, VV><<<static_cast<unsigned>(rows), kXentBlock, 0, stream>>>(
          static_cast<const T*>(logits), stats, V);
    else
      row_stats_kernel<T, 1><<<static_cast<unsigned>(rows), kXentBlock, 0, stream>>>(
          static_cast<const T*>(logits), stats, V);
  });
  check_launch("softmax_row_stats");
}

void softmax_grad_given_lse(void* logits, const int64_t* targets, const float* lse,
                            const float* row_scale, int64_t rows, int64_t V, DType dt,
                            Stream stream) {
  if (rows == 0 || V == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VV = vec_of<T>();
    if (V % VV == 0 && aligned(logits, 16))
      grad_given_lse_kernel<T, VV><<<static_cast<unsigned>(rows), kXentBlock, 0, stream>>>(
          static_cast<T*>(logits), targets, lse, row_scale, V);
    else
      grad_given_lse_kernel<T, 1><<<static_cast<unsigned>(rows), kXentBlock, 0, stream>>>(
          static_cast<T*>(logits), targets, lse, row_scale, V);
  });
  check_launch("softmax_grad_given_lse");
}

void cross_entropy_grad(void* logits, const int64_t* targets, float* row_loss, const float* scale,
                        int64_t rows, int64_t V, int64_t ignore_index, DType dt, Stream stream) {
  if (rows == 0 || V == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VV = vec_of<T>();
    const bool al = V % VV == 0 && aligned(logits, 16);
    if (al)
      xent_kernel<T, VV><<<static_cast<unsigned>(rows), kXentBlock, 0, stream>>>(
          static_cast<T*>(logits), targets, row_loss, scale, V, ignore_index);
    else
      xent_kernel<T, 1><<<static_cast<unsigned>(rows), kXentBlock, 0, stream>>>(
          static_cast<T*>(logits), targets, row_loss, scale, V, ignore_index);
  });
  check_launch("cross_entropy_grad");
}

}  // namespace colossal::kernels::cuda
