// Dequantisation of frozen weights stored in 4-bit NormalFloat (NF4, QLoRA) or FP8 (e4m3, one
// fp32 scale per output row), for the quantized linear layers of QLoRA (nn/quantized_linear.h).
// On CUDA our kernels (src/kernels/quant.cu) write the weight straight in the compute dtype; on
// any other device the ATen reference runs. Both round at the same points (the fp32 product of a
// level and its block's scale, rounded once to the output dtype), so the kernels equal the
// reference bit for bit (tested on the GPU).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// The 16 NF4 levels, ascending (QLoRA's table, as bitsandbytes has it).
const std::array<float, 16>& nf4_levels();

// NF4 blockwise: element i of the flat weight is level[code_i] * absmax_b (b = i / blocksize).
//   codes   uint8 [ceil(numel / 2)], element 2k in the high nibble of byte k;
//   absmax  fp32 [blocks], or with double quantisation uint8 [blocks] holding codes of `dmap`
//           (fp32 [256]): absmax_b = dmap[absmax[b]] * absmax2[b / blocksize2] + offset;
//   absmax2 fp32 [ceil(blocks / blocksize2)] (double quantisation only, else undefined).
// Returns a contiguous flat [numel] tensor of `dtype` (float, bfloat16, half) on codes' device.
// InputError for sizes or dtypes that do not fit each other.
struct NF4View {
  at::Tensor codes, absmax, absmax2, dmap;
  float offset = 0;
  int64_t numel = 0, blocksize = 64, blocksize2 = 256;
};
at::Tensor dequantize_nf4(const NF4View& q, at::ScalarType dtype);
at::Tensor dequantize_nf4_reference(const NF4View& q, at::ScalarType dtype);

// FP8 rows: codes float8_e4m3fn [rows, cols], scale fp32 [rows]: codes[r, c] * scale[r], rounded
// once to `dtype`, as a contiguous [rows, cols] tensor on codes' device.
at::Tensor dequantize_fp8_rows(const at::Tensor& codes, const at::Tensor& scale,
                               at::ScalarType dtype);
at::Tensor dequantize_fp8_rows_reference(const at::Tensor& codes, const at::Tensor& scale,
                                         at::ScalarType dtype);

}  // namespace colossal::kernels
