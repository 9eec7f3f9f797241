// Fused kernels (kernels/fused.h): argument checks, the ATen reference composites, the device
// dispatch (CPU loops in cpu_kernels.cpp, CUDA kernels in cuda_kernels.cu, the reference on any
// other device) and the autograd functions whose backward is fused too.
#include "colossal/kernels/fused.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <tuple>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "kernels/cpu_kernels.h"
#ifdef COLOSSAL_WITH_CUDA
#include "kernels/cuda_kernels.h"
#endif

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("rms_norm");
COLOSSAL_REGISTER_CUDA_KERNEL("apply_rotary");
COLOSSAL_REGISTER_CUDA_KERNEL("swiglu");
COLOSSAL_REGISTER_CUDA_KERNEL("swiglu_packed");
COLOSSAL_REGISTER_CUDA_KERNEL("cross_entropy_grad");
COLOSSAL_REGISTER_CUDA_KERNEL("sum_squares");
COLOSSAL_REGISTER_CUDA_KERNEL("fused_adamw");
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Path { Cpu, Cuda, Reference };

Path path_for(const at::Tensor& t) {
  if (t.device().is_cpu()) return Path::Cpu;
#ifdef COLOSSAL_WITH_CUDA
  if (t.device().is_cuda() && torch_has_cuda()) return Path::Cuda;
#endif
  return Path::Reference;
}

bool float_type(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
}

void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  COLOSSAL_CHECK_INPUT(t.defined(), op, ": ", name, " is undefined");
  COLOSSAL_CHECK_INPUT(float_type(t.scalar_type()), op, ": ", name, " has dtype ", t.scalar_type(),
                       "; expected float, bfloat16 or half");
}

void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                const at::Tensor& ref) {
  COLOSSAL_CHECK_INPUT(t.defined(), op, ": ", name, " is undefined");
  COLOSSAL_CHECK_INPUT(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ",
                       t.scalar_type(), " but ", ref_name, " has ", ref.scalar_type());
  COLOSSAL_CHECK_INPUT(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
                       ref_name, " is on ", ref.device());
}

bool needs_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t->requires_grad()) return true;
  return false;
}

#ifdef COLOSSAL_WITH_CUDA
cuda::DType cuda_dtype(at::ScalarType st) {
  switch (st) {
    case at::kBFloat16:
      return cuda::DType::BF16;
    case at::kHalf:
      return cuda::DType::F16;
    default:
      return cuda::DType::F32;
  }
}
// The current stream of t's device (through c10's device-generic interface, so no CUDA
// headers are needed here).
cuda::Stream stream_of(const at::Tensor& t) {
  const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return static_cast<cuda::Stream>(s.native_handle());
}
#endif

at::Tensor unit_last(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

// ---- RMSNorm ----
void check_rms(const at::Tensor& x, const at::Tensor& w) {
  check_dtype("rms_norm", "x", x);
  COLOSSAL_CHECK_INPUT(x.dim() >= 1, "rms_norm: x must have at least one dimension");
  check_same("rms_norm", "weight", w, "x", x);
  COLOSSAL_CHECK_INPUT(w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm: weight has shape ",
                       w.sizes(), " but x's last dimension is ", x.size(-1));
}

#ifdef COLOSSAL_WITH_CUDA
// t itself when its data is 16-byte aligned, else an aligned copy (a fresh allocation).
at::Tensor aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 ? t : t.clone();
}
bool cuda_rms_ok(const at::Tensor& x) {
  return cuda::rms_norm_supported(x.size(-1), cuda_dtype(x.scalar_type())) &&
         x.numel() / std::max<int64_t>(1, x.size(-1)) < (int64_t(1) << 31);
}
#endif

// y and the fp32 rstd [rows] for contiguous x. With res (contiguous, x's shape) the row
// normalised is h = x + res, returned third (undefined without res).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_fwd(const at::Tensor& x, const at::Tensor& w,
                                                       double eps,
                                                       const at::Tensor& res = at::Tensor()) {
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor sum;
  if (path_for(x) == Path::Cpu) {
    // The CPU path is the composite's add (one ATen op) and the fused norm of its result.
    if (res.defined()) sum = at::add(x, res);
    cpu::rms_norm_fwd(res.defined() ? sum : x, w, y, rstd, eps);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    const at::Tensor xa = aligned16(x), wa = aligned16(w);
    at::Tensor ra;
    if (res.defined()) {
      ra = aligned16(res);
      sum = at::empty_like(x, at::MemoryFormat::Contiguous);
    }
    cuda::rms_norm_fwd(
        xa.const_data_ptr(), ra.defined() ? ra.const_data_ptr() : nullptr, wa.const_data_ptr(),
        y.mutable_data_ptr(), sum.defined() ? sum.mutable_data_ptr() : nullptr,
        rstd.mutable_data_ptr<float>(), rows, h, eps, cuda_dtype(x.scalar_type()), stream_of(x));
#endif
  }
  return {y, rstd, sum};
}

