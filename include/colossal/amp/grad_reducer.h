// Cross-rank agreement for the mixed-precision step (global gradient norm, overflow flag),
// injected into whoever computes the norm (the optimizer wrappers, ZeRO, Gemini) instead of
// being built inside them. An empty reducer means a single process.
//
// A reducer spans one or several mesh axes. over() makes one from an axis's communicator;
// compose() chains several: the sum of squares is SUM all-reduced over each axis in turn (dp,
// then tp, then pp gives the sum over the whole dp x tp x pp grid) and the overflow flag MAX
// all-reduced over each, so every rank of every axis agrees on a skip. A gradient that is
// replicated over an axis (a norm weight under tensor parallelism) must enter the local sum on
// one rank of that axis only, or it is counted `size` times: counts() says whether this rank is
// that one (Megatron's param_is_not_tensor_parallel_duplicate).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "colossal/dist/communicator.h"

namespace colossal::dist {
class ParallelDims;
}

namespace colossal::amp {

struct GradReducer {
  // In-place all-reduce of a small CPU or device tensor.
  std::function<void(at::Tensor&)> all_reduce_max;  // overflow flag
  std::function<void(at::Tensor&)> all_reduce_sum;  // sum of squared gradient entries (fp64)

  // The axes it spans (names such as "dp", "tp") and this rank's rank along each.
  struct Axis {
    std::string name;
    int rank = 0;
    int size = 1;
  };
  std::vector<Axis> axes;

  // Whether this rank adds a gradient replicated over `replicated_over` (axis names) to its
  // local sum: only when it is rank 0 along each of those axes that the reducer spans.
  bool counts(const std::vector<std::string>& replicated_over) const;
};

// A reducer over `comm`'s ranks, named `axis`. The collective runs on `device` (NCCL moves
// device memory; a host tensor is copied there and back). An invalid or one-rank communicator
// gives a reducer without functions (nothing to agree on), as a single process has.
GradReducer over(const dist::Communicator& comm, at::Device device, std::string axis = "dp");

// Applies each reducer in turn (empty ones are skipped): sums over the product of the axes.
GradReducer compose(const std::vector<GradReducer>& reducers);

// The norm reducer of a ZeRO / Gemini optimizer under `dims`: over the ranks it shards over
// (dp x sp, named "dp"), then "tp", then "pp" -- the whole world, each axis once.
GradReducer over_parallel_dims(dist::ParallelDims& dims, at::Device device);

}  // namespace colossal::amp
