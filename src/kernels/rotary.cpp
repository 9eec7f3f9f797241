// Rotary position embedding (kernels/rotary.h): argument checks, the ATen reference, the CPU
// loop, the device dispatch (CUDA kernel in rotary.cu) and the autograd function (the backward
// is the transposed rotation).
#include "colossal/kernels/rotary.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

#include "colossal/core/accelerator.h"
#include "kernels/cpu_common.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("apply_rotary");
#endif

// ---- CPU loops ----
namespace cpu {
namespace {

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

}  // namespace
}  // namespace cpu

namespace {

using namespace detail;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- Rotary ----
// cos/sin of [B or 1, S, D] -> [B, S, D] views with a unit last stride.
at::Tensor rotary_table(const at::Tensor& t, const at::Tensor& x, const char* name) {
  check_same("apply_rotary", name, t, "x", x);
  const int64_t b = x.size(0), s = x.size(2), d = x.size(3);
  COLOSSAL_CHECK_INPUT(
      t.dim() == 3 && (t.size(0) == b || t.size(0) == 1) && t.size(1) == s && t.size(2) == d,
      "apply_rotary: ", name, " has shape ", t.sizes(), "; expected [", b, ", ", s, ", ", d,
      "] for x of shape ", x.sizes());
  return unit_last(t).expand({b, s, d});
}

void check_rotary(const at::Tensor& x) {
  check_dtype("apply_rotary", "x", x);
  COLOSSAL_CHECK_INPUT(x.dim() == 4, "apply_rotary: x must be [B, heads, S, D], got ", x.sizes());
  COLOSSAL_CHECK_INPUT(x.size(3) % 2 == 0, "apply_rotary: head dim ", x.size(3), " must be even");
}

// The rotation (or its transpose) of x [B, h, S, D] into a new [B, S, h, D]-contiguous tensor,
// returned as the [B, h, S, D] view.
at::Tensor rotary_out(const at::Tensor& xin, const at::Tensor& cos, const at::Tensor& sin,
                      bool backward) {
  at::Tensor x = unit_last(xin);
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  at::Tensor y = at::empty({b, s, h, d}, x.options()).transpose(1, 2);
  if (path_for(x) == Path::Cpu) {
    cpu::rotary(x, cos, sin, y, backward);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    cuda::RotaryShape sh{
        b, h, s, d, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1)};
    // cos and sin share one stride set: make them both contiguous when they differ.
    at::Tensor c = cos, sn = sin;
    if (cos.strides() != sin.strides()) {
      c = cos.contiguous();
      sn = sin.contiguous();
      sh.cb = c.stride(0);
      sh.cs = c.stride(1);
    }
    cuda::rotary(x.const_data_ptr(), c.const_data_ptr(), sn.const_data_ptr(), y.mutable_data_ptr(),
                 sh, backward, cuda_dtype(x.scalar_type()), stream_of(x));
#endif
  }
  return y;
}

struct RotaryFn : torch::autograd::Function<RotaryFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary_out(x, cos, sin, false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    return {rotary_out(grad[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// ---- Rotary ----
at::Tensor apply_rotary_reference(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const int64_t half = x.size(-1) / 2;
  at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rot * s;
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(x);
  at::Tensor c = rotary_table(cos, x, "cos"), s = rotary_table(sin, x, "sin");
  // Gradients for cos/sin are not fused: the composite computes them when asked for.
  if (!has_fused_kernels(x) || needs_grad({&cos, &sin})) return apply_rotary_reference(x, cos, sin);
  if (needs_grad({&x})) return RotaryFn::apply(x, c, s);
  return rotary_out(x, c, s, false);
}

}  // namespace colossal::kernels
