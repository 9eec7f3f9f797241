// AdamW: the fused ATen kernel where it exists, else the same math as ATen _foreach_ ops
// (the order of operations of torch.optim.AdamW, so results match it).
#include "colossal/optim/adamw.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <map>
#include <tuple>

#include "colossal/core/error.h"
#include "colossal/kernels/adamw.h"

namespace colossal::optim {

bool fused_adamw_available(const at::Tensor& t) {
  auto dev = t.device().type();
  if (dev != at::kCPU && dev != at::kCUDA) return false;
  auto st = t.scalar_type();
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

namespace {

void check_lists(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v) {
  COLOSSAL_CHECK(
      grads.size() == params.size() && m.size() == params.size() && v.size() == params.size(),
      "adamw_update: list lengths differ (params ", params.size(), ", grads ", grads.size(),
      ", exp_avgs ", m.size(), ", exp_avg_sqs ", v.size(), ")");
  for (size_t i = 0; i < params.size(); ++i) {
    COLOSSAL_CHECK(grads[i].sizes() == params[i].sizes() && m[i].sizes() == params[i].sizes() &&
                       v[i].sizes() == params[i].sizes(),
                   "adamw_update: tensor ", i, " shapes differ: param ", params[i].sizes(),
                   ", grad ", grads[i].sizes(), ", exp_avg ", m[i].sizes(), ", exp_avg_sq ",
                   v[i].sizes());
  }
}

void foreach_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads_in,
                    const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v,
                    int64_t step, const AdamWHyper& h, double grad_divisor) {
  std::vector<at::Tensor> grads = grads_in;
  if (grad_divisor != 1.0) grads = at::_foreach_div(grads_in, grad_divisor);
  if (h.weight_decay != 0.0) at::_foreach_mul_(params, 1.0 - h.lr * h.weight_decay);
  at::_foreach_lerp_(m, grads, 1.0 - h.beta1);
  at::_foreach_mul_(v, h.beta2);
  at::_foreach_addcmul_(v, grads, grads, 1.0 - h.beta2);
  double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  double step_size = h.lr / bc1;
  double bc2_sqrt = std::sqrt(bc2);
  auto denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, bc2_sqrt);
  at::_foreach_add_(denom, h.eps);
  at::_foreach_addcdiv_(params, m, denom, -step_size);
}

void fused_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v, int64_t step,
                  const AdamWHyper& h, double grad_divisor) {
  // One kernel launch per (device, dtype) bucket; the step count travels as a float tensor.
  std::map<std::tuple<int, int, int>, std::vector<size_t>> buckets;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    COLOSSAL_CHECK(fused_adamw_available(p), "adamw_update: the fused kernel does not serve ",
                   p.device(), " ", p.scalar_type(), "; use AdamWImpl::ForEach or Auto");
    COLOSSAL_CHECK(grads[i].scalar_type() == p.scalar_type() &&
                       m[i].scalar_type() == p.scalar_type() &&
                       v[i].scalar_type() == p.scalar_type(),
                   "adamw_update (fused): tensor ", i,
                   " mixes dtypes; grads and states must match the param's ", p.scalar_type());
    buckets[{static_cast<int>(p.device().type()), p.device().index(),
             static_cast<int>(p.scalar_type())}]
        .push_back(i);
  }
  for (auto& [key, idx] : buckets) {
    std::vector<at::Tensor> P, G, M, V, S;
    auto dev = params[idx[0]].device();
    at::Tensor step_t =
        at::full({}, static_cast<double>(step), at::TensorOptions().dtype(at::kFloat).device(dev));
    for (size_t i : idx) {
      P.push_back(params[i]);
      G.push_back(grads[i]);
      M.push_back(m[i]);
      V.push_back(v[i]);
      S.push_back(step_t);
    }
    std::optional<at::Tensor> scale;
    if (grad_divisor != 1.0)
      scale = at::full({}, grad_divisor, at::TensorOptions().dtype(at::kFloat).device(dev));
    at::_fused_adamw_(P, G, M, V, {}, S, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                      /*amsgrad=*/false,
                      /*maximize=*/false, scale, std::nullopt);
  }
}

}  // namespace

