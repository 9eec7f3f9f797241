// Chunked linear + cross-entropy (see fused_ce.h). The forward chunk loop also produces the
// gradients, so backward only scales them by the incoming gradient and never sees logits.
#include "colossal/nn/fused_ce.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/layers.h"

namespace colossal::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels into the autograd function as a custom class (not a tensor argument).
struct VocabGroup : torch::CustomClassHolder {
  explicit VocabGroup(VocabParallel v) : vp(std::move(v)) {}
  VocabParallel vp;
};

// 1 / the number of counted targets as a device scalar (no host sync), or 1 / divisor.
at::Tensor inverse_count(const at::Tensor& valid, double divisor) {
  if (divisor > 0) return at::full({}, 1.0 / divisor, valid.options().dtype(at::kFloat));
  return valid.sum().to(at::kFloat).reciprocal();
}

struct FusedLinearCE : public torch::autograd::Function<FusedLinearCE> {
  // h [N, H], w [V, H], t [N] int64. Returns the fp32 scalar mean loss; saves dL/dh and dL/dw
  // (already divided by the number of counted tokens) for backward.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& t, int64_t chunk, int64_t ignore_index,
                            double divisor) {
    const bool need_h = h.requires_grad(), need_w = w.requires_grad();
    const int64_t n_tok = h.size(0);
    const at::ScalarType dtype = h.scalar_type();
    const bool fp32 = dtype == at::kFloat;
    // fp16: dlogits / count would underflow fp16 for long batches (the unfused path casts them
    // after the loss scale has made them large). Keep dlogits unscaled in fp16 and dW in fp32,
    // and apply 1/count together with the incoming gradient in backward.
    const bool defer = dtype == at::kHalf;
    at::Tensor valid = t != ignore_index;
    // 1 / number of counted tokens (or the caller's divisor), as a device scalar (no host
    // sync); inf when none counts.
    at::Tensor inv = inverse_count(valid, divisor);
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
    return {gh, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// In-place all-reduce over the group (the tensor is the caller's own temporary).
void all_reduce_(at::Tensor& t, const dist::Communicator& g, dist::ReduceOp op) {
  const_cast<dist::Communicator&>(g).all_reduce(t, op);
}

// FusedLinearCE over a vocabulary split across vp.group (fused_ce.h). Saves the same gradients
// for the same backward.
struct VocabParallelLinearCE : public torch::autograd::Function<VocabParallelLinearCE> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& t, int64_t chunk, int64_t ignore_index,
                            double divisor, const c10::intrusive_ptr<VocabGroup>& vg) {
    const VocabParallel& vp = vg->vp;
    const bool need_h = h.requires_grad(), need_w = w.requires_grad();
    const int64_t n_tok = h.size(0);
    const at::ScalarType dtype = h.scalar_type();
    const bool fp32 = dtype == at::kFloat;
    const bool defer = dtype == at::kHalf;  // as in FusedLinearCE
    // The real rows of this rank's shard (the rows past vocab_size are padding): the logits
    // are computed over them only, so padding never enters the softmax and gets no gradient.
    const int64_t rows = std::clamp<int64_t>(vp.vocab_size - vp.vocab_begin, 0, w.size(0));
    const at::Tensor wr = w.narrow(0, 0, rows);
    at::Tensor valid = t != ignore_index;
    at::Tensor owned = valid & (t >= vp.vocab_begin) & (t < vp.vocab_begin + rows);
    // Local target columns; -1 where the target is another rank's (or the row is ignored).
    at::Tensor local_t = at::where(owned, t - vp.vocab_begin, -1);
    at::Tensor inv = inverse_count(valid, divisor);
    at::Tensor loss_sum = at::zeros({}, h.options().dtype(at::kFloat));
    at::Tensor grad_h = need_h ? at::empty_like(h, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_w32 =
        need_w ? at::zeros(w.sizes(), w.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor grad_wr = need_w ? grad_w32.narrow(0, 0, rows) : at::Tensor();
    const bool kernels_on = use_fused_kernels(h);
    for (int64_t s = 0; s < n_tok; s += chunk) {
      const int64_t n = std::min(chunk, n_tok - s);
      at::Tensor hc = h.narrow(0, s, n);
      at::Tensor vf = valid.narrow(0, s, n).to(at::kFloat);
      at::Tensor tc = local_t.narrow(0, s, n);
      at::Tensor of = owned.narrow(0, s, n).to(at::kFloat);
      at::Tensor logits = at::mm(hc, wr.t());  // [n, rows] working dtype
      // Local statistics (max, sum of exp(x - max)), then the whole row's over the group.
      at::Tensor stats = kernels_on ? kernels::softmax_row_stats_(logits)
                                    : kernels::softmax_row_stats_reference_(logits);
      at::Tensor m = stats.select(1, 0).contiguous();
      all_reduce_(m, vp.group, dist::ReduceOp::Max);
      // The target logit (on its owner, 0 elsewhere) travels with the rescaled sums: one
      // all-reduce for both.
      at::Tensor target_logit =
          rows > 0 ? logits.gather(1, tc.clamp_min(0).unsqueeze(1)).squeeze(1).to(at::kFloat) * of
                   : at::zeros({n}, vf.options());
      at::Tensor local_m = stats.select(1, 0);
      at::Tensor scaled = at::where(local_m == -INFINITY, at::zeros_like(local_m),
                                    stats.select(1, 1) * (local_m - m).exp());
      at::Tensor sums = at::stack({scaled, target_logit}, 1);
      all_reduce_(sums, vp.group, dist::ReduceOp::Sum);
      at::Tensor lse = m + sums.select(1, 0).log();
      loss_sum.add_(((lse - sums.select(1, 1)) * vf).sum());
      if (!need_h && !need_w) continue;
      at::Tensor row_scale = defer ? vf : vf * inv;
      at::Tensor dl;
      if (kernels_on) {
        kernels::softmax_grad_given_lse_(logits, tc.contiguous(), lse.contiguous(),
                                         row_scale.contiguous());
        dl = logits;
      } else {
        // The composite computes in fp32 from the working-dtype logits (as FusedLinearCE).
        kernels::softmax_grad_given_lse_reference_(logits, tc, lse, row_scale);
        dl = logits;
      }
      logits = at::Tensor();
      if (need_h) {
        at::Tensor out = grad_h.narrow(0, s, n);
        if (rows > 0)
          at::mm_out(out, dl, wr);
        else
          out.zero_();  // no real rows here: this rank's partial sum is zero
      }
      if (!need_w || rows == 0) continue;
      if (fp32)
        grad_wr.addmm_(dl.t(), hc);
      else if (h.is_cuda())
        at::addmm_out(grad_wr, grad_wr, dl.t(), hc, at::kFloat);
      else
        grad_wr.add_(at::mm(dl.t(), hc));
    }
    at::Tensor grad_w = need_w && !fp32 && !defer ? grad_w32.to(w.scalar_type()) : grad_w32;
    ctx->save_for_backward({grad_h, grad_w, inv});
    ctx->saved_data["defer"] = defer;
    ctx->saved_data["wdtype"] = static_cast<int64_t>(w.scalar_type());
    return loss_sum * inv;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list g = FusedLinearCE::backward(ctx, std::move(grad_outputs));
    g.push_back(at::Tensor());
    return g;
  }
};

void check_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                  const at::Tensor& targets, const FusedCEOptions& opts) {
  COLOSSAL_CHECK(hidden.dim() >= 1 && weight.dim() == 2 && hidden.size(-1) == weight.size(1), op,
                 ": hidden [..., H] and weight [V, H] expected, got ", hidden.sizes(), " and ",
                 weight.sizes());
  COLOSSAL_CHECK(hidden.scalar_type() == weight.scalar_type(), op, ": hidden is ",
                 hidden.scalar_type(), " but weight is ", weight.scalar_type(),
                 "; cast one of them");
  COLOSSAL_CHECK(
      targets.scalar_type() == at::kLong && targets.numel() * hidden.size(-1) == hidden.numel(), op,
      ": targets must be int64 with hidden's leading shape ", hidden.sizes(), ", got ",
      targets.scalar_type(), " ", targets.sizes());
  COLOSSAL_CHECK(opts.chunk_tokens >= 0, op, ": chunk_tokens must be >= 0, got ",
                 opts.chunk_tokens);
  COLOSSAL_CHECK(std::isfinite(opts.divisor) && opts.divisor >= 0, op,
                 ": divisor must be finite and >= 0 (0: the mean), got ", opts.divisor);
}

}  // namespace

