#include "colossal/booster/wrappers.h"

#include <ATen/ATen.h>

#include <cmath>

#include "colossal/amp/grad_scaler.h"
#include "colossal/booster/step_overlap.h"
#include "colossal/core/logging.h"
#include "colossal/core/weights_epoch.h"
#include "colossal/optim/optimizer.h"

namespace colossal::booster {

OptimizerWrapper::OptimizerWrapper(std::shared_ptr<optim::Optimizer> optimizer, Precision precision,
                                   const LossScaleOptions& ls, amp::GradReducer reducer)
    : optimizer_(std::move(optimizer)), precision_(precision), reducer_(std::move(reducer)) {
  if (precision_ == Precision::FP16) {
    scaler_ = std::make_unique<amp::DynamicGradScaler>(ls);
  }
}

OptimizerWrapper::~OptimizerWrapper() = default;

double OptimizerWrapper::loss_scale() const {
  return scaler_ ? scaler_->scale() : 1.0;
}

void OptimizerWrapper::enable_step_overlap(torch::nn::Module& root, bool deferred) {
  finish_update();
  overlap_ = StepOverlap::create(
      root, *optimizer_, deferred ? StepOverlap::Mode::Deferred : StepOverlap::Mode::Stream);
}

void OptimizerWrapper::finish_update() {
  if (overlap_) overlap_->finish();
}

void OptimizerWrapper::backward(const at::Tensor& loss) {
  finish_update();  // a backward without a forward in between must not race the update
  norm_valid_ = false;
  if (scaler_) {
    (loss * scaler_->scale()).backward();
  } else {
    loss.backward();
  }
}

double OptimizerWrapper::compute_grad_norm() {
  std::vector<at::Tensor> grads;
  for (auto& g : optimizer_->param_groups())
    for (auto& p : g.params)
      if (p.grad().defined()) grads.push_back(p.grad());
  // fp64 sum of squares, reduced over the group when gradients are sharded; inf/nan on any rank
  // makes it non-finite everywhere, which is how overflow is agreed.
  return amp::global_grad_norm(grads, loss_scale(), reducer_);
}

double OptimizerWrapper::clip_grad_by_norm(double max_norm, double norm_type) {
  COLOSSAL_CHECK_INPUT(norm_type == 2.0, "clip_grad_by_norm: only norm_type 2 is supported, got ",
                       norm_type);
  COLOSSAL_CHECK_INPUT(max_norm > 0, "clip_grad_by_norm: max_norm must be > 0, got ", max_norm);
  max_norm_ = max_norm;
  last_norm_ = grad_norm_now();
  norm_valid_ = true;
  return last_norm_;
}

void OptimizerWrapper::apply_update(double divisor) {
  if (overlap_)
    overlap_->step(divisor);
  else
    optimizer_->step(divisor);
}

void OptimizerWrapper::drop_grads() {
  optimizer_->zero_grad(true);
}

bool OptimizerWrapper::step() {
  bump_weights_epoch();  // whatever the plugin writes below, weight-derived caches are stale
  if (!norm_valid_) last_norm_ = grad_norm_now();
  norm_valid_ = false;
  const double max_norm = max_norm_ > 0 ? max_norm_ : default_max_norm_;
  max_norm_ = 0.0;
  if (!std::isfinite(last_norm_)) {
    last_skipped_ = true;
    if (scaler_) {
      double old = scaler_->scale();
      scaler_->update(true);
      log_warn("fp16 gradient overflow: step skipped on every rank, loss scale ", old, " -> ",
               scaler_->scale());
    } else {
      log_warn("non-finite gradient norm (", last_norm_, ") in ", to_string(precision_),
               ": step skipped");
    }
    drop_grads();
    return false;
  }
  // Unscaling and clipping are one divisor applied inside the update pass.
  double divisor = loss_scale();
  if (max_norm > 0) {
    double coef = max_norm / (last_norm_ + 1e-6);
    if (coef < 1.0) divisor /= coef;
  }
  apply_update(divisor);
  if (scaler_) scaler_->update(false);
  last_skipped_ = false;
  return true;
}

void OptimizerWrapper::zero_grad(bool set_to_none) {
  // Dropped gradients stay alive for a pending update (it holds them); zeroed ones must wait.
  if (!set_to_none) finish_update();
  optimizer_->zero_grad(set_to_none);
}

optim::StateDict OptimizerWrapper::full_state_dict() {
  finish_update();
  return optimizer_->state_dict();
}

void OptimizerWrapper::load_full_state_dict(const optim::StateDict& state) {
  finish_update();
  optimizer_->load_state_dict(state);
}

OptimizerWrapper::FullStatePlan OptimizerWrapper::full_state_plan() {
  finish_update();
  optim::StateDict sd = optimizer_->state_dict();  // references to the state, no copies
  FullStatePlan plan;
  plan.scalars = std::move(sd.scalars);
  for (auto& [name, t] : sd.tensors) {
    plan.tensors.push_back({name, t.scalar_type(), t.sizes().vec()});
    plan.held.push_back(t);
  }
  return plan;
}

at::Tensor OptimizerWrapper::full_state_tensor(const FullStatePlan& plan, size_t i) {
  COLOSSAL_CHECK(i < plan.held.size(), "full_state_tensor: tensor ", i, " of a plan of ",
                 plan.held.size());
  return plan.held[i].detach();
}

void OptimizerWrapper::load_full_state(const optim::StateSource& source) {
  finish_update();
  optimizer_->load_state(source);
}

void OptimizerWrapper::sync_masters_from_params() {
  finish_update();
  optimizer_->sync_masters_from_params();
}

json::Value OptimizerWrapper::state() const {
  json::Value s = json::Value::object();
  s.set("precision", to_string(precision_));
  if (scaler_) s.set("scaler", scaler_->state_dict());
  return s;
}

void OptimizerWrapper::load_state(const json::Value& state) {
  if (scaler_) {
    if (const json::Value* sc = state.find("scaler")) scaler_->load_state_dict(*sc);
  }
}

}  // namespace colossal::booster
