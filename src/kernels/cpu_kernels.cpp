// CPU paths of the fused kernels: one pass per row (RMSNorm), per head row (rotary) or per
// element (SwiGLU, AdamW) with fp32 math, rounded to the working dtype where the ATen
// composite rounds, so the results match it (see fused.h). Large inputs are split over
// std::threads (LibTorch's own intra-op pool is not used from project code).
#include "kernels/cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "colossal/core/error.h"

namespace colossal::kernels::cpu {

namespace {

int max_threads() {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, std::min(hw, at::get_num_threads()));
}

// Elements per thread below which a thread is not worth starting (spawn ~ tens of us).
constexpr int64_t kGrain = int64_t(1) << 18;

// Threads for n work items of which each thread should get at least `grain`.
int threads_for(int64_t n, int64_t grain) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(max_threads(), n / std::max<int64_t>(1, grain))));
}

// f(thread, begin, end) over [0, n) in `nt` contiguous slices; slice 0 runs on this thread.
template <class F>
void parallel(int64_t n, int nt, const F& f) {
  if (nt <= 1) {
    f(0, int64_t(0), n);
    return;
  }
  const int64_t chunk = (n + nt - 1) / nt;
  std::vector<std::thread> pool;
  pool.reserve(nt - 1);
  for (int t = 1; t < nt; ++t) {
    const int64_t b = std::min(n, t * chunk), e = std::min(n, (t + 1) * chunk);
    pool.emplace_back([&f, t, b, e] { f(t, b, e); });
  }
  f(0, int64_t(0), std::min(n, chunk));
  for (auto& th : pool) th.join();
}

// The value an op with result dtype T stores for the fp32 result x.
template <typename T>
inline float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename F>
void dispatch(at::ScalarType st, const char* name, F&& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      throw InputError(str(name, ": dtype ", st, " is not supported (float, bfloat16, half)"));
  }
}

// Lanes of ATen's float sum kernel on this CPU (0: not known here; the callers then sum in
// double). On x86-64 it runs 8 lanes (the AVX2 and default builds of the kernel; LibTorch
// dispatches sum to the AVX2 one on AVX512 machines too: checked against at::sum, all rows
// bitwise).
int aten_float_lanes() {
#if defined(__x86_64__)
  return 8;
#else
  return 0;
#endif
}

// The fp32 sum of a[0, n) in the order of ATen's CPU sum over a contiguous row
// (vectorized_inner_sum: rows of 4 vectors of V lanes summed with a 4-level cascade, the leftover
// vectors, the 4 partial vectors, then the scalar tail and the lanes). Same operands, same
// order: the same bits as at::sum, so RMSNorm's rstd equals the composite's.
float aten_order_sum(const float* a, int64_t n, int v) {
  constexpr int kLevels = 4, kIlp = 4, kMaxV = 16;
  const int64_t vec_size = n / v, size_ilp = vec_size / kIlp;
  auto ceil_log2 = [](int64_t x) -> int64_t {
    if (x <= 2) return 1;
    int64_t b = 63;
    const uint64_t u = static_cast<uint64_t>(x) - 1;
    while (!((u >> b) & 1)) --b;
    return b + 1;
  };
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  float acc[kLevels][kIlp][kMaxV] = {};
  auto add_vec = [v](float* dst, const float* src) {
    for (int l = 0; l < v; ++l) dst[l] += src[l];
  };
  int64_t i = 0;
  while (i + level_step <= size_ilp) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], a + (i * kIlp + k) * v);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add_vec(acc[j][k], acc[j - 1][k]);
        std::fill_n(acc[j - 1][k], v, 0.f);
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], a + (i * kIlp + k) * v);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], acc[j][k]);
  for (int64_t r = size_ilp * kIlp; r < vec_size; ++r) add_vec(acc[0][0], a + r * v);
  for (int k = 1; k < kIlp; ++k) add_vec(acc[0][0], acc[0][k]);
  float total = 0.f;
  for (int64_t k = vec_size * v; k < n; ++k) total += a[k];
  for (int l = 0; l < v; ++l) total += acc[0][0][l];
  return total;
}

}  // namespace