// dx (plus dres when given: the other gradient of a residual stream) and dweight.
std::pair<at::Tensor, at::Tensor> rms_bwd(const at::Tensor& dy, const at::Tensor& x,
                                          const at::Tensor& w, const at::Tensor& rstd,
                                          const at::Tensor& dres = at::Tensor()) {
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dw = at::empty_like(w, at::MemoryFormat::Contiguous);
  if (path_for(x) == Path::Cpu) {
    cpu::rms_norm_bwd(dy, x, w, rstd, dx, dw);
    if (dres.defined()) dx.add_(dres);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    at::Tensor part =
        at::empty({cuda::rms_norm_bwd_blocks(rows, h, cuda_dtype(x.scalar_type())), h},
                  x.options().dtype(at::kFloat));
    const at::Tensor dya = aligned16(dy), xa = aligned16(x), wa = aligned16(w);
    const at::Tensor dra = dres.defined() ? aligned16(dres) : at::Tensor();
    cuda::rms_norm_bwd(dya.const_data_ptr(), xa.const_data_ptr(), wa.const_data_ptr(),
                       rstd.const_data_ptr<float>(), dra.defined() ? dra.const_data_ptr() : nullptr,
                       dx.mutable_data_ptr(), part.mutable_data_ptr<float>(), dw.mutable_data_ptr(),
                       rows, h, cuda_dtype(x.scalar_type()), stream_of(x));
#endif
  }
  return {dx, dw};
}

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    at::Tensor xc = x.contiguous(), wc = w.contiguous();
    auto [y, rstd, unused] = rms_fwd(xc, wc, eps);
    ctx->save_for_backward({xc, wc, rstd});  // x, weight and the fp32 rstd only
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto [dx, dw] = rms_bwd(grad[0].contiguous(), saved[0], saved[1], saved[2]);
    return {dx, dw, at::Tensor()};
  }
};

// Outputs {h = x + r, y = rms_norm(h)}; h's gradient and the norm's input gradient are summed
// in the backward kernel and given to both x and r.
struct AddRmsNormFn : torch::autograd::Function<AddRmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& r,
                               const at::Tensor& w, double eps) {
    at::Tensor wc = w.contiguous();
    auto [y, rstd, h] = rms_fwd(x.contiguous(), wc, eps, r.contiguous());
    ctx->save_for_backward({h, wc, rstd});
    return {h, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &dh = grad[0], &dy = grad[1];
    if (!dy.defined()) return {dh, dh, at::Tensor(), at::Tensor()};
    auto [dx, dw] = rms_bwd(dy.contiguous(), saved[0], saved[1], saved[2],
                            dh.defined() ? dh.contiguous() : at::Tensor());
    return {dx, dx, dw, at::Tensor()};
  }
};

// ---- Rotary ----
// cos/sin of [B or 1, S, D] -> [B, S, D] views with a unit last stride.
at::Tensor rotary_table(const at::Tensor& t, const at::Tensor& x, const char* name) {
  check_same("apply_rotary", name, t, "x", x);
  const int64_t b = x.size(0), s = x.size(2), d = x.size(3);
  COLOSSAL_CHECK_INPUT(
      t.dim() == 3 && (t.size(0) == b || t.size(0) == 1) && t.size(1) == s && t.size(2) == d,
      "apply_rotary: ", name, " has shape ", t.sizes(), "; expected [", b, ", ", s, ", ", d,
      "] for x of shape ", x.sizes());
  return unit_last(t).expand({b, s, d});
}

void check_rotary(const at::Tensor& x) {
  check_dtype("apply_rotary", "x", x);
  COLOSSAL_CHECK_INPUT(x.dim() == 4, "apply_rotary: x must be [B, heads, S, D], got ", x.sizes());
  COLOSSAL_CHECK_INPUT(x.size(3) % 2 == 0, "apply_rotary: head dim ", x.size(3), " must be even");
}

