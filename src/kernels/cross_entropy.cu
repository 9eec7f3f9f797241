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

}  // namespace

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