at::Tensor fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                      const at::Tensor& targets, const FusedCEOptions& opts) {
  check_inputs("fused_linear_cross_entropy", hidden, weight, targets, opts);
  at::Tensor h = hidden.reshape({-1, hidden.size(-1)});
  at::Tensor t = targets.reshape({-1}).to(h.device());
  const int64_t chunk =
      opts.chunk_tokens == 0 ? std::max<int64_t>(h.size(0), 1) : opts.chunk_tokens;
  return FusedLinearCE::apply(h, weight, t, chunk, opts.ignore_index, opts.divisor);
}

at::Tensor vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                               const at::Tensor& targets, const VocabParallel& vp,
                                               const FusedCEOptions& opts) {
  check_inputs("vocab_parallel_linear_cross_entropy", hidden, weight, targets, opts);
  COLOSSAL_CHECK(vp.group.valid(), "vocab_parallel_linear_cross_entropy: the group is not valid");
  COLOSSAL_CHECK(vp.vocab_begin >= 0 && vp.vocab_size > 0,
                 "vocab_parallel_linear_cross_entropy: vocab_begin ", vp.vocab_begin,
                 " and vocab_size ", vp.vocab_size, " are invalid");
  at::Tensor h = hidden.reshape({-1, hidden.size(-1)});
  at::Tensor t = targets.reshape({-1}).to(h.device());
  const int64_t chunk =
      opts.chunk_tokens == 0 ? std::max<int64_t>(h.size(0), 1) : opts.chunk_tokens;
  return VocabParallelLinearCE::apply(h, weight, t, chunk, opts.ignore_index, opts.divisor,
                                      c10::make_intrusive<VocabGroup>(vp));
}

}  // namespace colossal::nn