// The rotation (or its transpose) of x [B, h, S, D] into a new [B, S, h, D]-contiguous tensor,
// returned as the [B, h, S, D] view.
at::Tensor rotary_out(const at::Tensor& xin, const at::Tensor& cos, const at::Tensor& sin,
                      bool backward) {
  at::Tensor x = unit_last(xin);
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  at::Tensor y = at::empty({b, s, h, d}, x.options()).transpose(1, 2);
  if (path_for(x) == Path::Cpu) {
    cpu::rotary(x, cos, sin, y, backward);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    cuda::RotaryShape sh{
        b, h, s, d, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1)};
    // cos and sin share one stride set: make them both contiguous when they differ.
    at::Tensor c = cos, sn = sin;
    if (cos.strides() != sin.strides()) {
      c = cos.contiguous();
      sn = sin.contiguous();
      sh.cb = c.stride(0);
      sh.cs = c.stride(1);
    }
    cuda::rotary(x.const_data_ptr(), c.const_data_ptr(), sn.const_data_ptr(), y.mutable_data_ptr(),
                 sh, backward, cuda_dtype(x.scalar_type()), stream_of(x));
#endif
  }
  return y;
}

struct RotaryFn : torch::autograd::Function<RotaryFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary_out(x, cos, sin, false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    return {rotary_out(grad[0], saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

// ---- SwiGLU ----
void check_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check_dtype("swiglu", "gate", gate);
  check_same("swiglu", "up", up, "gate", gate);
  COLOSSAL_CHECK_INPUT(gate.sizes() == up.sizes(), "swiglu: up has shape ", up.sizes(),
                       " but gate has ", gate.sizes());
}

at::Tensor swiglu_fwd(const at::Tensor& g, const at::Tensor& u) {
  at::Tensor y = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (path_for(g) == Path::Cpu) {
    cpu::swiglu_fwd(g, u, y);
  } else {
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(g.device());
    cuda::swiglu_fwd(g.const_data_ptr(), u.const_data_ptr(), y.mutable_data_ptr(), g.numel(),
                     cuda_dtype(g.scalar_type()), stream_of(g));
#endif
  }
  return y;
}

struct SwiGLUFn : torch::autograd::Function<SwiGLUFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    at::Tensor g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return swiglu_fwd(g, u);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    at::Tensor dy = grad[0].contiguous();
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    if (path_for(g) == Path::Cpu) {
      cpu::swiglu_bwd(dy, g, u, dg, du);
    } else {
#ifdef COLOSSAL_WITH_CUDA
      c10::DeviceGuard guard(g.device());
      cuda::swiglu_bwd(dy.const_data_ptr(), g.const_data_ptr(), u.const_data_ptr(),
                       dg.mutable_data_ptr(), du.mutable_data_ptr(), g.numel(),
                       cuda_dtype(g.scalar_type()), stream_of(g));
#endif
    }
    return {dg, du};
  }
};

// ---- Packed SwiGLU ----
void check_swiglu_packed(const at::Tensor& gu) {
  check_dtype("swiglu_packed", "gu", gu);
  COLOSSAL_CHECK_INPUT(gu.dim() >= 1 && gu.size(-1) % 2 == 0,
                       "swiglu_packed: gu must be [..., 2F] (gate then up), got ", gu.sizes());
}

// y = silu(gate) * up for a contiguous packed gu [.., 2F].
at::Tensor swiglu_packed_fwd(const at::Tensor& gu) {
  const int64_t f = gu.size(-1) / 2;
  if (path_for(gu) == Path::Cpu)
    return swiglu_fwd(gu.narrow(-1, 0, f).contiguous(), gu.narrow(-1, f, f).contiguous());
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() = f;
  at::Tensor y = at::empty(shape, gu.options());
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(gu.device());
  cuda::swiglu_packed_fwd(gu.const_data_ptr(), y.mutable_data_ptr(), f == 0 ? 0 : y.numel() / f, f,
                          cuda_dtype(gu.scalar_type()), stream_of(gu));
#endif
  return y;
}

struct SwiGLUPackedFn : torch::autograd::Function<SwiGLUPackedFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gu_in) {
    at::Tensor gu = gu_in.contiguous();
    ctx->save_for_backward({gu});
    return swiglu_packed_fwd(gu);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined()) return {at::Tensor()};
    const at::Tensor& gu = saved[0];
    const int64_t f = gu.size(-1) / 2;
    at::Tensor dy = grad[0].contiguous();
    if (path_for(gu) == Path::Cpu) {
      at::Tensor g = gu.narrow(-1, 0, f).contiguous(), u = gu.narrow(-1, f, f).contiguous();
      at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
      cpu::swiglu_bwd(dy, g, u, dg, du);
      return {at::cat({dg, du}, -1)};
    }
    at::Tensor dgu = at::empty_like(gu);
