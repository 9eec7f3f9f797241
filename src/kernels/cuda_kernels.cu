// CUDA kernels of kernels/fused.h for sm_90, written against the plain CUDA runtime (raw
// pointers, no ATen headers), launched through the wrappers of cuda_kernels.h.
//
// Rounding: products and sums that the ATen composite rounds to the working dtype are rounded
// here at the same points (__fmul_rn/__fadd_rn keep nvcc from contracting them into FMAs), so
// the elementwise ops reproduce the composite; reductions accumulate in fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda_kernels.h"

namespace colossal::kernels::cuda {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("colossal kernels: ") + what + ": " +
                             cudaGetErrorString(e));
}
void check_launch(const char* what) {
  check(cudaGetLastError(), what);
}

// Multiprocessors of the current device (queried once per device).
int sm_count() {
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

bool aligned(const void* p, int bytes) {
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

// ---- RMSNorm ----
// One row per block (forward) or a grid-stride over rows (backward); a thread holds CHUNKS
// packs of VEC elements of the row in registers, so x is read from memory once.
constexpr int kRmsBlock = 256;

template <typename T, int VEC, int CHUNKS>
__global__ void __launch_bounds__(kRmsBlock)
    rms_fwd_kernel(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                   T* __restrict__ y, T* __restrict__ hout, float* __restrict__ rstd, int h,
                   float eps) {
  // res != nullptr: the row normalised is hout = x + res, rounded to T (ATen's add), written out.
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  T* yr = y + row * h;
  float xv[CHUNKS][VEC];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * kRmsBlock + threadIdx.x) * VEC;
    if (col < h) {
      load<T, VEC>(xr + col, xv[c]);
      if (res) {
        float rv[VEC];
        load<T, VEC>(res + row * h + col, rv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) xv[c][i] = rnd<T>(__fadd_rn(xv[c][i], rv[i]));
        store<T, VEC>(hout + row * h + col, xv[c]);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) ss += __fmul_rn(xv[c][i], xv[c][i]);  // pow(2) in fp32
    }
  }
  const float var = __fdiv_rn(block_sum<kRmsBlock>(ss, red), float(h));
  const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(var, eps)));
  if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * kRmsBlock + threadIdx.x) * VEC;
    if (col < h) {
      float wv[VEC], out[VEC];
      load<T, VEC>(w + col, wv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = __fmul_rn(wv[i], rnd<T>(__fmul_rn(xv[c][i], r)));
      store<T, VEC>(yr + col, out);
    }
  }
}

// Rows a backward block handles per iteration: two for rows held in one or two packs per thread
// (both rows' loads are issued before either's reduction: twice the bytes in flight of a one-row
// loop, which waited on memory latency at 34-55 % of the copy rate, and one pair of barriers
// serves both); longer rows keep one (their registers would spill).
template <int CHUNKS>
constexpr int rms_bwd_rows() {
  return CHUNKS <= 2 ? 2 : 1;
}

