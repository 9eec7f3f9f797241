// CUDA kernels of SwiGLU, separate and packed (kernels/swiglu.h), for sm_90; launched through
// the wrappers declared in cuda_kernels.h.
#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

// ---- SwiGLU ----
// Element i of the [rows, cols] output reads gate/up at i + (i / cols) * skip: skip = 0 for
// separate contiguous gate and up tensors, skip = cols for one packed [rows, 2*cols] tensor
// (gate = its first half, up = gate + cols). Gradients are written at the same offsets.
// The block's max of m into *amax (fp32 bits: |x| >= 0 orders as its bit pattern), as the FP8
// amax kernels do; every thread of the block calls it.
__device__ __forceinline__ void block_amax(float m, float* amax) {
  __shared__ float red[32];
  m = block_max<256>(m, red);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(m));
}

// amax (null: not computed): of |y| as stored (rounded to T).
template <typename T, int VEC, bool PACKED>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u,
                                  T* __restrict__ y, int64_t n, int64_t cols,
                                  float* __restrict__ amax) {
  float m = 0.f;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * VEC; i < n;
       i += int64_t(gridDim.x) * blockDim.x * VEC) {
    const int64_t gi = PACKED ? i + (i / cols) * cols : i;
    float gv[VEC], uv[VEC], out[VEC];
    load<T, VEC>(g + gi, gv);
    load<T, VEC>(u + gi, uv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float s = __fdiv_rn(gv[k], __fadd_rn(1.f, expf(-gv[k])));  // silu in fp32
      out[k] = __fmul_rn(rnd<T>(s), uv[k]);  // silu rounded to T, then the product
      m = fmaxf(m, fabsf(rnd<T>(out[k])));
    }
    store<T, VEC>(y + i, out);
  }
  if (amax) block_amax(m, amax);
}

// amax_g / amax_u (null: not computed; may be the same pointer): of |dg| / |du| as stored.
template <typename T, int VEC, bool PACKED>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ g,
                                  const T* __restrict__ u, T* __restrict__ dg, T* __restrict__ du,
                                  int64_t n, int64_t cols, float* __restrict__ amax_g,
                                  float* __restrict__ amax_u) {
  float mg = 0.f, mu = 0.f;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * VEC; i < n;
       i += int64_t(gridDim.x) * blockDim.x * VEC) {
    const int64_t gi = PACKED ? i + (i / cols) * cols : i;
    float d[VEC], gv[VEC], uv[VEC], og[VEC], ou[VEC];
    load<T, VEC>(dy + i, d);
    load<T, VEC>(g + gi, gv);
    load<T, VEC>(u + gi, uv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-gv[k])));
      const float silu = __fdiv_rn(gv[k], __fadd_rn(1.f, expf(-gv[k])));
      ou[k] = __fmul_rn(d[k], rnd<T>(silu));            // d(up) = dy * silu(gate)
      const float ds = rnd<T>(__fmul_rn(d[k], uv[k]));  // d(silu) = dy * up
      og[k] = ds * sig * (1.f + gv[k] * (1.f - sig));   // silu'(gate)
      mg = fmaxf(mg, fabsf(rnd<T>(og[k])));
      mu = fmaxf(mu, fabsf(rnd<T>(ou[k])));
    }
    store<T, VEC>(dg + gi, og);
    store<T, VEC>(du + gi, ou);
  }
  if (amax_g == amax_u) {
    if (amax_g) block_amax(fmaxf(mg, mu), amax_g);
  } else {
    if (amax_g) block_amax(mg, amax_g);
    __syncthreads();  // block_amax's shared scratch is reused
    if (amax_u) block_amax(mu, amax_u);
  }
}

int64_t dtype_size(DType dt) {
  return dt == DType::F32 ? 4 : 2;
}

// cols: row length of y; packed: gate/up rows are 2*cols apart (one [rows, 2*cols] tensor).
void swiglu_fwd_launch(const void* gate, const void* up, void* y, int64_t n, int64_t cols,
                       bool packed, DType dt, Stream stream, float* amax) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = vec_of<T>();
    const bool al =
        n % V == 0 && cols % V == 0 && aligned(gate, 16) && aligned(up, 16) && aligned(y, 16);
    const int grid = grid_for(al ? n / V : n, 256);
    auto go = [&](auto kernel) {
      kernel<<<grid, 256, 0, stream>>>(static_cast<const T*>(gate), static_cast<const T*>(up),
                                       static_cast<T*>(y), n, cols, amax);
    };
    if (packed)
      al ? go(swiglu_fwd_kernel<T, V, true>) : go(swiglu_fwd_kernel<T, 1, true>);
    else
      al ? go(swiglu_fwd_kernel<T, V, false>) : go(swiglu_fwd_kernel<T, 1, false>);
  });
  check_launch("swiglu forward");
}

void swiglu_bwd_launch(const void* dy, const void* gate, const void* up, void* dgate, void* dup,
                       int64_t n, int64_t cols, bool packed, DType dt, Stream stream, float* amax_g,
                       float* amax_u) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = vec_of<T>();
    const bool al = n % V == 0 && cols % V == 0 && aligned(dy, 16) && aligned(gate, 16) &&
                    aligned(up, 16) && aligned(dgate, 16) && aligned(dup, 16);
    const int grid = grid_for(al ? n / V : n, 256);
    auto go = [&](auto kernel) {
      kernel<<<grid, 256, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(gate),
                                       static_cast<const T*>(up), static_cast<T*>(dgate),
                                       static_cast<T*>(dup), n, cols, amax_g, amax_u);
    };
    if (packed)
      al ? go(swiglu_bwd_kernel<T, V, true>) : go(swiglu_bwd_kernel<T, 1, true>);
    else
      al ? go(swiglu_bwd_kernel<T, V, false>) : go(swiglu_bwd_kernel<T, 1, false>);
  });
  check_launch("swiglu backward");
}

}  // namespace

void swiglu_fwd(const void* gate, const void* up, void* y, int64_t n, DType dt, Stream stream,
                float* amax_y) {
  swiglu_fwd_launch(gate, up, y, n, n, false, dt, stream, amax_y);
}

void swiglu_bwd(const void* dy, const void* gate, const void* up, void* dgate, void* dup, int64_t n,
                DType dt, Stream stream, float* amax_dgate, float* amax_dup) {
  swiglu_bwd_launch(dy, gate, up, dgate, dup, n, n, false, dt, stream, amax_dgate, amax_dup);
}

void swiglu_packed_fwd(const void* gu, void* y, int64_t rows, int64_t cols, DType dt, Stream stream,
                       float* amax_y) {
  const char* g = static_cast<const char*>(gu);
  swiglu_fwd_launch(g, g + cols * dtype_size(dt), y, rows * cols, cols, true, dt, stream, amax_y);
}

void swiglu_packed_bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols,
                       DType dt, Stream stream, float* amax_dgu) {
  const char* g = static_cast<const char*>(gu);
  char* dg = static_cast<char*>(dgu);
  const int64_t off = cols * dtype_size(dt);
  swiglu_bwd_launch(dy, g, g + off, dg, dg + off, rows * cols, cols, true, dt, stream, amax_dgu,
                    amax_dgu);
}

}  // namespace colossal::kernels::cuda
