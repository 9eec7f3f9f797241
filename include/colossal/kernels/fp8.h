// FP8 casts for FP8 training (nn/fp8_linear.h), with current scaling: scale = fp8_max / amax over
// the whole tensor (tensorwise) or over each row (rowwise), data = round-to-nearest-even of
// x * scale saturated to the format's range, and inv_scale = 1 / scale, the factor a scaled GEMM
// (at::_scaled_mm) multiplies back. On CUDA our kernels (src/kernels/fp8.cu) read the tensor once
// for the amax and once for the cast, which writes the data and, when asked, its transpose in
// the same pass (the backward GEMMs need both layouts), with the scale kept on the device (no
// host synchronisation); elsewhere the ATen reference runs. Both compute the same fp32 scale and
// products, so they agree bit for bit (tested on the GPU).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "colossal/kernels/enabled.h"

namespace colossal::kernels {

// The largest finite value of float8_e4m3fn (448) or float8_e5m2 (57344); InputError otherwise.
double fp8_max(at::ScalarType fp8);

struct Fp8Tensor {
  at::Tensor data;       // fp8 [rows, cols], row-major
  at::Tensor data_t;     // fp8 [cols, rows], row-major: the transpose (when asked; tensorwise)
  at::Tensor inv_scale;  // fp32 [1] (tensorwise) or [rows, 1] (rowwise): x ~ data * inv_scale
};

// x: 2-D float, bfloat16 or half (made contiguous). fp8: float8_e4m3fn or float8_e5m2.
// transpose: also data_t (tensorwise only: InputError with rowwise).
Fp8Tensor cast_to_fp8(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool transpose);
Fp8Tensor cast_to_fp8_reference(const at::Tensor& x, at::ScalarType fp8, bool rowwise,
                                bool transpose);

// The amax of x (2-D or any shape; fp32 [1] on x's device): its recorded one when a kernel
// recorded it (known amaxes, below; counted as a use), else max |x| computed. With
// cast_to_fp8_with_amax, what a tensor split over ranks needs: each rank's amax, all-reduced
// (max) over the group, gives every shard the whole tensor's scale, so each element quantizes
// exactly as in the unsplit tensor (tensor-parallel FP8, nn/fp8_linear.h).
at::Tensor fp8_amax(const at::Tensor& x);
// A tensorwise cast of x (as cast_to_fp8) with the amax given (fp32 [1] on x's device).
Fp8Tensor cast_to_fp8_with_amax(const at::Tensor& x, at::ScalarType fp8, bool transpose,
                                const at::Tensor& amax);

// The tensorwise cast of xs (2-D, one dtype and device, the same number of columns) concatenated
// along their rows, without building the concatenation: one amax over all of them, data
// [sum rows, cols] and, when asked, data_t [cols, sum rows]. Equal bit for bit to cast_to_fp8 of
// at::cat(xs) (which the reference does). The weights of a fused FP8 projection group.
Fp8Tensor cast_to_fp8_concat(const std::vector<at::Tensor>& xs, at::ScalarType fp8, bool transpose);
Fp8Tensor cast_to_fp8_concat_reference(const std::vector<at::Tensor>& xs, at::ScalarType fp8,
                                       bool transpose);

// Known amaxes (tensorwise casts only). A kernel that writes a tensor an FP8 layer will cast
// (SwiGLU's output, the down projection's input; SwiGLU's input gradients, the gate / up
// projections' output gradients) can record the amax of what it wrote (fp32 [1] on the tensor's
// device, the max of |value| over the stored, rounded elements), so cast_to_fp8 skips its own
// amax pass: one read of the tensor fewer, the same scale bit for bit. An entry is keyed by the
// bytes it describes: the storage (held weakly: freed memory never matches), the offset, the
// element count and the version counter (any in-place change invalidates it), so a view or
// reshape of the same bytes finds it. Recording is on only while capture is on (convert_to_fp8
// turns it on; the producers then spend one block reduction and an atomic on it).
void set_fp8_amax_capture(bool on);
bool fp8_amax_capture();
void record_fp8_amax(const at::Tensor& t, const at::Tensor& amax);
// The recorded amax of exactly t's bytes, unchanged since; undefined when none.
at::Tensor known_fp8_amax(const at::Tensor& t);
// For the writers: zeroed fp32 [n] on like's device for their kernels to reduce into while
// capture is on, else undefined; and, for their CPU paths, t's amax computed and recorded
// (capture on only).
at::Tensor fp8_amax_slot(const at::Tensor& like, int64_t n = 1);
void record_computed_fp8_amax(const at::Tensor& t);
// How many casts took a recorded amax instead of computing one (tests).
int64_t fp8_known_amax_uses();

}  // namespace colossal::kernels