#ifdef COLOSSAL_WITH_CUDA
    c10::DeviceGuard guard(gu.device());
    cuda::swiglu_packed_bwd(dy.const_data_ptr(), gu.const_data_ptr(), dgu.mutable_data_ptr(),
                            f == 0 ? 0 : dy.numel() / f, f, cuda_dtype(gu.scalar_type()),
                            stream_of(gu));
#endif
    return {dgu};
  }
};

// ---- Concatenated linear ----
void check_linear_concat(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& biases) {
  COLOSSAL_CHECK_INPUT(x.defined() && x.dim() >= 1, "linear_concat: x must be [..., in]");
  COLOSSAL_CHECK_INPUT(!weights.empty(), "linear_concat: no weights");
  COLOSSAL_CHECK_INPUT(biases.empty() || biases.size() == weights.size(),
                       "linear_concat: ", biases.size(), " biases for ", weights.size(),
                       " weights (give all or none)");
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string name = "weights[" + std::to_string(i) + "]";
    check_same("linear_concat", name.c_str(), weights[i], "x", x);
    COLOSSAL_CHECK_INPUT(weights[i].dim() == 2 && weights[i].size(1) == x.size(-1),
                         "linear_concat: ", name, " has shape ", weights[i].sizes(),
                         "; expected [out, ", x.size(-1), "] for x of shape ", x.sizes());
    if (!biases.empty()) {
      const std::string bname = "biases[" + std::to_string(i) + "]";
      check_same("linear_concat", bname.c_str(), biases[i], "x", x);
      COLOSSAL_CHECK_INPUT(biases[i].dim() == 1 && biases[i].size(0) == weights[i].size(0),
                           "linear_concat: ", bname, " has shape ", biases[i].sizes(),
                           "; expected [", weights[i].size(0), "]");
    }
  }
}

// Two ways to run it, chosen per call by the weights' shapes (LinearConcatFn::use_cat):
//  - cat: one GEMM against cat(weights), rebuilt in backward (never saved). Pays 2 reads and 2
//    writes of the weights per step; wins when some weight is thin (GQA k/v: 256 rows at 1b),
//    where separate GEMMs run far below the matrix-rate ceiling.
//  - slices: one GEMM per weight writing its column block of the output in place (cuBLAS takes
//    the row stride), dx accumulated by beta = 1 GEMMs; no weight copies (at 7b the cat would
//    move ~1 GB per layer and step).
struct LinearConcatFn : torch::autograd::Function<LinearConcatFn> {
  static constexpr int64_t kThinRows = 1024;
  static bool use_cat(at::TensorList weights) {
    for (const auto& w : weights)
      if (w.size(0) < kThinRows) return true;
    return false;
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList weights,
                            at::TensorList biases) {
    std::vector<at::Tensor> save{x};
    save.insert(save.end(), weights.begin(), weights.end());
    ctx->save_for_backward(save);
    ctx->saved_data["biases"] = static_cast<int64_t>(biases.size());
    if (use_cat(weights)) {
      at::Tensor w = at::cat(weights, 0);
      return biases.empty() ? at::linear(x, w) : at::linear(x, w, at::cat(biases, 0));
    }
    int64_t total = 0;
    for (const auto& w : weights) total += w.size(0);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = total;
    at::Tensor y = at::empty(shape, x.options());
    at::Tensor y2 = y.view({-1, total}), x2 = x.reshape({-1, x.size(-1)});
    int64_t off = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      at::Tensor block = y2.narrow(1, off, weights[i].size(0));
      if (biases.empty())
        at::mm_out(block, x2, weights[i].t());
      else
        at::addmm_out(block, biases[i], x2, weights[i].t());
      off += weights[i].size(0);
    }
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const size_t nw = saved.size() - 1;
    const auto nb = static_cast<size_t>(ctx->saved_data["biases"].toInt());
    variable_list out(1 + nw + nb);
    if (!grad[0].defined()) return out;
    const at::Tensor& x = saved[0];
    std::vector<at::Tensor> ws(saved.begin() + 1, saved.end());
    std::vector<int64_t> rows;
    for (const auto& w : ws) rows.push_back(w.size(0));
    const int64_t in = x.size(-1), total = grad[0].size(-1);
    at::Tensor dy = grad[0].reshape({-1, total});
    at::Tensor x2 = x.reshape({-1, in});
    bool any_w = false;
    for (size_t i = 0; i < nw; ++i) any_w = any_w || ctx->needs_input_grad(1 + i);
    if (use_cat(ws)) {
      if (ctx->needs_input_grad(0)) out[0] = at::mm(dy, at::cat(ws, 0)).view(x.sizes());
      if (any_w) {
        // One GEMM for every weight's gradient; each is a row block (contiguous) of it.
        std::vector<at::Tensor> dws = at::mm(dy.t(), x2).split_with_sizes(rows, 0);
        for (size_t i = 0; i < nw; ++i)
          if (ctx->needs_input_grad(1 + i)) out[1 + i] = dws[i];
      }
    } else {
      std::vector<at::Tensor> dys = dy.split_with_sizes(rows, 1);  // column blocks, no copies
      if (ctx->needs_input_grad(0)) {
        at::Tensor dx = at::mm(dys[0], ws[0]);
        for (size_t i = 1; i < nw; ++i) dx.addmm_(dys[i], ws[i]);  // cuBLAS beta = 1
        out[0] = dx.view(x.sizes());
      }
      for (size_t i = 0; i < nw; ++i)
        if (ctx->needs_input_grad(1 + i)) out[1 + i] = at::mm(dys[i].t(), x2);
    }
    if (nb > 0) {
      std::vector<at::Tensor> dbs = dy.sum(0).split_with_sizes(rows, 0);
      for (size_t i = 0; i < nb; ++i)
        if (ctx->needs_input_grad(1 + nw + i)) out[1 + nw + i] = dbs[i];
    }
    return out;
  }
};

}  // namespace

