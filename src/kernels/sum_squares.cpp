// Sum of squares of a tensor list (kernels/sum_squares.h): argument checks, the ATen
// reference (also the CPU path) and the CUDA dispatch (kernel in sum_squares.cu), grouped per
// dtype.
#include "colossal/kernels/sum_squares.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <string>
#include <vector>

#include "colossal/core/accelerator.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("sum_squares");
#endif

using namespace detail;  // path_for, check_dtype, cuda_dtype, stream_of (op_common.h)

at::Tensor sum_squares_reference(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return at::zeros({}, at::kDouble);
  return at::stack(at::_foreach_norm(tensors, 2, at::kDouble)).square().sum();
}

at::Tensor sum_squares(const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensors[" + std::to_string(i) + "]";
    check_dtype("sum_squares", name.c_str(), tensors[i]);
    COLOSSAL_CHECK_INPUT(tensors[i].device() == tensors[0].device(), "sum_squares: ", name,
                         " is on ", tensors[i].device(), " but tensors[0] is on ",
                         tensors[0].device());
  }
  if (tensors.empty() || path_for(tensors[0]) != Path::Cuda) return sum_squares_reference(tensors);
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(tensors[0].device());
  std::vector<at::Tensor> keep;  // contiguous copies of strided inputs, alive until launched
  std::vector<at::Tensor> parts;
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    std::vector<const void*> ptrs;
    std::vector<int64_t> numels;
    for (const auto& t : tensors) {
      if (t.scalar_type() != st || t.numel() == 0) continue;
      at::Tensor c = t.contiguous();
      keep.push_back(c);
      ptrs.push_back(c.const_data_ptr());
      numels.push_back(c.numel());
    }
    if (ptrs.empty()) continue;
    const int count = static_cast<int>(ptrs.size());
    at::Tensor partials = at::empty({cuda::sum_squares_blocks(numels.data(), count)},
                                    tensors[0].options().dtype(at::kFloat));
    cuda::sum_squares(ptrs.data(), numels.data(), count, cuda_dtype(st),
                      partials.mutable_data_ptr<float>(), stream_of(tensors[0]));
    parts.push_back(partials.sum(0, false, at::kDouble));
  }
  if (parts.empty()) return at::zeros({}, tensors[0].options().dtype(at::kDouble));
  at::Tensor total = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) total = total + parts[i];
  return total;
#else
  return sum_squares_reference(tensors);
#endif
}

}  // namespace colossal::kernels
