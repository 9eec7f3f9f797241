// RMSNorm and residual add + RMSNorm (kernels/rms_norm.h): argument checks, the ATen
// references, the CPU loops (rstd summed in the order of ATen's CPU sum, so it is bitwise the
// composite's), the device dispatch (CUDA kernels in rms_norm.cu) and the autograd functions.
#include "colossal/kernels/rms_norm.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "colossal/core/accelerator.h"
#include "kernels/cpu_common.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("rms_norm");
#endif

// ---- CPU loops ----
namespace cpu {
namespace {

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

}  // namespace
}  // namespace cpu

namespace {

using namespace detail;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- RMSNorm ----
void check_rms(const at::Tensor& x, const at::Tensor& w) {
  check_dtype("rms_norm", "x", x);
  COLOSSAL_CHECK_INPUT(x.dim() >= 1, "rms_norm: x must have at least one dimension");
  check_same("rms_norm", "weight", w, "x", x);
  COLOSSAL_CHECK_INPUT(w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm: weight has shape ",
                       w.sizes(), " but x's last dimension is ", x.size(-1));
}

#ifdef COLOSSAL_WITH_CUDA
bool cuda_rms_ok(const at::Tensor& x) {
  return cuda::rms_norm_supported(x.size(-1), cuda_dtype(x.scalar_type())) &&
         x.numel() / std::max<int64_t>(1, x.size(-1)) < (int64_t(1) << 31);
}
#endif

// y and the fp32 rstd [rows] for contiguous x. With res (contiguous, x's shape) the row
// normalised is h = x + res, returned third (undefined without res).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_fwd(const at::Tensor& x, const at::Tensor& w,
                                                       double eps,
                                                       const at::Tensor& res = at::Tensor()) {
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor sum;
  if (path_for(x) == Path::Cpu) {
    // The CPU path is the composite's add (one ATen op) and the fused norm of its result.
    if (res.defined()) sum = at::add(x, res);
    cpu::rms_norm_fwd(res.defined() ? sum : x, w, y, rstd, eps);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    const at::Tensor xa = aligned16(x), wa = aligned16(w);
    at::Tensor ra;
    if (res.defined()) {
      ra = aligned16(res);
      sum = at::empty_like(x, at::MemoryFormat::Contiguous);
    }
    cuda::rms_norm_fwd(
        xa.const_data_ptr(), ra.defined() ? ra.const_data_ptr() : nullptr, wa.const_data_ptr(),
        y.mutable_data_ptr(), sum.defined() ? sum.mutable_data_ptr() : nullptr,
        rstd.mutable_data_ptr<float>(), rows, h, eps, cuda_dtype(x.scalar_type()), stream_of(x));
#endif
  }
  return {y, rstd, sum};
}

// dx (plus dres when given: the other gradient of a residual stream) and dweight.
std::pair<at::Tensor, at::Tensor> rms_bwd(const at::Tensor& dy, const at::Tensor& x,
                                          const at::Tensor& w, const at::Tensor& rstd,
                                          const at::Tensor& dres = at::Tensor()) {
  const int64_t h = x.size(-1);
  [[maybe_unused]] const int64_t rows = h ? x.numel() / h : 0;  // the CUDA path's
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dw = at::empty_like(w, at::MemoryFormat::Contiguous);
  if (path_for(x) == Path::Cpu) {
    cpu::rms_norm_bwd(dy, x, w, rstd, dx, dw);
    if (dres.defined()) dx.add_(dres);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    at::Tensor part =
        at::empty({cuda::rms_norm_bwd_blocks(rows, h, cuda_dtype(x.scalar_type())), h},
                  x.options().dtype(at::kFloat));
    const at::Tensor dya = aligned16(dy), xa = aligned16(x), wa = aligned16(w);
    const at::Tensor dra = dres.defined() ? aligned16(dres) : at::Tensor();
    cuda::rms_norm_bwd(dya.const_data_ptr(), xa.const_data_ptr(), wa.const_data_ptr(),
                       rstd.const_data_ptr<float>(), dra.defined() ? dra.const_data_ptr() : nullptr,
                       dx.mutable_data_ptr(), part.mutable_data_ptr<float>(), dw.mutable_data_ptr(),
                       rows, h, cuda_dtype(x.scalar_type()), stream_of(x));
#endif
  }
  return {dx, dw};
}

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    at::Tensor xc = x.contiguous(), wc = w.contiguous();
    auto [y, rstd, unused] = rms_fwd(xc, wc, eps);
    ctx->save_for_backward({xc, wc, rstd});  // x, weight and the fp32 rstd only
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto [dx, dw] = rms_bwd(grad[0].contiguous(), saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

// Outputs {h = x + r, y = rms_norm(h)}; h's gradient and the norm's input gradient are summed
// in the backward kernel and given to both x and r.
struct AddRmsNormFn : torch::autograd::Function<AddRmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& r,
                               const at::Tensor& w, double eps) {
    at::Tensor wc = w.contiguous();
    auto [y, rstd, h] = rms_fwd(x.contiguous(), wc, eps, r.contiguous());
    ctx->save_for_backward({h, wc, rstd});
    return {h, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &dh = grad[0], &dy = grad[1];
    if (!dy.defined()) return {dh, dh, at::Tensor(), at::Tensor()};
    auto [dx, dw] = rms_bwd(dy.contiguous(), saved[0], saved[1], saved[2],
                            dh.defined() ? dh.contiguous() : at::Tensor());
    return {dx, dx, dw, at::Tensor()};
  }
};

// Whether x's rows run our kernels: a device that has them, and on CUDA rows the
// register-resident kernels cover.
bool rms_fused(const at::Tensor& x) {
  if (!has_fused_kernels(x)) return false;
#ifdef COLOSSAL_WITH_CUDA
  if (path_for(x) == Path::Cuda) return cuda_rms_ok(x);
#endif
  return true;
}

}  // namespace

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(var + eps);
  return weight * h.to(x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms(x, weight);
  if (!rms_fused(x)) return rms_norm_reference(x, weight, eps);
  if (needs_grad({&x, &weight})) return RmsNormFn::apply(x, weight, eps);
  return std::get<0>(rms_fwd(x.contiguous(), weight.contiguous(), eps));
}

// ---- Residual add + RMSNorm ----
std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& x, const at::Tensor& r,
                                                         const at::Tensor& weight, double eps) {
  at::Tensor h = x + r;
  return {h, rms_norm_reference(h, weight, eps)};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                               const at::Tensor& weight, double eps) {
  check_rms(x, weight);
  check_dtype("add_rms_norm", "r", r);
  COLOSSAL_CHECK_INPUT(
      r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.device() == x.device(),
      "add_rms_norm: r is ", r.scalar_type(), " ", r.sizes(), " on ", r.device(), "; x is ",
      x.scalar_type(), " ", x.sizes(), " on ", x.device());
  if (!rms_fused(x)) return add_rms_norm_reference(x, r, weight, eps);
  if (needs_grad({&x, &r, &weight})) {
    variable_list out = AddRmsNormFn::apply(x, r, weight, eps);
    return {out[0], out[1]};
  }
  auto [y, rstd, h] = rms_fwd(x.contiguous(), weight.contiguous(), eps, r.contiguous());
  return {h, y};
}

}  // namespace colossal::kernels
