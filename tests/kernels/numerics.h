// Comparison helpers of the kernel tests (CPU and CUDA tensors alike: values are compared on
// the host in fp64).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <utility>

namespace colossal::test {

// Largest |a - b| / (atol + rtol * |b|) over the elements (<= 1 passes).
inline double excess(const at::Tensor& a, const at::Tensor& b, double rtol, double atol) {
  at::Tensor x = a.cpu().to(at::kDouble), y = b.cpu().to(at::kDouble);
  return ((x - y).abs() / (atol + rtol * y.abs())).max().item<double>();
}
// Fraction of elements that are bitwise equal.
inline double frac_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.cpu().eq(b.cpu()).to(at::kDouble).mean().item<double>();
}
inline double max_abs(const at::Tensor& t) {
  return t.abs().max().cpu().to(at::kDouble).item<double>();
}

// One unit in the last place of each dtype (relative): the contract's tolerance for outputs
// that the composite rounds at more points than the fused kernel.
inline double ulp(at::ScalarType st) {
  switch (st) {
    case at::kBFloat16:
      return std::ldexp(1.0, -7);
    case at::kHalf:
      return std::ldexp(1.0, -10);
    default:
      return std::ldexp(1.0, -23);
  }
}

inline constexpr at::ScalarType kTypes[] = {at::kFloat, at::kBFloat16, at::kHalf};

// d(y . dy)/da and /db.
inline std::pair<at::Tensor, at::Tensor> grads_of(const at::Tensor& y, const at::Tensor& dy,
                                                  const at::Tensor& a, const at::Tensor& b) {
  auto g = torch::autograd::grad({y}, {a, b}, {dy});
  return {g[0], g[1]};
}

}  // namespace colossal::test
