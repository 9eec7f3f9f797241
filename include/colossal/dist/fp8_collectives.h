// FP8-compressed collectives (ColossalAI's colossalai/quantization/fp8.py scheme, behind the
// plugins' `fp8_communication` option): every rank casts what it sends to FP8 with current
// scaling (kernels::cast_to_fp8: scale = fp8_max / amax, round to nearest even, saturated),
// exchanges the fp8 bytes together with the fp32 inverse scales, and dequantizes what it
// receives (fp8 value as fp32 * inv_scale, one fp32 multiply). Reductions add the dequantized
// contributions in fp32, strictly in rank order (rank 0's first), then divide for Avg; the result
// is converted to the output's dtype once. Every rank therefore ends with exactly the values
// that the dequantize-and-sum of all ranks' fp8 data computes, bit for bit, whatever the engine.
//
// On the wire each destination's part is one packed row [fp32 inv_scale | fp8 bytes padded to a
// multiple of 4], so one engine collective moves data and scales together (Gloo has no fp8
// dtype: the rows travel as bytes). Scales, per part:
//   reduce_scatter_fp8: one per destination slice (a rowwise cast of the [size, n] input), as
//                       ColossalAI's reduce_scatter_fp8 casts each slice of its input list.
//   all_gather_fp8:     one per rank (its whole input).
//   all_reduce_fp8:     reduce_scatter_fp8 of the flattened tensor padded with zeros to a
//                       multiple of size(), then all_gather_fp8 of each rank's reduced slice
//                       (requantized with its own scale); ColossalAI casts the whole tensor with
//                       one scale in the first phase, we scale each slice (same bytes, finer).
// A non-finite input (an fp16 loss-scale overflow) makes its scale 0 and its dequantized values
// NaN, so overflow still reaches every rank.
//
// With async_op the Work finishes the operation in wait() (dequantize, sum, write the output);
// all_reduce_fp8 issues its second phase (the all-gather) there, so ranks must wait for their
// asynchronous fp8 all-reduces in the same order (GradSync waits for its buckets in index
// order). One rank: the same cast round trip, without communication.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "colossal/dist/communicator.h"

namespace colossal::dist {

// In place over all ranks: Sum or Avg (others are an InputError). Any shape and size (padded
// internally); float, bfloat16 or half, contiguous.
Work all_reduce_fp8(Communicator& comm, at::Tensor& tensor, at::ScalarType fp8,
                    ReduceOp op = ReduceOp::Sum, bool async_op = false);
// input holds size() * output.numel() elements (any float dtype); rank r receives the reduction
// (Sum or Avg) of slice r, in output's dtype.
Work reduce_scatter_fp8(Communicator& comm, at::Tensor& output, const at::Tensor& input,
                        at::ScalarType fp8, ReduceOp op = ReduceOp::Sum, bool async_op = false);
// output holds size() * input.numel() elements: rank r's dequantized input lands at
// [r*n, (r+1)*n), in output's dtype (this rank's own part too: every rank holds the same values).
Work all_gather_fp8(Communicator& comm, at::Tensor& output, const at::Tensor& input,
                    at::ScalarType fp8, bool async_op = false);

// The fp8 format of a name: "e4m3" (float8_e4m3fn) or "e5m2"; InputError otherwise.
at::ScalarType fp8_format(const std::string& name);

}  // namespace colossal::dist
