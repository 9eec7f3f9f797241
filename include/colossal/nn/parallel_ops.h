// The region operations of tensor and sequence parallelism, as autograd functions over a
// dist::Communicator (Megatron's mappings). Sharded layers call them from their own forward, so
// the model's code never holds a collective. Each is the adjoint of its partner:
//   copy_to_region          forward identity            backward all-reduce (sum)
//   reduce_from_region      forward all-reduce (sum)    backward identity
//   gather_from_sequence    forward all-gather on dim   backward reduce-scatter on dim
//   reduce_scatter_sequence forward reduce-scatter dim  backward all-gather on dim
//   split_sequence          forward keep own slice      backward all-gather on dim
// With a group of one rank each is the identity.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "colossal/dist/communicator.h"

namespace colossal::nn {

at::Tensor copy_to_region(const at::Tensor& x, const dist::Communicator& group);
at::Tensor reduce_from_region(const at::Tensor& x, const dist::Communicator& group);
// Rank r's slice is at [r*n, (r+1)*n) of `dim` of the result (n = x.size(dim)).
at::Tensor gather_from_sequence(const at::Tensor& x, const dist::Communicator& group,
                                int64_t dim = 1);
// x.size(dim) must be divisible by the group size; rank r keeps the sum of slice r.
at::Tensor reduce_scatter_sequence(const at::Tensor& x, const dist::Communicator& group,
                                   int64_t dim = 1);
at::Tensor split_sequence(const at::Tensor& x, const dist::Communicator& group, int64_t dim = 1);

// All-to-all (DeepSpeed-Ulysses' exchange): x.size(scatter_dim) is cut into group-size slices,
// slice j goes to rank j, and the slices received from ranks 0..n-1 are concatenated along
// gather_dim (rank order). Backward: the all-to-all with the two dims swapped. InputError when
// x.size(scatter_dim) is not divisible by the group size or the dims are equal.
at::Tensor all_to_all_region(const at::Tensor& x, const dist::Communicator& group,
                             int64_t scatter_dim, int64_t gather_dim);

}  // namespace colossal::nn