// Blocks stride over groups of R rows. The second row of an odd tail re-reads the first and is
// neither stored nor counted in dweight.
template <typename T, int VEC, int CHUNKS>
__global__ void __launch_bounds__(kRmsBlock)
    rms_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                   const float* __restrict__ rstd, const T* __restrict__ dres, T* __restrict__ dx,
                   float* __restrict__ dwp, int64_t rows, int h) {
  // dres != nullptr: dx = rounded(norm's dx) + dres, rounded (autograd's sum of the two
  // gradients of the residual stream, in T).
  __shared__ float red[64];
  float wv[CHUNKS][VEC], acc[CHUNKS][VEC];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * kRmsBlock + threadIdx.x) * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[c][i] = 0.f;
    if (col < h) load<T, VEC>(w + col, wv[c]);
  }
  constexpr int R = rms_bwd_rows<CHUNKS>();
  const float inv_h = 1.f / float(h);
  for (int64_t row0 = R * int64_t(blockIdx.x); row0 < rows; row0 += R * int64_t(gridDim.x)) {
    const bool two = R == 2 && row0 + 1 < rows;
    int64_t rw[R];
    rw[0] = row0;
    if constexpr (R == 2) rw[R - 1] = two ? row0 + 1 : row0;
    float n[R][CHUNKS][VEC], g[R][CHUNKS][VEC];
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const int col = (c * kRmsBlock + threadIdx.x) * VEC;
        if (col < h) {
          load<T, VEC>(x + rw[j] * h + col, n[j][c]);
          load<T, VEC>(dy + rw[j] * h + col, g[j][c]);
        }
      }
    float r[R], dot[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      r[j] = rstd[rw[j]];
      dot[j] = 0.f;
    }
    const float count2 = two ? 1.f : 0.f;
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const int col = (c * kRmsBlock + threadIdx.x) * VEC;
        if (col < h) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            n[j][c][i] *= r[j];
            const float gi = g[j][c][i];
            g[j][c][i] = gi * wv[c][i];  // now dn
            dot[j] += g[j][c][i] * n[j][c][i];
            // the forward multiplied w by the rounded n
            const float term = gi * rnd<T>(n[j][c][i]);
            acc[c][i] += j == 0 ? term : term * count2;
          }
        }
      }
    block_sums<kRmsBlock, R>(dot, red);  // both rows' sums behind one pair of barriers
    float mean[R];
#pragma unroll
    for (int j = 0; j < R; ++j) mean[j] = dot[j] * inv_h;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (j == 1 && !two) break;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const int col = (c * kRmsBlock + threadIdx.x) * VEC;
        if (col < h) {
          float out[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) out[i] = r[j] * (g[j][c][i] - n[j][c][i] * mean[j]);
          if (dres) {  // loaded here, not with x and dy: its registers would halve occupancy
            float dr[VEC];
            load<T, VEC>(dres + rw[j] * h + col, dr);
#pragma unroll
            for (int i = 0; i < VEC; ++i) out[i] = __fadd_rn(rnd<T>(out[i]), dr[i]);
          }
          store<T, VEC>(dx + rw[j] * h + col, out);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * kRmsBlock + threadIdx.x) * VEC;
    if (col < h) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) dwp[int64_t(blockIdx.x) * h + col + i] = acc[c][i];
    }
  }
}

// Second stage of dweight: one thread per column sums the blocks' partial rows.
template <typename T>
__global__ void rms_dw_kernel(const float* __restrict__ dwp, T* __restrict__ dw, int blocks,
                              int h) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= h) return;
  double s = 0.0;  // a few hundred partial rows: double costs nothing here
  for (int b = 0; b < blocks; ++b) s += dwp[int64_t(b) * h + col];
  dw[col] = from_f<T>(float(s));
}

template <typename T>
constexpr int vec_of() {
  return 16 / int(sizeof(T));
}

// Picks VEC (16-byte packs when h and the pointers allow, else 1) and CHUNKS for a row of h.
struct RmsPlan {
  int vec = 0, chunks = 0;
};
template <typename T>
RmsPlan rms_plan(int64_t h, bool ptrs_aligned) {
  RmsPlan p;
  p.vec = (ptrs_aligned && h % vec_of<T>() == 0) ? vec_of<T>() : 1;
  const int64_t per = kRmsBlock * int64_t(p.vec);
  const int64_t need = (h + per - 1) / per;
  for (int c : {1, 2, 4, 8})
    if (need <= c) {
      p.chunks = c;
      break;
    }
  return p;
}

template <typename T, typename F>
void with_rms_kernel(const RmsPlan& p, F&& f) {
  constexpr int V = vec_of<T>();
  auto pick = [&](auto vec_tag) {
    constexpr int VV = decltype(vec_tag)::value;
    switch (p.chunks) {
      case 1:
        f(std::integral_constant<int, VV>{}, std::integral_constant<int, 1>{});
        break;
      case 2:
        f(std::integral_constant<int, VV>{}, std::integral_constant<int, 2>{});
        break;
      case 4:
        f(std::integral_constant<int, VV>{}, std::integral_constant<int, 4>{});
        break;
      default:
        f(std::integral_constant<int, VV>{}, std::integral_constant<int, 8>{});
        break;
    }
  };
  if (p.vec == V)
    pick(std::integral_constant<int, V>{});
  else
    pick(std::integral_constant<int, 1>{});
}