bool has_fused_kernels(const at::Tensor& t) {
  return path_for(t) != Path::Reference;
}

// ---- RMSNorm ----
namespace {
// Whether x's rows run our kernels: a device that has them, and on CUDA rows the
// register-resident kernels cover.
bool rms_fused(const at::Tensor& x) {
  if (!has_fused_kernels(x)) return false;
#ifdef COLOSSAL_WITH_CUDA
  if (path_for(x) == Path::Cuda) return cuda_rms_ok(x);
#endif
  return true;
}
}  // namespace

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(var + eps);
  return weight * h.to(x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms(x, weight);
  if (!rms_fused(x)) return rms_norm_reference(x, weight, eps);
  if (needs_grad({&x, &weight})) return RmsNormFn::apply(x, weight, eps);
  return std::get<0>(rms_fwd(x.contiguous(), weight.contiguous(), eps));
}

// ---- Residual add + RMSNorm ----
std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& x, const at::Tensor& r,
                                                         const at::Tensor& weight, double eps) {
  at::Tensor h = x + r;
  return {h, rms_norm_reference(h, weight, eps)};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                               const at::Tensor& weight, double eps) {
  check_rms(x, weight);
  check_dtype("add_rms_norm", "r", r);
  COLOSSAL_CHECK_INPUT(
      r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.device() == x.device(),
      "add_rms_norm: r is ", r.scalar_type(), " ", r.sizes(), " on ", r.device(), "; x is ",
      x.scalar_type(), " ", x.sizes(), " on ", x.device());
  if (!rms_fused(x)) return add_rms_norm_reference(x, r, weight, eps);
  if (needs_grad({&x, &r, &weight})) {
    variable_list out = AddRmsNormFn::apply(x, r, weight, eps);
    return {out[0], out[1]};
  }
  auto [y, rstd, h] = rms_fwd(x.contiguous(), weight.contiguous(), eps, r.contiguous());
  return {h, y};
}

// ---- Rotary ----
at::Tensor apply_rotary_reference(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const int64_t half = x.size(-1) / 2;
  at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rot * s;
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(x);
  at::Tensor c = rotary_table(cos, x, "cos"), s = rotary_table(sin, x, "sin");
  // Gradients for cos/sin are not fused: the composite computes them when asked for.
  if (!has_fused_kernels(x) || needs_grad({&cos, &sin})) return apply_rotary_reference(x, cos, sin);
  if (needs_grad({&x})) return RotaryFn::apply(x, c, s);
  return rotary_out(x, c, s, false);
}

