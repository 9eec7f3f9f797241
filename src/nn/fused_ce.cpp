// Chunked linear + cross-entropy (see fused_ce.h). The forward chunk loop also produces the
// gradients, so backward only scales them by the incoming gradient and never sees logits.
#include "colossal/nn/fused_ce.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/layers.h"

namespace colossal::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FusedLinearCE : public torch::autograd::Function<FusedLinearCE> {
  // h [N, H], w [V, H], t [N] int64. Returns the fp32 scalar mean loss; saves dL/dh and dL/dw
  // (already divided by the number of counted tokens) for backward.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& t, int64_t chunk, int64_t ignore_index) {
    const bool need_h = h.requires_grad(), need_w = w.requires_grad();
    const int64_t n_tok = h.size(0);
    const at::ScalarType dtype = h.scalar_type();
    const bool fp32 = dtype == at::kFloat;
    // fp16: dlogits / count would underflow fp16 for long batches (the unfused path casts them
    // after the loss scale has made them large). Keep dlogits unscaled in fp16 and dW in fp32,
    // and apply 1/count together with the incoming gradient in backward.
    const bool defer = dtype == at::kHalf;
    at::Tensor valid = t != ignore_index;
    // 1 / number of counted tokens, as a device scalar (no host sync); inf when none counts.
    at::Tensor inv = valid.sum().to(at::kFloat).reciprocal();
    at::Tensor loss_sum = at::zeros({}, h.options().dtype(at::kFloat));
    at::Tensor grad_h = need_h ? at::empty_like(h, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_w32 =
        need_w ? at::zeros(w.sizes(), w.options().dtype(at::kFloat)) : at::Tensor();
    // One chunk's dL/dlogits dl [n, V] (working dtype) into dL/dh rows [s, s + n) and dL/dW.
    auto accumulate = [&](const at::Tensor& dl, const at::Tensor& hc, int64_t s, int64_t n) {
      if (need_h) {
        at::Tensor out = grad_h.narrow(0, s, n);
        at::mm_out(out, dl, w);
      }
      if (!need_w) return;
      if (fp32)
        grad_w32.addmm_(dl.t(), hc);
      else if (h.is_cuda())
        // cuBLAS accumulates the 16-bit product straight into the fp32 sum (beta = 1): no
        // 16-bit rounding of each chunk's product and no separate fp32 add pass.
        at::addmm_out(grad_w32, grad_w32, dl.t(), hc, at::kFloat);
      else
        grad_w32.add_(at::mm(dl.t(), hc));  // per-chunk product, fp32 accumulation
    };
    for (int64_t s = 0; s < n_tok; s += chunk) {
      const int64_t n = std::min(chunk, n_tok - s);
      at::Tensor hc = h.narrow(0, s, n);
      at::Tensor vc = valid.narrow(0, s, n);
      at::Tensor logits = at::mm(hc, w.t());  // [n, V] working dtype
      if ((need_h || need_w) && use_fused_kernels(logits)) {
        // One kernel: the row's loss and (softmax - onehot) * scale written over the logits,
        // in the working dtype (what the code below computes in several fp32 passes).
        at::Tensor rows = kernels::cross_entropy_grad_(logits, t.narrow(0, s, n), ignore_index,
                                                       defer ? at::Tensor() : inv);
        loss_sum.add_(rows.sum());
        accumulate(logits, hc, s, n);
        continue;
      }
      at::Tensor tc = at::where(vc, t.narrow(0, s, n), 0).unsqueeze(1);  // ignored rows -> 0
      if (!fp32) logits = logits.to(at::kFloat);
      // log-softmax in one pass (fp32), reused in place for the gradient.
      at::Tensor logp = at::log_softmax(logits, 1);
      logits = at::Tensor();
      loss_sum.sub_((logp.gather(1, tc).squeeze(1) * vc).sum());
      if (!need_h && !need_w) continue;
      // dloss/dlogits of the mean: (softmax - onehot) / count on counted rows, 0 elsewhere.
      at::Tensor vf = vc.to(at::kFloat).unsqueeze(1);
      logp.exp_();
      logp.scatter_add_(1, tc, -vf);
      logp.mul_(defer ? vf : vf * inv);
      at::Tensor dl = fp32 ? logp : logp.to(dtype);
      logp = at::Tensor();  // the fp32 chunk is not needed past this point
      accumulate(dl, hc, s, n);
    }
    at::Tensor grad_w = need_w && !fp32 && !defer ? grad_w32.to(w.scalar_type()) : grad_w32;
    ctx->save_for_backward({grad_h, grad_w, inv});
    ctx->saved_data["defer"] = defer;
    ctx->saved_data["wdtype"] = static_cast<int64_t>(w.scalar_type());
    return loss_sum * inv;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const bool defer = ctx->saved_data["defer"].toBool();
    const auto wdtype = static_cast<at::ScalarType>(ctx->saved_data["wdtype"].toInt());
    at::Tensor g = defer ? grad_outputs[0].to(at::kFloat) * saved[2] : grad_outputs[0];
    at::Tensor gh = saved[0].defined() ? saved[0] * g : at::Tensor();
    at::Tensor gw = saved[1].defined() ? (saved[1] * g).to(wdtype) : at::Tensor();
    return {gh, gw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& targets, const FusedCEOptions& opts) {
  COLOSSAL_CHECK(hidden.dim() >= 1 && weight.dim() == 2 && hidden.size(-1) == weight.size(1),
                 "fused_linear_cross_entropy: hidden [..., H] and weight [V, H] expected, got ",
                 hidden.sizes(), " and ", weight.sizes());
  COLOSSAL_CHECK(hidden.scalar_type() == weight.scalar_type(),
                 "fused_linear_cross_entropy: hidden is ", hidden.scalar_type(), " but weight is ",
                 weight.scalar_type(), "; cast one of them");
  COLOSSAL_CHECK(
      targets.scalar_type() == at::kLong && targets.numel() * hidden.size(-1) == hidden.numel(),
      "fused_linear_cross_entropy: targets must be int64 with hidden's leading shape ",
      hidden.sizes(), ", got ", targets.scalar_type(), " ", targets.sizes());
  COLOSSAL_CHECK(opts.chunk_tokens >= 0,
                 "fused_linear_cross_entropy: chunk_tokens must be >= 0, got ", opts.chunk_tokens);
  at::Tensor h = hidden.reshape({-1, hidden.size(-1)});
  at::Tensor t = targets.reshape({-1}).to(h.device());
  const int64_t chunk =
      opts.chunk_tokens == 0 ? std::max<int64_t>(h.size(0), 1) : opts.chunk_tokens;
  return FusedLinearCE::apply(h, weight, t, chunk, opts.ignore_index);
}

}  // namespace colossal::nn
