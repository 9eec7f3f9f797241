// The `ring` sequence-parallel mode of the sharded linear layers (ColossalAI's
// sequence_parallelism_mode "ring"; Megatron sequence parallelism with the communication
// overlapped with the GEMMs): the all-gather of the sequence before a column linear and the
// reduce-scatter after a row linear are done one sequence chunk at a time around the
// tensor-parallel ring (batched send/recv to the next / from the previous rank), each arrived
// chunk multiplied while the next one is in flight. Results equal split_gather's
// (gather_from_sequence + linear, linear + reduce_scatter_sequence) up to the order of the
// sums. Autograd functions; backward is symmetric (the column's input gradient is reduce-
// scattered around the ring chunk by chunk while its weight gradient accumulates over the
// re-circulated input chunks; the row's output gradient is all-gathered chunk by chunk into
// the input and weight gradients). Only the local input is kept for backward, as in Megatron.
// With a group of one rank each is a plain linear.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "colossal/dist/communicator.h"

namespace colossal::nn {

// gather_from_sequence(x, group, dim) W^T: x holds this rank's chunk of the sequence along
// `dim` (not the last dim); the result holds every rank's chunk in rank order, features
// local (weight [out_local, in]).
at::Tensor ring_gather_linear(const at::Tensor& x, const at::Tensor& weight,
                              const dist::Communicator& group, int64_t dim = 1);

// reduce_scatter_sequence(x W^T, group, dim): x holds the whole sequence along `dim` with the
// input features split (weight [out, in_local]); rank r gets the sum over ranks of chunk r.
// x.size(dim) must be divisible by the group size (InputError otherwise).
at::Tensor ring_linear_reduce_scatter(const at::Tensor& x, const at::Tensor& weight,
                                      const dist::Communicator& group, int64_t dim = 1);

}  // namespace colossal::nn