// ---- SwiGLU ----
at::Tensor swiglu_reference(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu(gate, up);
  if (!has_fused_kernels(gate)) return swiglu_reference(gate, up);
  if (needs_grad({&gate, &up})) return SwiGLUFn::apply(gate, up);
  return swiglu_fwd(gate.contiguous(), up.contiguous());
}

// ---- Packed SwiGLU ----
at::Tensor swiglu_packed_reference(const at::Tensor& gu) {
  const int64_t f = gu.size(-1) / 2;
  return at::silu(gu.narrow(-1, 0, f)) * gu.narrow(-1, f, f);
}

at::Tensor swiglu_packed(const at::Tensor& gu) {
  check_swiglu_packed(gu);
  if (!has_fused_kernels(gu)) return swiglu_packed_reference(gu);
  if (needs_grad({&gu})) return SwiGLUPackedFn::apply(gu);
  return swiglu_packed_fwd(gu.contiguous());
}

// ---- Concatenated linear ----
at::Tensor linear_concat_reference(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<at::Tensor>& biases) {
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < weights.size(); ++i)
    ys.push_back(biases.empty() ? at::linear(x, weights[i]) : at::linear(x, weights[i], biases[i]));
  return at::cat(ys, -1);
}

at::Tensor linear_concat(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& biases) {
  check_linear_concat(x, weights, biases);
  return LinearConcatFn::apply(x, at::TensorList(weights), at::TensorList(biases));
}

// ---- Sum of squares ----
at::Tensor sum_squares_reference(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return at::zeros({}, at::kDouble);
  return at::stack(at::_foreach_norm(tensors, 2, at::kDouble)).square().sum();
}

at::Tensor sum_squares(const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "tensors[" + std::to_string(i) + "]";
    check_dtype("sum_squares", name.c_str(), tensors[i]);
    COLOSSAL_CHECK_INPUT(tensors[i].device() == tensors[0].device(), "sum_squares: ", name,
                         " is on ", tensors[i].device(), " but tensors[0] is on ",
                         tensors[0].device());
  }
  if (tensors.empty() || path_for(tensors[0]) != Path::Cuda) return sum_squares_reference(tensors);
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(tensors[0].device());
  std::vector<at::Tensor> keep;  // contiguous copies of strided inputs, alive until launched
  std::vector<at::Tensor> parts;
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    std::vector<const void*> ptrs;
    std::vector<int64_t> numels;
    for (const auto& t : tensors) {
      if (t.scalar_type() != st || t.numel() == 0) continue;
      at::Tensor c = t.contiguous();
      keep.push_back(c);
      ptrs.push_back(c.const_data_ptr());
      numels.push_back(c.numel());
    }
    if (ptrs.empty()) continue;
    const int count = static_cast<int>(ptrs.size());
    at::Tensor partials = at::empty({cuda::sum_squares_blocks(numels.data(), count)},
                                    tensors[0].options().dtype(at::kFloat));
    cuda::sum_squares(ptrs.data(), numels.data(), count, cuda_dtype(st),
                      partials.mutable_data_ptr<float>(), stream_of(tensors[0]));
    parts.push_back(partials.sum(0, false, at::kDouble));
  }
  if (parts.empty()) return at::zeros({}, tensors[0].options().dtype(at::kDouble));
  at::Tensor total = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) total = total + parts[i];
  return total;
#else
  return sum_squares_reference(tensors);
#endif
}