// ---- RMSNorm ----
void rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, at::Tensor& rstd,
                  double eps) {
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    const T* wp = w.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    float* rp = rstd.mutable_data_ptr<float>();
    const float epsf = static_cast<float>(eps), hf = static_cast<float>(h);
    const int lanes = aten_float_lanes();
    parallel(rows, threads_for(rows * h, kGrain), [&](int, int64_t b, int64_t e) {
      std::vector<float> sq(lanes ? h : 0);
      for (int64_t r = b; r < e; ++r) {
        const T* xr = xp + r * h;
        T* yr = yp + r * h;
        // The composite squares in fp32 (rounded) and sums them with ATen's CPU reduction;
        // where its lane count is known the same order is replayed, else a double accumulator
        // gives the (nearly always equal) correctly rounded sum of the same squares.
        float sum;
        if (lanes) {
          for (int64_t i = 0; i < h; ++i) {
            const float f = static_cast<float>(xr[i]);
            sq[i] = f * f;
          }
          sum = aten_order_sum(sq.data(), h, lanes);
        } else {
          double acc = 0;
          for (int64_t i = 0; i < h; ++i) {
            const float f = static_cast<float>(xr[i]);
            acc += static_cast<double>(f * f);
          }
          sum = static_cast<float>(acc);
        }
        const float var = sum / hf;
        const float rs = 1.f / std::sqrt(var + epsf);
        rp[r] = rs;
        for (int64_t i = 0; i < h; ++i)
          yr[i] =
              static_cast<T>(static_cast<float>(wp[i]) * rnd<T>(static_cast<float>(xr[i]) * rs));
      }
    });
  });
}

void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw) {
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = dy.const_data_ptr<T>();
    const T* xp = x.const_data_ptr<T>();
    const T* wp = w.const_data_ptr<T>();
    const float* rp = rstd.const_data_ptr<float>();
    T* dxp = dx.mutable_data_ptr<T>();
    const int nt = threads_for(rows * h, kGrain);
    // Per-thread partial sums of dweight (fp32 products, double accumulators: a long run of
    // rows adds no fp32 error), added in thread order (deterministic).
    std::vector<double> part(static_cast<size_t>(nt) * h, 0.0);
    std::vector<float> wf(h);
    for (int64_t i = 0; i < h; ++i) wf[i] = static_cast<float>(wp[i]);
    const float inv_h = 1.f / static_cast<float>(h);
    parallel(rows, nt, [&](int t, int64_t b, int64_t e) {
      double* acc = part.data() + static_cast<size_t>(t) * h;
      std::vector<float> n(h), dn(h);
      for (int64_t r = b; r < e; ++r) {
        const T* xr = xp + r * h;
        const T* gr = dyp + r * h;
        const float rs = rp[r];
        float dot = 0.f;
        for (int64_t i = 0; i < h; ++i) {
          const float g = static_cast<float>(gr[i]);
          n[i] = static_cast<float>(xr[i]) * rs;
          dn[i] = g * wf[i];
          dot += dn[i] * n[i];
          acc[i] += g * rnd<T>(n[i]);  // the forward multiplied w by the rounded n
        }
        const float mean = dot * inv_h;
        T* dr = dxp + r * h;
        for (int64_t i = 0; i < h; ++i) dr[i] = static_cast<T>(rs * (dn[i] - n[i] * mean));
      }
    });
    T* dwp = dw.mutable_data_ptr<T>();
    for (int64_t i = 0; i < h; ++i) {
      double s = 0.0;
      for (int t = 0; t < nt; ++t) s += part[static_cast<size_t>(t) * h + i];
      dwp[i] = static_cast<T>(static_cast<float>(s));
    }
  });
}

