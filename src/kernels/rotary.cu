// CUDA kernel of the rotary position embedding (kernels/rotary.h) for sm_90, forward and its
// transpose for backward; launched through the wrapper declared in cuda_kernels.h.
#include "kernels/cuda_common.cuh"

namespace colossal::kernels::cuda {

namespace {
using namespace detail;

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

}  // namespace

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

}  // namespace colossal::kernels::cuda