// ---- Softmax cross-entropy gradient ----
namespace {
void check_xent(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& scale) {
  check_dtype("cross_entropy_grad_", "logits", logits);
  COLOSSAL_CHECK_INPUT(logits.dim() == 2 && logits.is_contiguous(),
                       "cross_entropy_grad_: logits must be a contiguous [n, V] tensor, got ",
                       logits.sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
  COLOSSAL_CHECK_INPUT(targets.defined() && targets.scalar_type() == at::kLong &&
                           targets.dim() == 1 && targets.size(0) == logits.size(0),
                       "cross_entropy_grad_: targets must be int64 [", logits.size(0), "], got ",
                       targets.defined() ? targets.sizes() : at::IntArrayRef{});
  COLOSSAL_CHECK_INPUT(targets.device() == logits.device(), "cross_entropy_grad_: targets is on ",
                       targets.device(), " but logits is on ", logits.device());
  if (scale.defined())
    COLOSSAL_CHECK_INPUT(scale.numel() == 1 && scale.scalar_type() == at::kFloat &&
                             scale.device() == logits.device(),
                         "cross_entropy_grad_: scale must be one fp32 element on ", logits.device(),
                         ", got ", scale.scalar_type(), " ", scale.sizes(), " on ", scale.device());
}
}  // namespace

at::Tensor cross_entropy_grad_reference_(at::Tensor& logits, const at::Tensor& targets,
                                         int64_t ignore_index, const at::Tensor& scale) {
  at::Tensor valid = targets != ignore_index;
  at::Tensor tc = at::where(valid, targets, 0).unsqueeze(1);
  at::Tensor logp = at::log_softmax(logits.to(at::kFloat), 1);
  at::Tensor loss = -logp.gather(1, tc).squeeze(1) * valid;
  at::Tensor vf = valid.to(at::kFloat).unsqueeze(1);
  logp.exp_();
  logp.scatter_add_(1, tc, -vf);
  logp.mul_(scale.defined() ? vf * scale : vf);
  logits.copy_(logp);
  return loss;
}

at::Tensor cross_entropy_grad_(at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                               const at::Tensor& scale) {
  check_xent(logits, targets, scale);
  const Path path = path_for(logits);
  if (path == Path::Reference)
    return cross_entropy_grad_reference_(logits, targets, ignore_index, scale);
  at::Tensor loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  if (path == Path::Cpu) {
    const int64_t V = logits.size(1);
    at::Tensor bad = (targets != ignore_index) & ((targets < 0) | (targets >= V));
    COLOSSAL_CHECK_INPUT(!bad.any().item<bool>(), "cross_entropy_grad_: a target is outside [0, ",
                         V, ") (and not ignore_index ", ignore_index, ")");
    cpu::cross_entropy_grad(logits, targets, loss, scale.defined() ? scale.item<float>() : 1.f,
                            ignore_index);
    return loss;
  }
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(logits.device());
  cuda::cross_entropy_grad(
      logits.mutable_data_ptr(), targets.const_data_ptr<int64_t>(), loss.mutable_data_ptr<float>(),
      scale.defined() ? scale.const_data_ptr<float>() : nullptr, logits.size(0), logits.size(1),
      ignore_index, cuda_dtype(logits.scalar_type()), stream_of(logits));
#endif
  return loss;
}

// ---- AdamW ----
namespace {
void check_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& working,
                 const AdamWStep& hy) {
  const size_t n = params.size();
  COLOSSAL_CHECK_INPUT(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                       "fused_adamw: list lengths differ: params ", n, ", grads ", grads.size(),
                       ", exp_avgs ", exp_avgs.size(), ", exp_avg_sqs ", exp_avg_sqs.size());
  COLOSSAL_CHECK_INPUT(working.empty() || working.size() == n, "fused_adamw: working has ",
                       working.size(), " tensors; expected none or ", n);
  COLOSSAL_CHECK_INPUT(hy.step >= 1, "fused_adamw: step must be >= 1, got ", hy.step);
  COLOSSAL_CHECK_INPUT(hy.grad_divisor != 0.0 && std::isfinite(hy.grad_divisor),
                       "fused_adamw: grad_divisor must be finite and non-zero, got ",
                       hy.grad_divisor);
  if (n == 0) return;
  COLOSSAL_CHECK_INPUT(params[0].defined(), "fused_adamw: params[0] is undefined");
  const c10::Device dev = params[0].device();
  auto check_state = [&](const at::Tensor& t, const char* list, size_t i, const at::Tensor& p) {
    COLOSSAL_CHECK_INPUT(t.defined(), "fused_adamw: ", list, "[", i, "] is undefined");
    COLOSSAL_CHECK_INPUT(t.device() == dev, "fused_adamw: ", list, "[", i, "] is on ", t.device(),
                         " but params[0] is on ", dev);
    COLOSSAL_CHECK_INPUT(t.sizes() == p.sizes(), "fused_adamw: ", list, "[", i, "] has shape ",
                         t.sizes(), " but params[", i, "] has ", p.sizes());
  };
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    COLOSSAL_CHECK_INPUT(p.defined(), "fused_adamw: params[", i, "] is undefined");
    check_state(p, "params", i, p);
    COLOSSAL_CHECK_INPUT(p.scalar_type() == at::kFloat && p.is_contiguous(), "fused_adamw: params[",
                         i,
                         "] must be contiguous float32 (master "
                         "weights), got ",
                         p.scalar_type());
    check_state(exp_avgs[i], "exp_avgs", i, p);
    check_state(exp_avg_sqs[i], "exp_avg_sqs", i, p);
    for (const at::Tensor* st : {&exp_avgs[i], &exp_avg_sqs[i]})
      COLOSSAL_CHECK_INPUT(st->scalar_type() == at::kFloat && st->is_contiguous(),
                           "fused_adamw: ", st == &exp_avgs[i] ? "exp_avgs[" : "exp_avg_sqs[", i,
                           "] must be contiguous float32, got ", st->scalar_type());
    check_state(grads[i], "grads", i, p);
    COLOSSAL_CHECK_INPUT(float_type(grads[i].scalar_type()), "fused_adamw: grads[", i,
                         "] has dtype ", grads[i].scalar_type(),
                         "; expected float, bfloat16 or half");
    if (!working.empty()) {
      check_state(working[i], "working", i, p);
      COLOSSAL_CHECK_INPUT(float_type(working[i].scalar_type()) && working[i].is_contiguous(),
                           "fused_adamw: working[", i,
                           "] must be contiguous bfloat16, half or float, got ",
                           working[i].scalar_type());
    }
  }
}
}  // namespace

