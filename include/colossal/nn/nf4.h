// NF4 (4-bit NormalFloat, QLoRA: Dettmers et al., 2023) storage of frozen weights: blockwise
// absmax normalisation (64 values per block), each value rounded to the nearest of the 16 NF4
// levels (the quantiles of a standard normal, rescaled to [-1, 1], with an exact zero), two codes
// per byte (the first value in the high nibble); with double quantisation the fp32 absmax
// constants are centred on their mean and stored as 8-bit codes of the signed dynamic map (256
// values, Dettmers 2015), blockwise over 256 constants with an fp32 scale each: about 4.127 bits
// per weight. The rounding follows bitsandbytes' reference kernels (midpoint bounds, ties to the
// lower level; full blocks multiply by the reciprocal of their absmax, a tail block divides), so
// codes and scales are bit-for-bit those of `bitsandbytes.functional.quantize_4bit(...,
// quant_type="nf4")` (tested). Quantisation is ATen ops (any device); dequantisation runs our CUDA
// kernel on CUDA, tested bit for bit against the ATen reference.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <vector>

#include "colossal/kernels/quant.h"

namespace colossal::nn {

struct NF4Tensor {
  at::Tensor codes;    // uint8 [ceil(numel / 2)]
  at::Tensor absmax;   // fp32 [blocks]; with double quantisation uint8 [blocks] (dynamic-map codes)
  at::Tensor absmax2;  // double quantisation: fp32 [ceil(blocks / blocksize2)]
  float offset = 0;    // double quantisation: the mean taken off the absmax constants
  int64_t blocksize = 64, blocksize2 = 256;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool double_quant = false;
  int64_t numel() const;
  int64_t bytes() const;  // storage of codes and constants
};

// The 16 NF4 levels, ascending.
const std::array<float, 16>& nf4_levels();
// The signed 8-bit dynamic map (256 fp32 values, ascending) of the double quantisation; one
// shared CPU tensor (read it, do not write to it).
at::Tensor dynamic_map();

// InputError for an empty tensor, a non-floating dtype, blocksize not positive and even.
NF4Tensor quantize_nf4(const at::Tensor& w, int64_t blocksize = 64, bool double_quant = true);
// The dynamic map on `device` (one cached copy per device).
at::Tensor dynamic_map_on(const at::Device& device);

// The weight back in its shape, on the codes' device, in its own dtype or `dtype`: our CUDA
// kernel on CUDA (kernels/quant.h), the ATen reference elsewhere; the reference on any device.
at::Tensor dequantize_nf4(const NF4Tensor& q);
at::Tensor dequantize_nf4(const NF4Tensor& q, at::ScalarType dtype);
at::Tensor dequantize_nf4_reference(const NF4Tensor& q, at::ScalarType dtype);
// The storage as the kernels read it.
kernels::NF4View nf4_view(const NF4Tensor& q);

}  // namespace colossal::nn