// ---- Rotary ----
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y,
            bool backward) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
  dispatch(x.scalar_type(), "apply_rotary", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    const T* cp = cos.const_data_ptr<T>();
    const T* sp = sin.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    const int64_t rows = B * H * S;
    parallel(rows, threads_for(rows * D, kGrain), [&](int, int64_t b0, int64_t e0) {
      for (int64_t r = b0; r < e0; ++r) {
        const int64_t s = r % S, hd = (r / S) % H, b = r / (S * H);
        const T* xr = xp + b * x.stride(0) + hd * x.stride(1) + s * x.stride(2);
        T* yr = yp + b * y.stride(0) + hd * y.stride(1) + s * y.stride(2);
        const T* cr = cp + b * cos.stride(0) + s * cos.stride(1);
        const T* sr = sp + b * sin.stride(0) + s * sin.stride(1);
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = static_cast<float>(xr[j]), x2 = static_cast<float>(xr[j + half]);
          const float c1 = static_cast<float>(cr[j]), c2 = static_cast<float>(cr[j + half]);
          const float s1 = static_cast<float>(sr[j]), s2 = static_cast<float>(sr[j + half]);
          if (!backward) {
            yr[j] = static_cast<T>(rnd<T>(x1 * c1) + rnd<T>(-x2 * s1));
            yr[j + half] = static_cast<T>(rnd<T>(x2 * c2) + rnd<T>(x1 * s2));
          } else {
            yr[j] = static_cast<T>(rnd<T>(x1 * c1) + rnd<T>(x2 * s2));
            yr[j + half] = static_cast<T>(rnd<T>(x2 * c2) - rnd<T>(x1 * s1));
          }
        }
      }
    });
  });
}

// ---- SwiGLU ----
void swiglu_fwd(const at::Tensor& gate, const at::Tensor& up, at::Tensor& y) {
  const int64_t n = gate.numel();
  dispatch(gate.scalar_type(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate.const_data_ptr<T>();
    const T* up_ = up.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    parallel(n, threads_for(n, kGrain), [&](int, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = static_cast<float>(gp[i]);
        const float s = g / (1.f + std::exp(-g));
        yp[i] = static_cast<T>(rnd<T>(s) * static_cast<float>(up_[i]));
      }
    });
  });
}

void swiglu_bwd(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                at::Tensor& dgate, at::Tensor& dup) {
  const int64_t n = gate.numel();
  dispatch(gate.scalar_type(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    const T* dp = dy.const_data_ptr<T>();
    const T* gp = gate.const_data_ptr<T>();
    const T* up_ = up.const_data_ptr<T>();
    T* dgp = dgate.mutable_data_ptr<T>();
    T* dup_ = dup.mutable_data_ptr<T>();
    parallel(n, threads_for(n, kGrain), [&](int, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float d = static_cast<float>(dp[i]), g = static_cast<float>(gp[i]);
        const float ex = std::exp(-g);
        const float sig = 1.f / (1.f + ex), silu = g / (1.f + ex);
        dup_[i] = static_cast<T>(d * rnd<T>(silu));
        const float ds = rnd<T>(d * static_cast<float>(up_[i]));
        // 1 + g * (1 - sig) contracted, as in ATen's vectorised silu_backward
        dgp[i] = static_cast<T>(ds * sig * std::fma(g, 1.f - sig, 1.f));
      }
    });
  });
}