void adamw_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs, int64_t step, const AdamWHyper& hyper,
                  AdamWImpl impl, double grad_divisor) {
  check_lists(params, grads, exp_avgs, exp_avg_sqs);
  COLOSSAL_CHECK(step >= 1, "adamw_update: step must be >= 1 (counted after increment), got ",
                 step);
  COLOSSAL_CHECK(grad_divisor > 0, "adamw_update: grad_divisor must be > 0, got ", grad_divisor);
  if (params.empty()) return;
  c10::NoGradGuard no_grad;
  bool fused = impl == AdamWImpl::Fused;
  if (impl == AdamWImpl::Auto) {
    fused = true;
    for (size_t i = 0; i < params.size(); ++i)
      fused = fused && fused_adamw_available(params[i]) &&
              grads[i].scalar_type() == params[i].scalar_type() &&
              exp_avgs[i].scalar_type() == params[i].scalar_type() &&
              exp_avg_sqs[i].scalar_type() == params[i].scalar_type();
  }
  if (fused)
    fused_update(params, grads, exp_avgs, exp_avg_sqs, step, hyper, grad_divisor);
  else
    foreach_update(params, grads, exp_avgs, exp_avg_sqs, step, hyper, grad_divisor);
}

void AdamW::update(const GroupOptions& g, std::vector<at::Tensor>& params,
                   std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) {
  const AdamWHyper& h = g;
  // Parameters that skipped steps (no grad) have their own step counts: one call per count.
  std::map<int64_t, std::vector<size_t>> by_step;
  for (size_t i = 0; i < params.size(); ++i) by_step[states[i]->step].push_back(i);
  for (auto& [step, idx] : by_step) {
    std::vector<at::Tensor> P, G, M, V;
    for (size_t i : idx) {
      P.push_back(params[i]);
      G.push_back(grads[i]);
      M.push_back(states[i]->tensors.at("exp_avg"));
      V.push_back(states[i]->tensors.at("exp_avg_sq"));
    }
    adamw_update(P, G, M, V, step, h, impl_, grad_divisor());
  }
}

bool AdamW::update_masters_fused(const GroupOptions& g, const std::vector<at::Tensor>& masters,
                                 const std::vector<at::Tensor>& grads,
                                 std::vector<ParamState*>& states,
                                 const std::vector<at::Tensor>& working) {
  if (impl_ == AdamWImpl::ForEach || !kernels::enabled()) return false;
  for (size_t i = 0; i < masters.size(); ++i)
    // CUDA only: on the CPU, ATen's vectorised fused AdamW (and CPU Adam for offload) is faster
    // than the scalar fused loop.
    if (!masters[i].is_cuda() || !kernels::has_fused_kernels(masters[i]) ||
        !masters[i].is_contiguous() || grads[i].device() != masters[i].device() ||
        working[i].device() != masters[i].device() || !working[i].is_contiguous() ||
        !grads[i].is_contiguous())
      return false;
  // One call per step count (parameters that skipped steps have their own).
  std::map<int64_t, std::vector<size_t>> by_step;
  for (size_t i = 0; i < masters.size(); ++i) by_step[states[i]->step].push_back(i);
  for (auto& [step, idx] : by_step) {
    std::vector<at::Tensor> P, G, M, V, W;
    for (size_t i : idx) {
      P.push_back(masters[i]);
      G.push_back(grads[i]);
      M.push_back(states[i]->tensors.at("exp_avg"));
      V.push_back(states[i]->tensors.at("exp_avg_sq"));
      W.push_back(working[i]);
    }
    kernels::fused_adamw(P, G, M, V, W, kernels::AdamWStep{g, step, grad_divisor()});
  }
  return true;
}

}  // namespace colossal::optim
