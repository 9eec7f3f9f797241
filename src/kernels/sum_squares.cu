// CUDA kernel of the sum of squares over a tensor list (kernels/sum_squares.h) for sm_90:
// multi-tensor launches, fp32 partials per block; launched through the wrappers declared in
// cuda_kernels.h.
#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

// ---- Sum of squares over a tensor list ----
constexpr int kSqBlock = 512;
constexpr int64_t kSqChunk = 65536;  // elements per block

struct SqBatch {
  const void* p[kSqMaxTensors];
  int64_t n[kSqMaxTensors];
  int64_t block_start[kSqMaxTensors + 1];
  int count;
};

// Block b squares and sums its chunk in fp32 (vector loads where aligned) and writes one
// partial; the partials are summed in fp64 by the caller. inf/nan propagate into the sum.
template <typename T>
__global__ void __launch_bounds__(kSqBlock) sq_sum_kernel(SqBatch batch, float* partials) {
  __shared__ float red[32];
  const int lo = tensor_of_block(batch.block_start, batch.count);
  const T* x = static_cast<const T*>(batch.p[lo]);
  const int64_t begin = (int64_t(blockIdx.x) - batch.block_start[lo]) * kSqChunk;
  const int64_t end = batch.n[lo] < begin + kSqChunk ? batch.n[lo] : begin + kSqChunk;
  constexpr int V = 16 / sizeof(T);
  float acc = 0.f;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    for (int64_t i = begin + int64_t(threadIdx.x) * V; i < end; i += int64_t(kSqBlock) * V) {
      if (i + V <= end) {
        float v[V];
        load<T, V>(x + i, v);
#pragma unroll
        for (int k = 0; k < V; ++k) acc = fmaf(v[k], v[k], acc);
      } else {
        for (int64_t k = i; k < end; ++k) {
          const float v = to_f(x[k]);
          acc = fmaf(v, v, acc);
        }
      }
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kSqBlock) {
      const float v = to_f(x[k]);
      acc = fmaf(v, v, acc);
    }
  }
  const float total = block_sum<kSqBlock>(acc, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

}  // namespace

int64_t sum_squares_blocks(const int64_t* numels, int count) {
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) blocks += (numels[i] + kSqChunk - 1) / kSqChunk;
  return blocks;
}

void sum_squares(const void* const* tensors, const int64_t* numels, int count, DType dt,
                 float* partials, Stream stream) {
  for (int first = 0; first < count; first += kSqMaxTensors) {
    SqBatch batch{};
    batch.count = std::min(kSqMaxTensors, count - first);
    int64_t blocks = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.p[i] = tensors[first + i];
      batch.n[i] = numels[first + i];
      batch.block_start[i] = blocks;
      blocks += (batch.n[i] + kSqChunk - 1) / kSqChunk;
    }
    batch.block_start[batch.count] = blocks;
    if (blocks == 0) continue;
    if (blocks > int64_t(0x7fffffff))
      throw std::runtime_error("colossal kernels: sum_squares too large");
    dispatch(dt, [&](auto tag) {
      using T = decltype(tag);
      sq_sum_kernel<T><<<unsigned(blocks), kSqBlock, 0, stream>>>(batch, partials);
    });
    check_launch("sum_squares");
    partials += blocks;
  }
}

}  // namespace colossal::kernels::cuda
