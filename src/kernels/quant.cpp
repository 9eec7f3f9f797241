// Weight dequantisation (kernels/quant.h): argument checks, the ATen references and the device
// dispatch (CUDA kernels in quant.cu). No autograd: the quantized storage is frozen.
#include "colossal/kernels/quant.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <vector>

#include "colossal/core/accelerator.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("nf4_dequantize");
COLOSSAL_REGISTER_CUDA_KERNEL("fp8_rows_dequantize");
#endif

using namespace detail;

const std::array<float, 16>& nf4_levels() {
  // QLoRA's NF4 data type (the paper's appendix; bitsandbytes' table).
  static const std::array<float, 16> kLevels{-1.0f,
                                             -0.6961928009986877f,
                                             -0.5250730514526367f,
                                             -0.39491748809814453f,
                                             -0.28444138169288635f,
                                             -0.18477343022823334f,
                                             -0.09105003625154495f,
                                             0.0f,
                                             0.07958029955625534f,
                                             0.16093020141124725f,
                                             0.24611230194568634f,
                                             0.33791524171829224f,
                                             0.44070982933044434f,
                                             0.5626170039176941f,
                                             0.7229568362236023f,
                                             1.0f};
  return kLevels;
}

namespace {

void check_nf4(const NF4View& q, at::ScalarType dtype) {
  COLOSSAL_CHECK_INPUT(float_type(dtype), "dequantize_nf4: output dtype ", dtype,
                       " is not float, bfloat16 or half");
  COLOSSAL_CHECK_INPUT(q.numel > 0 && q.blocksize > 0 && q.blocksize2 > 0, "dequantize_nf4: numel ",
                       q.numel, ", blocksize ", q.blocksize, ", blocksize2 ", q.blocksize2,
                       " must be positive");
  COLOSSAL_CHECK_INPUT(q.codes.defined() && q.codes.scalar_type() == at::kByte &&
                           q.codes.is_contiguous() && q.codes.numel() == (q.numel + 1) / 2,
                       "dequantize_nf4: codes must be contiguous uint8 [", (q.numel + 1) / 2,
                       "] for ", q.numel, " values");
  const int64_t blocks = (q.numel + q.blocksize - 1) / q.blocksize;
  COLOSSAL_CHECK_INPUT(q.absmax.defined() && q.absmax.is_contiguous() &&
                           q.absmax.numel() == blocks && q.absmax.device() == q.codes.device(),
                       "dequantize_nf4: absmax must be contiguous [", blocks, "] on ",
                       q.codes.device());
  if (q.absmax.scalar_type() == at::kByte) {
    const int64_t blocks2 = (blocks + q.blocksize2 - 1) / q.blocksize2;
    COLOSSAL_CHECK_INPUT(q.absmax2.defined() && q.absmax2.scalar_type() == at::kFloat &&
                             q.absmax2.is_contiguous() && q.absmax2.numel() == blocks2 &&
                             q.absmax2.device() == q.codes.device(),
                         "dequantize_nf4: double quantisation needs absmax2 fp32 [", blocks2,
                         "] on ", q.codes.device());
    COLOSSAL_CHECK_INPUT(
        q.dmap.defined() && q.dmap.scalar_type() == at::kFloat && q.dmap.numel() == 256 &&
            q.dmap.device() == q.codes.device(),
        "dequantize_nf4: double quantisation needs the dynamic map, fp32 [256] on ",
        q.codes.device());
  } else {
    COLOSSAL_CHECK_INPUT(q.absmax.scalar_type() == at::kFloat, "dequantize_nf4: absmax has dtype ",
                         q.absmax.scalar_type(), "; expected float (or uint8 codes)");
  }
}

void check_fp8(const at::Tensor& codes, const at::Tensor& scale, at::ScalarType dtype) {
  COLOSSAL_CHECK_INPUT(float_type(dtype), "dequantize_fp8_rows: output dtype ", dtype,
                       " is not float, bfloat16 or half");
  COLOSSAL_CHECK_INPUT(codes.defined() && codes.scalar_type() == at::kFloat8_e4m3fn &&
                           codes.dim() == 2 && codes.is_contiguous(),
                       "dequantize_fp8_rows: codes must be contiguous float8_e4m3fn [rows, cols]");
  COLOSSAL_CHECK_INPUT(scale.defined() && scale.scalar_type() == at::kFloat &&
                           scale.is_contiguous() && scale.numel() == codes.size(0) &&
                           scale.device() == codes.device(),
                       "dequantize_fp8_rows: scale must be contiguous fp32 [", codes.size(0),
                       "] on ", codes.device());
}

}  // namespace

