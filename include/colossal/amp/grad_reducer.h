// Cross-rank agreement for the mixed-precision step, injected so amp/ does not depend on a
// particular communicator: the caller (a plugin) wires these to its Communicator's
// all_reduce over the data-parallel group. An empty function means a single process.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace colossal::amp {

struct GradReducer {
  // In-place all-reduce of a small CPU or device tensor.
  std::function<void(at::Tensor&)> all_reduce_max;  // overflow flag
  std::function<void(at::Tensor&)> all_reduce_sum;  // sum of squared gradient entries (fp64)
};

}  // namespace colossal::amp
