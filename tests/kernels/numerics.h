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

// add_rms_norm against the two ops it fuses, both through `rms_norm` (the fused norm of the same
// device): outputs {h, y} and the gradients of x, r and weight for upstream gradients dh, dy,
// fused first, then the pair. Bitwise equality is the contract (the kernel adds in fp32 and
// rounds as ATen's add and autograd's gradient sum do).
struct AddRmsResult {
  at::Tensor h, y, dx, dr, dw;
};
template <typename Fused, typename Norm>
std::pair<AddRmsResult, AddRmsResult> add_rms_cases(const at::Tensor& x0, const at::Tensor& r0,
                                                    const at::Tensor& w0, const at::Tensor& dh,
                                                    const at::Tensor& dy, Fused fused, Norm norm) {
  auto run = [&](bool use_fused) {
    at::Tensor x = x0.detach().clone().requires_grad_(true),
               r = r0.detach().clone().requires_grad_(true),
               w = w0.detach().clone().requires_grad_(true);
    at::Tensor h, y;
    if (use_fused) {
      std::tie(h, y) = fused(x, r, w);
    } else {
      h = x + r;
      y = norm(h, w);
    }
    auto g = torch::autograd::grad({h, y}, {x, r, w}, {dh, dy});
    return AddRmsResult{h.detach(), y.detach(), g[0], g[1], g[2]};
  };
  return {run(true), run(false)};
}

}  // namespace colossal::test
