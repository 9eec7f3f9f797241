// Internal to src/kernels/: what every op's dispatch file (<op>.cpp) shares: the path a tensor
// takes (CPU loop, CUDA kernel, or the ATen reference), the argument checks, and the
// conversions to the CUDA launch wrappers of cuda_kernels.h.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdint>
#include <initializer_list>

#include "colossal/core/error.h"
#include "colossal/kernels/enabled.h"
#ifdef COLOSSAL_WITH_CUDA
#include "kernels/cuda_kernels.h"
#endif

namespace colossal::kernels::detail {

enum class Path { Cpu, Cuda, Reference };

// CPU: our loops; CUDA: our kernels when this build compiled them and LibTorch has CUDA; any
// other device: the reference composite. Defined in enabled.cpp next to has_fused_kernels.
Path path_for(const at::Tensor& t);

inline bool float_type(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  COLOSSAL_CHECK_INPUT(t.defined(), op, ": ", name, " is undefined");
  COLOSSAL_CHECK_INPUT(float_type(t.scalar_type()), op, ": ", name, " has dtype ", t.scalar_type(),
                       "; expected float, bfloat16 or half");
}

inline void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  COLOSSAL_CHECK_INPUT(t.defined(), op, ": ", name, " is undefined");
  COLOSSAL_CHECK_INPUT(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ",
                       t.scalar_type(), " but ", ref_name, " has ", ref.scalar_type());
  COLOSSAL_CHECK_INPUT(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
                       ref_name, " is on ", ref.device());
}

// Whether autograd must record the op: grad mode on and some input requires grad.
inline bool needs_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t->requires_grad()) return true;
  return false;
}

inline at::Tensor unit_last(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

#ifdef COLOSSAL_WITH_CUDA
inline cuda::DType cuda_dtype(at::ScalarType st) {
  switch (st) {
    case at::kBFloat16:
      return cuda::DType::BF16;
    case at::kHalf:
      return cuda::DType::F16;
    default:
      return cuda::DType::F32;
  }
}
// The current stream of t's device (through c10's device-generic interface, so no CUDA
// headers are needed here).
inline cuda::Stream stream_of(const at::Tensor& t) {
  const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return static_cast<cuda::Stream>(s.native_handle());
}
// t itself when its data is 16-byte aligned, else an aligned copy (a fresh allocation).
inline at::Tensor aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 ? t : t.clone();
}
#endif

}  // namespace colossal::kernels::detail
