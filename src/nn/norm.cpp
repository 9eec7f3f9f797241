// RMSNorm, numerically as transformers' LlamaRMSNorm; the fused kernels on CUDA.
#include "colossal/nn/norm.h"

#include <ATen/ATen.h>

#include "colossal/kernels/fused.h"
#include "colossal/nn/linear.h"

namespace colossal::nn {

RMSNorm::RMSNorm(int64_t dim, double eps, const at::TensorOptions& opts) : eps_(eps) {
  register_parameter("weight", at::empty({dim}, opts));
}

std::pair<at::Tensor, at::Tensor> RMSNorm::forward_add(const at::Tensor& x, const at::Tensor& r) {
  ForwardScope scope(*this);
  if (use_fused_kernels(x) && x.scalar_type() == weight().scalar_type() &&
      r.scalar_type() == x.scalar_type() && r.sizes() == x.sizes())
    return kernels::add_rms_norm(x, r, weight(), eps_);
  at::Tensor h = x + r;
  return {h, forward(h)};
}

at::Tensor RMSNorm::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (use_fused_kernels(x) && x.scalar_type() == weight().scalar_type())
    return kernels::rms_norm(x, weight(), eps_);
  at::Tensor h = x.to(at::kFloat);
  at::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(var + eps_);
  return weight() * h.to(x.scalar_type());
}

}  // namespace colossal::nn
