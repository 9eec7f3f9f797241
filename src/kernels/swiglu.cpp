// SwiGLU on separate gate/up tensors and on one packed tensor (kernels/swiglu.h): argument
// checks, the ATen references, the CPU loops, the device dispatch (CUDA kernels in swiglu.cu)
// and the autograd functions.
#include "colossal/kernels/swiglu.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/fp8.h"
#include "kernels/cpu_common.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("swiglu");
COLOSSAL_REGISTER_CUDA_KERNEL("swiglu_packed");
#endif

// ---- CPU loops ----
namespace cpu {
namespace {

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

}  // namespace
}  // namespace cpu

namespace {

using namespace detail;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// FP8 known amaxes (kernels/fp8.h): while capture is on, the kernels below also reduce the amax
// of what they store into a zeroed slot (fp8_amax_slot), recorded for the tensor afterwards (an
// FP8 cast of it then skips its amax pass). The CPU paths record the amax computed after the
// loop (the same value: the max of the stored elements), which keeps the bookkeeping under
// make test.
#ifdef COLOSSAL_WITH_CUDA
float* slot_ptr(const at::Tensor& slot) {
  return slot.defined() ? slot.mutable_data_ptr<float>() : nullptr;
}
#endif

// ---- SwiGLU ----
void check_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check_dtype("swiglu", "gate", gate);
  check_same("swiglu", "up", up, "gate", gate);
  COLOSSAL_CHECK_INPUT(gate.sizes() == up.sizes(), "swiglu: up has shape ", up.sizes(),
                       " but gate has ", gate.sizes());
}

at::Tensor swiglu_fwd(const at::Tensor& g, const at::Tensor& u) {
  at::Tensor y = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (path_for(g) == Path::Cpu) {
    cpu::swiglu_fwd(g, u, y);
    record_computed_fp8_amax(y);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(g.device());
    at::Tensor amax = fp8_amax_slot(g);
    cuda::swiglu_fwd(g.const_data_ptr(), u.const_data_ptr(), y.mutable_data_ptr(), g.numel(),
                     cuda_dtype(g.scalar_type()), stream_of(g), slot_ptr(amax));
    if (amax.defined()) record_fp8_amax(y, amax);
#endif
  }
  return y;
}

struct SwiGLUFn : torch::autograd::Function<SwiGLUFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    at::Tensor g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return swiglu_fwd(g, u);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    at::Tensor dy = grad[0].contiguous();
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    if (path_for(g) == Path::Cpu) {
      cpu::swiglu_bwd(dy, g, u, dg, du);
      record_computed_fp8_amax(dg);
      record_computed_fp8_amax(du);
    } else {
#ifdef COLOSSAL_WITH_CUDA
      c10::DeviceGuard guard(g.device());
      at::Tensor amax_g = fp8_amax_slot(g), amax_u = fp8_amax_slot(g);
      cuda::swiglu_bwd(dy.const_data_ptr(), g.const_data_ptr(), u.const_data_ptr(),
                       dg.mutable_data_ptr(), du.mutable_data_ptr(), g.numel(),
                       cuda_dtype(g.scalar_type()), stream_of(g), slot_ptr(amax_g),
                       slot_ptr(amax_u));
      if (amax_g.defined()) {
        record_fp8_amax(dg, amax_g);
        record_fp8_amax(du, amax_u);
      }
#endif
    }
    return {dg, du};
  }
};

// ---- Packed SwiGLU ----
void check_swiglu_packed(const at::Tensor& gu) {
  check_dtype("swiglu_packed", "gu", gu);
  COLOSSAL_CHECK_INPUT(gu.dim() >= 1 && gu.size(-1) % 2 == 0,
                       "swiglu_packed: gu must be [..., 2F] (gate then up), got ", gu.sizes());
}

// y = silu(gate) * up for a contiguous packed gu [.., 2F].
at::Tensor swiglu_packed_fwd(const at::Tensor& gu) {
  const int64_t f = gu.size(-1) / 2;
  if (path_for(gu) == Path::Cpu)
    return swiglu_fwd(gu.narrow(-1, 0, f).contiguous(), gu.narrow(-1, f, f).contiguous());
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() = f;
  at::Tensor y = at::empty(shape, gu.options());
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(gu.device());
  at::Tensor amax = fp8_amax_slot(gu);
  cuda::swiglu_packed_fwd(gu.const_data_ptr(), y.mutable_data_ptr(), f == 0 ? 0 : y.numel() / f, f,
                          cuda_dtype(gu.scalar_type()), stream_of(gu), slot_ptr(amax));
  if (amax.defined()) record_fp8_amax(y, amax);
#endif
  return y;
}

struct SwiGLUPackedFn : torch::autograd::Function<SwiGLUPackedFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gu_in) {
    at::Tensor gu = gu_in.contiguous();
    ctx->save_for_backward({gu});
    return swiglu_packed_fwd(gu);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor()};
    const at::Tensor& gu = saved[0];
    const int64_t f = gu.size(-1) / 2;
    at::Tensor dy = grad[0].contiguous();
    if (path_for(gu) == Path::Cpu) {
      at::Tensor g = gu.narrow(-1, 0, f).contiguous(), u = gu.narrow(-1, f, f).contiguous();
      at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
      cpu::swiglu_bwd(dy, g, u, dg, du);
      at::Tensor dgu = at::cat({dg, du}, -1);
      record_computed_fp8_amax(dgu);
      return {dgu};
    }
    at::Tensor dgu = at::empty_like(gu);
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(gu.device());
    at::Tensor amax = fp8_amax_slot(gu);
    cuda::swiglu_packed_bwd(dy.const_data_ptr(), gu.const_data_ptr(), dgu.mutable_data_ptr(),
                            f == 0 ? 0 : dy.numel() / f, f, cuda_dtype(gu.scalar_type()),
                            stream_of(gu), slot_ptr(amax));
    if (amax.defined()) record_fp8_amax(dgu, amax);
#endif
    return {dgu};
  }
};

}  // namespace

// ---- SwiGLU ----
at::Tensor swiglu_reference(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu(gate, up);
  if (!has_fused_kernels(gate)) return swiglu_reference(gate, up);
  if (needs_grad({&gate, &up})) return SwiGLUFn::apply(gate, up);
  return swiglu_fwd(gate.contiguous(), up.contiguous());
}

// ---- Packed SwiGLU ----
at::Tensor swiglu_packed_reference(const at::Tensor& gu) {
  const int64_t f = gu.size(-1) / 2;
  return at::silu(gu.narrow(-1, 0, f)) * gu.narrow(-1, f, f);
}

at::Tensor swiglu_packed(const at::Tensor& gu) {
  check_swiglu_packed(gu);
  if (!has_fused_kernels(gu)) return swiglu_packed_reference(gu);
  if (needs_grad({&gu})) return SwiGLUPackedFn::apply(gu);
  return swiglu_packed_fwd(gu.contiguous());
}

}  // namespace colossal::kernels