// ---- AdamW (the arithmetic of ATen's CPU fused AdamW for fp32 state) ----
namespace {
template <typename G, typename W>
void adamw_impl(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                const at::Tensor& work, const AdamWStep& hy) {
  constexpr bool kWork = !std::is_same_v<W, void>;
  const int64_t n = p.numel();
  float* pp = p.mutable_data_ptr<float>();
  float* mp = m.mutable_data_ptr<float>();
  float* vp = v.mutable_data_ptr<float>();
  const G* gp = g.const_data_ptr<G>();
  W* wp = nullptr;
  if constexpr (kWork) wp = static_cast<W*>(work.data_ptr());
  const double step = static_cast<double>(static_cast<float>(hy.step));
  const double bc1 = 1 - std::pow(hy.beta1, step), bc2 = 1 - std::pow(hy.beta2, step);
  const float neg_step = static_cast<float>(-(hy.lr / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float keep = static_cast<float>(1 - hy.lr * hy.weight_decay);
  const float c1 = static_cast<float>(1 - hy.beta1), b2 = static_cast<float>(hy.beta2),
              c2 = static_cast<float>(1 - hy.beta2), eps = static_cast<float>(hy.eps),
              div = static_cast<float>(hy.grad_divisor);
  const bool divide = hy.grad_divisor != 1.0, decay = hy.weight_decay != 0.0;
  const bool small = std::abs(c1) < 0.5f;  // exp_avg.lerp_(grad, 1 - beta1), as ATen splits it
  parallel(n, threads_for(n, 1 << 18), [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float gr = static_cast<float>(gp[i]);
      if (divide) gr = gr / div;
      float pv = pp[i];
      if (decay) pv = pv * keep;
      const float mv = small ? std::fma(c1, gr - mp[i], mp[i]) : std::fma(c1 - 1.f, gr - mp[i], gr);
      const float vv = std::fma(c2 * gr, gr, vp[i] * b2);  // contracted, as ATen's loop
      const float denom = std::sqrt(vv) / bc2_sqrt + eps;
      pv = pv + neg_step * mv / denom;
      pp[i] = pv;
      mp[i] = mv;
      vp[i] = vv;
      if constexpr (kWork) wp[i] = static_cast<W>(pv);
    }
  });
}
}  // namespace

void adamw(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
           const at::Tensor& work, const AdamWStep& hyper) {
  dispatch(g.scalar_type(), "fused_adamw grad", [&](auto gtag) {
    using G = decltype(gtag);
    if (!work.defined()) {
      adamw_impl<G, void>(p, g, m, v, work, hyper);
    } else {
      dispatch(work.scalar_type(), "fused_adamw working",
               [&](auto wtag) { adamw_impl<G, decltype(wtag)>(p, g, m, v, work, hyper); });
    }
  });
}

// ---- Softmax cross-entropy gradient (in place) ----
void cross_entropy_grad(at::Tensor& logits, const at::Tensor& targets, at::Tensor& row_loss,
                        float scale, int64_t ignore_index) {
  const int64_t rows = logits.size(0), V = logits.size(1);
  dispatch(logits.scalar_type(), "cross_entropy_grad", [&](auto tag) {
    using T = decltype(tag);
    T* xp = logits.mutable_data_ptr<T>();
    const int64_t* tp = targets.const_data_ptr<int64_t>();
    float* lp = row_loss.mutable_data_ptr<float>();
    parallel(rows, threads_for(rows * V, kGrain), [&](int, int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* x = xp + r * V;
        const int64_t tgt = tp[r];
        const bool valid = tgt != ignore_index;
        float m = -INFINITY;
        for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<float>(x[j]));
        // fp64 sum of the exps: a serial fp32 sum over a 32000-wide row drifts by ~1e-4
        // relative (seen against the CUDA kernel's tree sum); in fp64 it is exact to fp32.
        double sum = 0.0;
        for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<float>(x[j]) - m);
        const float lse = m + static_cast<float>(std::log(sum));
        lp[r] = valid ? lse - static_cast<float>(x[tgt]) : 0.f;
        const float sc = valid ? scale : 0.f;
        for (int64_t j = 0; j < V; ++j) {
          float p = std::exp(static_cast<float>(x[j]) - lse);
          if (j == tgt) p -= 1.f;
          x[j] = static_cast<T>(p * sc);
        }
      }
    });
  });
}

}  // namespace colossal::kernels::cpu