// ---- Rotary ----
// Blocks stride over tokens (b, s); a block's threads cover (head, 16-byte pack of the first
// half) of its token and write both halves. Only one 64-bit division per token.
template <typename T, int VEC>
__global__ void rotary_kernel(const T* __restrict__ x, const T* __restrict__ cs,
                              const T* __restrict__ sn, T* __restrict__ y, RotaryShape sh,
                              bool backward) {
  const int half = int(sh.d / 2), per = half / VEC, items = int(sh.heads) * per;
  const int64_t tokens = sh.b * sh.s;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / sh.s, s = t - b * sh.s;
    const int64_t co = b * sh.cb + s * sh.cs;
    for (int k = threadIdx.x; k < items; k += blockDim.x) {
      const int head = k / per, j = (k - head * per) * VEC;
      const T* xr = x + b * sh.sb + head * sh.sh + s * sh.ss;
      T* yr = y + (t * sh.heads + head) * sh.d;  // [B, S, heads, D] contiguous
      float x1[VEC], x2[VEC], c1[VEC], c2[VEC], s1[VEC], s2[VEC], y1[VEC], y2[VEC];
      load<T, VEC>(xr + j, x1);
      load<T, VEC>(xr + j + half, x2);
      load<T, VEC>(cs + co + j, c1);
      load<T, VEC>(cs + co + j + half, c2);
      load<T, VEC>(sn + co + j, s1);
      load<T, VEC>(sn + co + j + half, s2);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (!backward) {
          // x * cos + rotate_half(x) * sin, rounded where ATen rounds (each product, the sum)
          y1[i] = __fadd_rn(rnd<T>(__fmul_rn(x1[i], c1[i])), rnd<T>(__fmul_rn(-x2[i], s1[i])));
          y2[i] = __fadd_rn(rnd<T>(__fmul_rn(x2[i], c2[i])), rnd<T>(__fmul_rn(x1[i], s2[i])));
        } else {
          // dx = dy * cos + rotate_half^T(dy * sin), with the composite's autograd roundings
          y1[i] = __fadd_rn(rnd<T>(__fmul_rn(x1[i], c1[i])), rnd<T>(__fmul_rn(x2[i], s2[i])));
          y2[i] = __fadd_rn(rnd<T>(__fmul_rn(x2[i], c2[i])), -rnd<T>(__fmul_rn(x1[i], s1[i])));
        }
      }
      store<T, VEC>(yr + j, y1);
      store<T, VEC>(yr + j + half, y2);
    }
  }
}

int grid_for(int64_t total, int block) {
  const int64_t want = (total + block - 1) / block;
  return int(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(sm_count()) * 16)));
}

// ---- Softmax cross-entropy gradient (in place) ----
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

// ---- SwiGLU ----
// Element i of the [rows, cols] output reads gate/up at i + (i / cols) * skip: skip = 0 for
// separate contiguous gate and up tensors, skip = cols for one packed [rows, 2*cols] tensor
// (gate = its first half, up = gate + cols). Gradients are written at the same offsets.
template <typename T, int VEC, bool PACKED>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u,
                                  T* __restrict__ y, int64_t n, int64_t cols) {
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
    }
    store<T, VEC>(y + i, out);
  }
}

template <typename T, int VEC, bool PACKED>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ g,
                                  const T* __restrict__ u, T* __restrict__ dg, T* __restrict__ du,
                                  int64_t n, int64_t cols) {
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
    }
    store<T, VEC>(dg + gi, og);
    store<T, VEC>(du + gi, ou);
  }
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
        }
      } else {
        for (int64_t k = i; k < end; ++k) {
          float p = t.p[k], m = t.m[k], v = t.v[k];
          adam_elem(p, m, v, to_f(g[k]), s, bias);
          t.p[k] = p;
          t.m[k] = m;
          t.v[k] = v;
          if constexpr (kWork) static_cast<W*>(t.w)[k] = from_f<W>(p);
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
      if constexpr (kWork) static_cast<W*>(t.w)[k] = from_f<W>(p);
    }
  }
}

}  // namespace

