// Dispatch and argument checks of our attention kernels (kernels/attention.h); the sm_90a
// kernels are in src/kernels_sm90/ (compiled when the CUTLASS headers are present).
#include "colossal/kernels/attention.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "colossal/core/accelerator.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_SM90_KERNELS
COLOSSAL_REGISTER_CUDA_KERNEL("attention_sm90_fwd");
#endif

using namespace detail;

std::string own_attention_unsupported(const at::Tensor& q, const at::Tensor& k) {
#ifndef COLOSSAL_WITH_SM90_KERNELS
  (void)q;
  (void)k;
  return "this build has no sm_90a attention kernels (configure with the CUTLASS headers: "
         "scripts/fetch_cutlass.sh)";
#else
  if (!q.defined() || !q.is_cuda()) return "the tensors are not on a CUDA device";
  const auto devices = cuda_devices();
  const int idx = q.device().has_index() ? q.device().index() : 0;
  if (idx < 0 || idx >= static_cast<int>(devices.size())) return "the CUDA device is not visible";
  const auto& d = devices[static_cast<size_t>(idx)];
  if (d.major != 9 || d.minor != 0)
    return d.name + " has compute capability " + std::to_string(d.major) + "." +
           std::to_string(d.minor) + "; the kernels are built for 9.0 (sm_90a: H100, H200)";
  if (q.scalar_type() != at::kBFloat16 || (k.defined() && k.scalar_type() != at::kBFloat16))
    return std::string("dtype ") + c10::toString(q.scalar_type()) + " is not bfloat16";
  if (q.dim() != 3 || !cuda::attention_sm90_supported(q.size(2)))
    return "head dimension " + std::to_string(q.dim() == 3 ? q.size(2) : -1) + " is not 64 or 128";
  return "";
#endif
}

AttentionResult attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                                  double scale, const std::optional<at::Tensor>& out) {
  const char* op = "attention_forward";
  COLOSSAL_CHECK_INPUT(q.defined() && k.defined() && v.defined(), op,
                       ": q, k and v must be defined");
  COLOSSAL_CHECK_INPUT(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                       ": q, k and v must be [T, heads, D]; got ", q.sizes(), ", ", k.sizes(), ", ",
                       v.sizes());
  check_same(op, "k", k, "q", q);
  check_same(op, "v", v, "q", q);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  COLOSSAL_CHECK_INPUT(k.size(0) == T && v.size(0) == T && k.sizes() == v.sizes() && k.size(2) == D,
                       op, ": k and v must be [", T, ", kv_heads, ", D, "] alike; got ", k.sizes(),
                       " and ", v.sizes());
  COLOSSAL_CHECK_INPUT(Hkv > 0 && H % Hkv == 0, op, ": heads ", H,
                       " is not a multiple of kv_heads ", Hkv);
  COLOSSAL_CHECK_INPUT(
      cu_seqlens.defined() && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2 &&
          (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong),
      op, ": cu_seqlens must be int32 or int64 [sequences + 1]");
  const std::string why = own_attention_unsupported(q, k);
  COLOSSAL_CHECK_INPUT(why.empty(), op, ": ", why);
#ifdef COLOSSAL_WITH_SM90_KERNELS
  // Offsets checked on the host (one small copy): 0 first, T last, non-decreasing.
  const at::Tensor cu_host = cu_seqlens.to(at::kCPU, at::kLong);
  const int64_t* c = cu_host.const_data_ptr<int64_t>();
  const int64_t n = cu_host.numel() - 1;
  COLOSSAL_CHECK_INPUT(c[0] == 0 && c[n] == T, op,
                       ": cu_seqlens must start at 0 and end at T = ", T, "; got ", c[0], " and ",
                       c[n]);
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    COLOSSAL_CHECK_INPUT(c[i + 1] >= c[i], op, ": cu_seqlens decreases at ", i + 1, " (", c[i],
                         " then ", c[i + 1], ")");
    longest = std::max(longest, c[i + 1] - c[i]);
  }
  COLOSSAL_CHECK_INPUT(max_seqlen <= 0 || max_seqlen >= longest, op, ": max_seqlen ", max_seqlen,
                       " is shorter than sequence length ", longest);
  COLOSSAL_CHECK_INPUT(T < (int64_t(1) << 31), op, ": ", T, " tokens are too many for one call");
  auto check_layout = [&](const char* name, const at::Tensor& t) {
    COLOSSAL_CHECK_INPUT(t.stride(2) == 1 && t.stride(1) == D && t.stride(0) % 8 == 0 &&
                             reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0,
                         op, ": ", name,
                         " must have the head dimension contiguous, heads packed and 16-byte "
                         "aligned rows; got strides ",
                         t.strides());
  };
  // Views of a packed projection output are taken as they are; k and v share one row stride.
  auto packed = [&](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == D; };
  const at::Tensor qc = packed(q) ? q : q.contiguous();
  const bool kv_ok = packed(k) && packed(v) && k.stride(0) == v.stride(0);
  const at::Tensor kc = kv_ok ? k : k.contiguous();
  const at::Tensor vc = kv_ok ? v : v.contiguous();
  check_layout("q", qc);
  check_layout("k", kc);
  check_layout("v", vc);
  at::Tensor o;
  if (out) {
    o = *out;
    COLOSSAL_CHECK_INPUT(o.sizes() == q.sizes() && o.is_contiguous() &&
                             o.scalar_type() == q.scalar_type() && o.device() == q.device(),
                         op, ": out must be contiguous ", q.sizes(), " ", q.scalar_type(), " on ",
                         q.device());
  } else {
    o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  }
  at::Tensor lse = at::empty({H, T}, q.options().dtype(at::kFloat));
  const at::Tensor cu = cu_seqlens.to(q.device(), at::kInt).contiguous();
  const c10::DeviceGuard guard(q.device());
  cuda::AttentionFwdArgs a;
  a.q = qc.const_data_ptr();
  a.k = kc.const_data_ptr();
  a.v = vc.const_data_ptr();
  a.out = o.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.cu_seqlens = cu.const_data_ptr<int>();
  a.total = T;
  a.sequences = n;
  a.max_seqlen = longest;
  a.heads = H;
  a.kv_heads = Hkv;
  a.head_dim = D;
  a.q_row_stride = qc.stride(0);
  a.kv_row_stride = kc.stride(0);
  a.causal = causal;
  a.scale = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D));
  if (T > 0) cuda::attention_sm90_fwd(a, stream_of(q));
  return {o, lse};
#else
  (void)max_seqlen;
  (void)causal;
  (void)scale;
  (void)out;
  return {};
#endif
}

}  // namespace colossal::kernels
