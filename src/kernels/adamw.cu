// CUDA kernel of the multi-tensor AdamW (kernels/adamw.h) for sm_90, in the arithmetic of
// ATen's CUDA fused AdamW; launched through the wrapper declared in cuda_kernels.h.
#include <type_traits>

#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

// ---- AdamW ----
constexpr int kAdamBlock = 512;
constexpr int64_t kAdamChunk = 65536;  // elements per block

struct AdamWBatch {
  AdamWTensor t[kAdamWMaxTensors];
  int64_t block_start[kAdamWMaxTensors + 1];
  int count;
};
struct AdamWScalars {
  float lr, beta1, beta2, eps, wd, divisor, step;
  bool divide;
};
struct AdamWBias {
  float step_size, bc2_sqrt;
};

// Bias corrections as ATen's CUDA fused AdamW computes them: fp32 scalars, pow on the device.
__device__ __forceinline__ AdamWBias adam_bias(const AdamWScalars& s) {
  const float bc1 = 1.f - powf(s.beta1, s.step);
  const float bc2 = 1.f - powf(s.beta2, s.step);
  return {s.lr / bc1, sqrtf(bc2)};
}

// One element in the arithmetic of ATen's CUDA fused AdamW (torch 2.11
// ATen/native/cuda/fused_adam_utils.cuh): fp32 scalars, the moments by nested fma.
__device__ __forceinline__ void adam_elem(float& p, float& m, float& v, float g,
                                          const AdamWScalars& s, const AdamWBias& b) {
  if (s.divide) g /= s.divisor;
  if (s.wd != 0.f) p -= s.lr * s.wd * p;
  m = fmaf(s.beta1, m, fmaf(-s.beta1, g, g));
  const float g2 = g * g;
  v = fmaf(s.beta2, v, fmaf(-s.beta2, g2, g2));
  const float denom = (sqrtf(v) / b.bc2_sqrt) + s.eps;
  p -= b.step_size * m / denom;
}

template <typename G, typename W>
__global__ void __launch_bounds__(kAdamBlock) adamw_kernel(AdamWBatch batch, AdamWScalars s) {
  constexpr bool kWork = !std::is_same_v<W, void>;
  const int lo = tensor_of_block(batch.block_start, batch.count);
  const AdamWTensor& t = batch.t[lo];
  const AdamWBias bias = adam_bias(s);
  const int64_t begin = (int64_t(blockIdx.x) - batch.block_start[lo]) * kAdamChunk;
  const int64_t end = t.n < begin + kAdamChunk ? t.n : begin + kAdamChunk;
  const G* g = static_cast<const G*>(t.g);
  bool vec = (reinterpret_cast<uintptr_t>(t.p) | reinterpret_cast<uintptr_t>(t.m) |
              reinterpret_cast<uintptr_t>(t.v)) %
                     16 ==
                 0 &&
             reinterpret_cast<uintptr_t>(g) % (4 * sizeof(G)) == 0;
  if constexpr (kWork) vec = vec && reinterpret_cast<uintptr_t>(t.w) % (4 * sizeof(W)) == 0;
  float mx = 0.f;  // max |w| as stored (t.amax)
  if (vec) {
    for (int64_t i = begin + int64_t(threadIdx.x) * 4; i < end; i += int64_t(kAdamBlock) * 4) {
      if (i + 4 <= end) {
        float4 p = *reinterpret_cast<const float4*>(t.p + i);
        float4 m = *reinterpret_cast<const float4*>(t.m + i);
        float4 v = *reinterpret_cast<const float4*>(t.v + i);
        float gv[4];
        load<G, 4>(g + i, gv);
        adam_elem(p.x, m.x, v.x, gv[0], s, bias);
        adam_elem(p.y, m.y, v.y, gv[1], s, bias);
        adam_elem(p.z, m.z, v.z, gv[2], s, bias);
        adam_elem(p.w, m.w, v.w, gv[3], s, bias);
        *reinterpret_cast<float4*>(t.p + i) = p;
        *reinterpret_cast<float4*>(t.m + i) = m;
        *reinterpret_cast<float4*>(t.v + i) = v;
        if constexpr (kWork) {
          const float out[4] = {p.x, p.y, p.z, p.w};
          store<W, 4>(static_cast<W*>(t.w) + i, out);
#pragma unroll
          for (int k = 0; k < 4; ++k) mx = fmaxf(mx, fabsf(rnd<W>(out[k])));
        }
      } else {
        for (int64_t k = i; k < end; ++k) {
          float p = t.p[k], m = t.m[k], v = t.v[k];
          adam_elem(p, m, v, to_f(g[k]), s, bias);
          t.p[k] = p;
          t.m[k] = m;
          t.v[k] = v;
          if constexpr (kWork) {
            static_cast<W*>(t.w)[k] = from_f<W>(p);
            mx = fmaxf(mx, fabsf(rnd<W>(p)));
          }
        }
      }
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kAdamBlock) {
      float p = t.p[k], m = t.m[k], v = t.v[k];
      adam_elem(p, m, v, to_f(g[k]), s, bias);
      t.p[k] = p;
      t.m[k] = m;
      t.v[k] = v;
      if constexpr (kWork) {
        static_cast<W*>(t.w)[k] = from_f<W>(p);
        mx = fmaxf(mx, fabsf(rnd<W>(p)));
      }
    }
  }
  if constexpr (kWork) {
    if (t.amax) {  // uniform in the block: one tensor per block
      __shared__ float red[32];
      mx = block_max<kAdamBlock>(mx, red);
      if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(t.amax), __float_as_uint(mx));
    }
  }
}

}  // namespace

void adamw(const AdamWTensor* tensors, int count, DType grad_dt, DType work_dt, const AdamWStep& hy,
           Stream stream) {
  if (count <= 0) return;
  AdamWScalars s{};
  s.lr = float(hy.lr);
  s.beta1 = float(hy.beta1);
  s.beta2 = float(hy.beta2);
  s.eps = float(hy.eps);
  s.wd = float(hy.weight_decay);
  s.divisor = float(hy.grad_divisor);
  s.divide = hy.grad_divisor != 1.0;
  s.step = float(hy.step);  // ATen keeps the step count as an fp32 tensor
  const bool has_work = tensors[0].w != nullptr;
  for (int first = 0; first < count; first += kAdamWMaxTensors) {
    AdamWBatch batch{};
    batch.count = std::min(kAdamWMaxTensors, count - first);
    int64_t blocks = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.t[i] = tensors[first + i];
      batch.block_start[i] = blocks;
      blocks += (batch.t[i].n + kAdamChunk - 1) / kAdamChunk;
    }
    batch.block_start[batch.count] = blocks;
    if (blocks == 0) continue;
    if (blocks > int64_t(0x7fffffff)) throw std::runtime_error("colossal kernels: adamw too large");
    dispatch(grad_dt, [&](auto gtag) {
      using G = decltype(gtag);
      if (!has_work) {
        adamw_kernel<G, void><<<unsigned(blocks), kAdamBlock, 0, stream>>>(batch, s);
      } else {
        dispatch(work_dt, [&](auto wtag) {
          using W = decltype(wtag);
          adamw_kernel<G, W><<<unsigned(blocks), kAdamBlock, 0, stream>>>(batch, s);
        });
      }
    });
    check_launch("fused_adamw");
  }
}

}  // namespace colossal::kernels::cuda