// ---- wrappers ----
bool rms_norm_supported(int64_t h, DType dt) {
  if (h <= 0 || h > (int64_t(1) << 30)) return false;
  bool ok = false;
  dispatch(dt, [&](auto tag) { ok = rms_plan<decltype(tag)>(h, true).chunks > 0; });
  return ok;
}

void rms_norm_fwd(const void* x, const void* res, const void* w, void* y, void* hout, float* rstd,
                  int64_t rows, int64_t h, double eps, DType dt, Stream stream) {
  if (rows == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const bool al = aligned(x, 16) && aligned(w, 16) && aligned(y, 16) &&
                    (!res || (aligned(res, 16) && aligned(hout, 16)));
    const RmsPlan p = rms_plan<T>(h, al);
    if (p.chunks == 0) throw std::runtime_error("colossal kernels: rms_norm row too long");
    with_rms_kernel<T>(p, [&](auto vec, auto chunks) {
      rms_fwd_kernel<T, decltype(vec)::value, decltype(chunks)::value>
          <<<unsigned(rows), kRmsBlock, 0, stream>>>(
              static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
              static_cast<T*>(y), static_cast<T*>(hout), rstd, int(h), float(eps));
    });
  });
  check_launch("rms_norm forward");
}

int64_t rms_norm_bwd_blocks(int64_t rows, int64_t h, DType dt) {
  // As many blocks as can be resident at once (each loops over groups of rows), never more than
  // there are groups. (A launch that falls back to the scalar plan may group differently: a
  // block without rows writes a zero dweight row, so any count is correct.)
  int per_sm = 1;
  int64_t rows_per_iter = 1;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    with_rms_kernel<T>(rms_plan<T>(h, true), [&](auto vec, auto chunks) {
      rows_per_iter = rms_bwd_rows<decltype(chunks)::value>();
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &per_sm, rms_bwd_kernel<T, decltype(vec)::value, decltype(chunks)::value>,
                kRmsBlock, 0),
            "occupancy");
    });
  });
  return std::max<int64_t>(1, std::min<int64_t>((rows + rows_per_iter - 1) / rows_per_iter,
                                                int64_t(sm_count()) * std::max(1, per_sm)));
}

void rms_norm_bwd(const void* dy, const void* x, const void* w, const float* rstd, const void* dres,
                  void* dx, float* dw_partial, void* dw, int64_t rows, int64_t h, DType dt,
                  Stream stream) {
  const int blocks = int(rms_norm_bwd_blocks(rows, h, dt));
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const bool al = aligned(x, 16) && aligned(w, 16) && aligned(dy, 16) && aligned(dx, 16) &&
                    (!dres || aligned(dres, 16));
    const RmsPlan p = rms_plan<T>(h, al);
    if (p.chunks == 0) throw std::runtime_error("colossal kernels: rms_norm row too long");
    if (rows > 0) {
      with_rms_kernel<T>(p, [&](auto vec, auto chunks) {
        rms_bwd_kernel<T, decltype(vec)::value, decltype(chunks)::value>
            <<<blocks, kRmsBlock, 0, stream>>>(
                static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
                static_cast<const T*>(dres), static_cast<T*>(dx), dw_partial, rows, int(h));
      });
      check_launch("rms_norm backward");
      rms_dw_kernel<T><<<unsigned((h + 255) / 256), 256, 0, stream>>>(
          dw_partial, static_cast<T*>(dw), blocks, int(h));
    } else {
      check(cudaMemsetAsync(dw, 0, size_t(h) * sizeof(T), stream), "rms_norm dweight");
    }
  });
  check_launch("rms_norm dweight");
}

