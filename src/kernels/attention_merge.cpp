// Attention merge by log-sum-exp (kernels/attention_merge.h): argument checks, the ATen
// reference (also the CPU path) and the CUDA dispatch (kernel in attention_merge.cu).
#include "colossal/kernels/attention_merge.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include "colossal/core/accelerator.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("attention_merge");
#endif

using namespace detail;  // path_for, check_dtype, cuda_dtype, stream_of (op_common.h)

namespace {

void check_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                 const at::Tensor& part_lse) {
  constexpr const char* op = "attention_merge";
  check_dtype(op, "part_out", part_out);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"out", &out},
                         {"lse", &lse},
                         {"part_lse", &part_lse}})
    COLOSSAL_CHECK_INPUT(t->scalar_type() == at::kFloat, op, ": ", name, " has dtype ",
                         t->scalar_type(), "; expected float");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"lse", &lse},
                         {"part_out", &part_out},
                         {"part_lse", &part_lse}})
    COLOSSAL_CHECK_INPUT(t->device() == out.device(), op, ": ", name, " is on ", t->device(),
                         " but out is on ", out.device());
  COLOSSAL_CHECK_INPUT(out.dim() == 4, op, ": out must be [B, H, n, D], got ", out.sizes());
  COLOSSAL_CHECK_INPUT(part_out.sizes() == out.sizes(), op, ": part_out has shape ",
                       part_out.sizes(), " but out has ", out.sizes());
  COLOSSAL_CHECK_INPUT(lse.dim() == 3 && lse.sizes() == out.sizes().slice(0, 3), op,
                       ": lse must be [B, H, n] = ", out.sizes().slice(0, 3), ", got ",
                       lse.sizes());
  COLOSSAL_CHECK_INPUT(part_lse.sizes() == lse.sizes(), op, ": part_lse has shape ",
                       part_lse.sizes(), " but lse has ", lse.sizes());
  COLOSSAL_CHECK_INPUT(out.size(3) <= 1 || out.stride(3) == 1, op,
                       ": out must have a unit last stride (it is written in place), got strides ",
                       out.strides());
}

}  // namespace

void attention_merge_reference(const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& part_out, const at::Tensor& part_lse) {
  check_merge(out, lse, part_out, part_lse);
  const at::Tensor l_new = at::logaddexp(lse, part_lse);
  const at::Tensor empty = l_new.isneginf();  // both -inf: the row stays as it is
  const at::Tensor wa = at::where(empty, 1.0, (lse - l_new).exp_()).unsqueeze(-1);
  const at::Tensor wb = at::where(empty, 0.0, (part_lse - l_new).exp_()).unsqueeze(-1);
  out.mul_(wa).add_(part_out.mul(wb));
  lse.copy_(l_new);
}

void attention_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse) {
  if (path_for(out) != Path::Cuda) return attention_merge_reference(out, lse, part_out, part_lse);
#ifdef COLOSSAL_WITH_CUDA
  check_merge(out, lse, part_out, part_lse);
  c10::DeviceGuard guard(out.device());
  const at::Tensor part = unit_last(part_out);
  cuda::MergeShape s{out.size(0), out.size(1), out.size(2), out.size(3), {}, {}, {}, {}};
  for (int k = 0; k < 3; ++k) {
    s.out_s[k] = out.stride(k);
    s.part_s[k] = part.stride(k);
    s.lse_s[k] = lse.stride(k);
    s.plse_s[k] = part_lse.stride(k);
  }
  cuda::attention_merge(out.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(),
                        part.const_data_ptr(), part_lse.const_data_ptr<float>(), s,
                        cuda_dtype(part.scalar_type()), stream_of(out));
#endif
}

}  // namespace colossal::kernels