at::Tensor dequantize_nf4_reference(const NF4View& q, at::ScalarType dtype) {
  check_nf4(q, dtype);
  at::Tensor absmax = q.absmax;
  if (absmax.scalar_type() == at::kByte) {
    const int64_t blocks = absmax.numel();
    at::Tensor v = q.dmap.index({absmax.to(at::kLong)});
    at::Tensor s = q.absmax2.repeat_interleave(q.blocksize2).narrow(0, 0, blocks);
    absmax = v * s + q.offset;
  }
  const auto& l = nf4_levels();
  at::Tensor levels =
      at::tensor(std::vector<float>(l.begin(), l.end()), at::kFloat).to(q.codes.device());
  at::Tensor hi = at::bitwise_right_shift(q.codes, 4), lo = at::bitwise_and(q.codes, 15);
  at::Tensor idx = at::stack({hi, lo}, 1).reshape(-1).narrow(0, 0, q.numel).to(at::kLong);
  at::Tensor scale = absmax.repeat_interleave(q.blocksize).narrow(0, 0, q.numel);
  return (levels.index({idx}) * scale).to(dtype);
}

at::Tensor dequantize_nf4(const NF4View& q, at::ScalarType dtype) {
  if (path_for(q.codes) != Path::Cuda) return dequantize_nf4_reference(q, dtype);
  check_nf4(q, dtype);
  at::Tensor out = at::empty({q.numel}, q.codes.options().dtype(dtype));
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(q.codes.device());
  const bool dq = q.absmax.scalar_type() == at::kByte;
  cuda::nf4_dequantize(q.codes.const_data_ptr<uint8_t>(),
                       dq ? nullptr : q.absmax.const_data_ptr<float>(),
                       dq ? q.absmax.const_data_ptr<uint8_t>() : nullptr,
                       dq ? q.absmax2.const_data_ptr<float>() : nullptr,
                       dq ? q.dmap.const_data_ptr<float>() : nullptr, q.offset, nf4_levels().data(),
                       out.mutable_data_ptr(), q.numel, q.blocksize, q.blocksize2,
                       cuda_dtype(dtype), stream_of(q.codes));
#endif
  return out;
}

at::Tensor dequantize_fp8_rows_reference(const at::Tensor& codes, const at::Tensor& scale,
                                         at::ScalarType dtype) {
  check_fp8(codes, scale, dtype);
  return (codes.to(at::kFloat) * scale.unsqueeze(1)).to(dtype);
}

at::Tensor dequantize_fp8_rows(const at::Tensor& codes, const at::Tensor& scale,
                               at::ScalarType dtype) {
  if (path_for(codes) != Path::Cuda) return dequantize_fp8_rows_reference(codes, scale, dtype);
  check_fp8(codes, scale, dtype);
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(dtype));
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(codes.device());
  cuda::fp8_rows_dequantize(static_cast<const uint8_t*>(codes.const_data_ptr()),
                            scale.const_data_ptr<float>(), out.mutable_data_ptr(), codes.size(0),
                            codes.size(1), cuda_dtype(dtype), stream_of(codes));
#endif
  return out;
}

}  // namespace colossal::kernels
