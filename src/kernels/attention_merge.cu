// CUDA kernel of the attention merge by log-sum-exp (kernels/attention_merge.h) for sm_90: one
// warp per query row, the row's two weights computed once, out read and written once and the
// partial output read once; launched through the wrapper declared in cuda_kernels.h.
#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

constexpr int kMergeBlock = 256;

// Rounded as the composite rounds (attention_merge_reference): each product in fp32, then the
// sum; the new log-sum-exp as ATen's logaddexp computes it.
template <typename T, int V>
__global__ void __launch_bounds__(kMergeBlock)
    merge_kernel(float* __restrict__ out, float* __restrict__ lse, const T* __restrict__ part,
                 const float* __restrict__ plse, MergeShape s) {
  constexpr int kWarps = kMergeBlock / 32;
  const int lane = int(threadIdx.x % 32);
  const int64_t rows = s.b * s.h * s.n, stride = int64_t(gridDim.x) * kWarps;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += stride) {
    const int64_t i = r % s.n, bh = r / s.n, h = bh % s.h, b = bh / s.h;
    float* lrow = lse + b * s.lse_s[0] + h * s.lse_s[1] + i * s.lse_s[2];
    const float l = *lrow, pl = plse[b * s.plse_s[0] + h * s.plse_s[1] + i * s.plse_s[2]];
    const float lnew = isinf(l) && l == pl ? l : fmaxf(l, pl) + log1pf(expf(-fabsf(l - pl)));
    if (lnew == -INFINITY) continue;  // nothing in either: the row stays as it is (warp-uniform)
    const float wa = expf(l - lnew), wb = expf(pl - lnew);
    float* orow = out + b * s.out_s[0] + h * s.out_s[1] + i * s.out_s[2];
    const T* prow = part + b * s.part_s[0] + h * s.part_s[1] + i * s.part_s[2];
    for (int64_t j = int64_t(lane) * V; j < s.d; j += 32 * V) {
      float o[V], p[V];
      load<float, V>(orow + j, o);
      load<T, V>(prow + j, p);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = __fadd_rn(__fmul_rn(o[k], wa), __fmul_rn(p[k], wb));
      store<float, V>(orow + j, o);
    }
    __syncwarp();  // every lane has read lse before lane 0 replaces it
    if (lane == 0) *lrow = lnew;
  }
}

}  // namespace

void attention_merge(float* out, float* lse, const void* part, const float* part_lse,
                     const MergeShape& s, DType dt, Stream stream) {
  const int64_t rows = s.b * s.h * s.n;
  if (rows == 0 || s.d == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 4;  // 16 bytes of out, 8 or 16 of the part
    bool vec = s.d % V == 0 && aligned(out, 16) && aligned(part, int(sizeof(T)) * V);
    for (int k = 0; k < 3; ++k) vec = vec && s.out_s[k] % V == 0 && s.part_s[k] % V == 0;
    constexpr int kWarps = kMergeBlock / 32;
    const int grid = int(std::max<int64_t>(
        1, std::min<int64_t>((rows + kWarps - 1) / kWarps, int64_t(sm_count()) * 16)));
    if (vec)
      merge_kernel<T, V>
          <<<grid, kMergeBlock, 0, stream>>>(out, lse, static_cast<const T*>(part), part_lse, s);
    else
      merge_kernel<T, 1>
          <<<grid, kMergeBlock, 0, stream>>>(out, lse, static_cast<const T*>(part), part_lse, s);
  });
  check_launch("attention_merge");
}

}  // namespace colossal::kernels::cuda