void fused_adamw_reference(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& working, const AdamWStep& hy) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, working, hy);
  if (params.empty()) return;
  at::NoGradGuard ng;
  std::vector<at::Tensor> g;
  g.reserve(grads.size());
  for (const at::Tensor& t : grads) {
    at::Tensor f = t.to(at::kFloat);
    g.push_back(hy.grad_divisor != 1.0 ? f / hy.grad_divisor : f);
  }
  if (hy.weight_decay != 0) at::_foreach_mul_(params, 1 - hy.lr * hy.weight_decay);
  at::_foreach_lerp_(exp_avgs, g, 1 - hy.beta1);
  at::_foreach_mul_(exp_avg_sqs, hy.beta2);
  at::_foreach_addcmul_(exp_avg_sqs, g, g, 1 - hy.beta2);
  const double step = static_cast<double>(hy.step);
  const double bc1 = 1 - std::pow(hy.beta1, step), bc2 = 1 - std::pow(hy.beta2, step);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(exp_avg_sqs);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, hy.eps);
  at::_foreach_addcdiv_(params, exp_avgs, denom, -hy.lr / bc1);
  for (size_t i = 0; i < working.size(); ++i) working[i].copy_(params[i]);
}

void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& working,
                 const AdamWStep& hy) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, working, hy);
  if (params.empty()) return;
  const Path path = path_for(params[0]);
  if (path == Path::Reference) {
    fused_adamw_reference(params, grads, exp_avgs, exp_avg_sqs, working, hy);
    return;
  }
  at::NoGradGuard ng;
  const size_t n = params.size();
  if (path == Path::Cpu) {
    for (size_t i = 0; i < n; ++i)
      cpu::adamw(params[i], grads[i].contiguous(), exp_avgs[i], exp_avg_sqs[i],
                 working.empty() ? at::Tensor() : working[i], hy);
    return;
  }
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(params[0].device());
  const cuda::Stream stream = stream_of(params[0]);
  const cuda::AdamWHyper h{hy.lr,           hy.beta1,        hy.beta2, hy.eps,
                           hy.weight_decay, hy.grad_divisor, hy.step};
  std::vector<at::Tensor> keep;  // contiguous copies of strided grads live until launched
  std::vector<cuda::AdamWTensor> run;
  cuda::DType gdt = cuda::DType::F32, wdt = cuda::DType::F32;
  auto flush = [&] {
    if (!run.empty()) cuda::adamw(run.data(), static_cast<int>(run.size()), gdt, wdt, h, stream);
    run.clear();
  };
  for (size_t i = 0; i < n; ++i) {
    at::Tensor g = grads[i].is_contiguous() ? grads[i] : keep.emplace_back(grads[i].contiguous());
    const cuda::DType g_dt = cuda_dtype(g.scalar_type());
    const cuda::DType w_dt =
        working.empty() ? cuda::DType::F32 : cuda_dtype(working[i].scalar_type());
    if (!run.empty() && (g_dt != gdt || w_dt != wdt)) flush();  // one launch per dtype group
    gdt = g_dt;
    wdt = w_dt;
    if (params[i].numel() == 0) continue;
    run.push_back({params[i].mutable_data_ptr<float>(), exp_avgs[i].mutable_data_ptr<float>(),
                   exp_avg_sqs[i].mutable_data_ptr<float>(), g.const_data_ptr(),
                   working.empty() ? nullptr : working[i].mutable_data_ptr(), params[i].numel()});
  }
  flush();
#endif
}

}  // namespace colossal::kernels