void rotary(const void* x, const void* cos, const void* sin, void* y, const RotaryShape& sh,
            bool backward, DType dt, Stream stream) {
  const int64_t half = sh.d / 2;
  if (sh.b * sh.heads * sh.s * half == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = vec_of<T>();
    const bool al = half % V == 0 && sh.sb % V == 0 && sh.sh % V == 0 && sh.ss % V == 0 &&
                    sh.cb % V == 0 && sh.cs % V == 0 && aligned(x, 16) && aligned(cos, 16) &&
                    aligned(sin, 16) && aligned(y, 16);
    const int vec = al ? V : 1;
    const int64_t items = sh.heads * (half / vec);
    const int block = int(std::min<int64_t>(256, (items + 31) / 32 * 32));
    const int64_t blocks_per_sm = 2048 / block;
    const int grid =
        int(std::max<int64_t>(1, std::min<int64_t>(sh.b * sh.s, sm_count() * blocks_per_sm * 4)));
    if (al)
      rotary_kernel<T, V><<<grid, block, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
          static_cast<T*>(y), sh, backward);
    else
      rotary_kernel<T, 1><<<grid, block, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
          static_cast<T*>(y), sh, backward);
  });
  check_launch("rotary");
}

namespace {
int64_t dtype_size(DType dt) {
  return dt == DType::F32 ? 4 : 2;
}

// cols: row length of y; packed: gate/up rows are 2*cols apart (one [rows, 2*cols] tensor).
void swiglu_fwd_launch(const void* gate, const void* up, void* y, int64_t n, int64_t cols,
                       bool packed, DType dt, Stream stream) {
  if (n == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = vec_of<T>();
    const bool al =
        n % V == 0 && cols % V == 0 && aligned(gate, 16) && aligned(up, 16) && aligned(y, 16);
    const int grid = grid_for(al ? n / V : n, 256);
    auto go = [&](auto kernel) {
      kernel<<<grid, 256, 0, stream>>>(static_cast<const T*>(gate), static_cast<const T*>(up),
                                       static_cast<T*>(y), n, cols);
    };
    if (packed)
      al ? go(swiglu_fwd_kernel<T, V, true>) : go(swiglu_fwd_kernel<T, 1, true>);
    else
      al ? go(swiglu_fwd_kernel<T, V, false>) : go(swiglu_fwd_kernel<T, 1, false>);
  });
  check_launch("swiglu forward");
}

void swiglu_bwd_launch(const void* dy, const void* gate, const void* up, void* dgate, void* dup,
                       int64_t n, int64_t cols, bool packed, DType dt, Stream stream) {
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
                                       static_cast<T*>(dup), n, cols);
    };
    if (packed)
      al ? go(swiglu_bwd_kernel<T, V, true>) : go(swiglu_bwd_kernel<T, 1, true>);
    else
      al ? go(swiglu_bwd_kernel<T, V, false>) : go(swiglu_bwd_kernel<T, 1, false>);
  });
  check_launch("swiglu backward");
}
}  // namespace

void swiglu_fwd(const void* gate, const void* up, void* y, int64_t n, DType dt, Stream stream) {
  swiglu_fwd_launch(gate, up, y, n, n, false, dt, stream);
}

void swiglu_bwd(const void* dy, const void* gate, const void* up, void* dgate, void* dup, int64_t n,
                DType dt, Stream stream) {
  swiglu_bwd_launch(dy, gate, up, dgate, dup, n, n, false, dt, stream);
}

void swiglu_packed_fwd(const void* gu, void* y, int64_t rows, int64_t cols, DType dt,
                       Stream stream) {
  const char* g = static_cast<const char*>(gu);
  swiglu_fwd_launch(g, g + cols * dtype_size(dt), y, rows * cols, cols, true, dt, stream);
}

void swiglu_packed_bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols,
                       DType dt, Stream stream) {
  const char* g = static_cast<const char*>(gu);
  char* dg = static_cast<char*>(dgu);
  const int64_t off = cols * dtype_size(dt);
  swiglu_bwd_launch(dy, g, g + off, dg, dg + off, rows * cols, cols, true, dt, stream);
}

void adamw(const AdamWTensor* tensors, int count, DType grad_dt, DType work_dt,
           const AdamWHyper& hy, Stream stream) {
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
