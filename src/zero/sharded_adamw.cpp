// The pieces of the sharded AdamW step shared by ZeRO-1/2 and Gemini: the device-side sum of
// squares before a host copy, the norm over shards, and the AdamW dispatch by shard place.
#include "colossal/zero/sharded_adamw.h"

#include "colossal/amp/grad_scaler.h"
#include "colossal/kernels/fused.h"
#include "colossal/optim/cpu_adam.h"

namespace colossal::zero {

at::Tensor copy_grad_to_host(at::Tensor dst, const at::Tensor& src,
                             const std::function<void(at::Tensor&, const at::Tensor&)>& copy) {
  // One pass over the gradient on the device (microseconds per shard) instead of one over the
  // host copy on the CPU in the norm.
  at::Tensor sq = src.is_cuda() ? amp::sum_of_squares({src}) : at::Tensor();
  if (copy) {
    copy(dst, src);
  } else {
    dst.copy_(src);
  }
  return sq;
}

void ShardedNorm::add(const at::Tensor& grad, const at::Tensor& grad_sq,
                      const std::vector<std::string>& replicated_over) {
  if (!replicated_over.empty() && !reducer_.counts(replicated_over)) return;
  if (grad_sq.defined()) {
    sums_.push_back(grad_sq);
  } else {
    grads_.push_back(grad);
  }
}

double ShardedNorm::global(double scale) const {
  return amp::global_grad_norm(grads_, scale, reducer_, sums_);
}

void AdamWBatch::add(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& working) {
  P.push_back(master);
  G.push_back(grad);
  M.push_back(exp_avg);
  V.push_back(exp_avg_sq);
  if (working.defined()) W.push_back(working);
}

void AdamWBatch::run(AdamWPath path, const optim::AdamWHyper& h, int64_t step,
                     double divisor) const {
  if (P.empty()) return;
  switch (path) {
    case AdamWPath::Fused: {
      kernels::fused_adamw(P, G, M, V, W, kernels::AdamWStep{h, step, divisor});
      break;
    }
    case AdamWPath::Host:
      optim::cpu_adam_update(P, G, M, V, step, h, divisor, W);
      break;
    case AdamWPath::Plain:
      optim::adamw_update(P, G, M, V, step, h, optim::AdamWImpl::Auto, divisor);
      break;
  }
}

optim::AdamWHyper hyper_of(const optim::GroupOptions& g) {
  return g;  // GroupOptions derives from the one hyper-parameter struct
}

}  // namespace colossal::zero
