// CUDA kernels of RMSNorm and residual add + RMSNorm (kernels/rms_norm.h) for sm_90: a row held
// in registers (one read of x), fp32 statistics, dweight in two stages; launched through the
// wrappers declared in cuda_kernels.h.
#include <type_traits>

#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

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

}  // namespace

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

}  // namespace colossal::kernels::cuda
