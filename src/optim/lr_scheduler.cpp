// LR schedules (formulas in the header, matched to HF transformers by tests/optim).
#include "colossal/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "colossal/core/error.h"
#include "colossal/optim/optimizer.h"

namespace colossal::optim {

ScheduleKind schedule_kind_from_string(const std::string& s) {
  if (s == "constant") return ScheduleKind::Constant;
  if (s == "linear") return ScheduleKind::Linear;
  if (s == "cosine") return ScheduleKind::Cosine;
  throw InputError(str("unknown lr schedule '", s, "'; use constant, linear or cosine"));
}

double lr_factor(const LRScheduleOptions& o, int64_t t) {
  if (t < o.warmup_steps)
    return static_cast<double>(t) / static_cast<double>(std::max<int64_t>(1, o.warmup_steps));
  double span = static_cast<double>(std::max<int64_t>(1, o.total_steps - o.warmup_steps));
  double f = 1.0;
  switch (o.kind) {
    case ScheduleKind::Constant:
      return 1.0;
    case ScheduleKind::Linear:
      f = std::max(0.0, static_cast<double>(o.total_steps - t) / span);
      break;
    case ScheduleKind::Cosine: {
      double progress = static_cast<double>(t - o.warmup_steps) / span;
      f = 0.5 * (1.0 + std::cos(std::numbers::pi * o.num_cycles * 2.0 * progress));
      break;
    }
  }
  f = f * (1 - o.min_lr_ratio) + o.min_lr_ratio;
  return std::max(0.0, f);
}

LRScheduler::LRScheduler(Optimizer& optimizer, LRScheduleOptions options)
    : opt_(optimizer), options_(options) {
  COLOSSAL_CHECK_INPUT(options.warmup_steps >= 0, "lr schedule: warmup_steps must be >= 0, got ",
                       options.warmup_steps);
  COLOSSAL_CHECK_INPUT(options.kind == ScheduleKind::Constant || options.total_steps > 0,
                       "lr schedule: linear and cosine need total_steps > 0, got ",
                       options.total_steps);
  COLOSSAL_CHECK_INPUT(options.min_lr_ratio >= 0 && options.min_lr_ratio <= 1,
                       "lr schedule: min_lr_ratio must be in [0, 1], got ", options.min_lr_ratio);
  for (auto& g : opt_.param_groups()) base_lrs_.push_back(g.options.lr);
  apply();
}

void LRScheduler::apply() {
  double f = factor();
  auto& groups = opt_.param_groups();
  COLOSSAL_CHECK(groups.size() == base_lrs_.size(), "lr scheduler: the optimizer has ",
                 groups.size(), " param groups but the scheduler was built for ", base_lrs_.size());
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options.lr = base_lrs_[i] * f;
}

void LRScheduler::step() {
  ++step_;
  apply();
}

std::vector<double> LRScheduler::lrs() const {
  std::vector<double> out;
  for (auto& g : opt_.param_groups()) out.push_back(g.options.lr);
  return out;
}

json::Value LRScheduler::state_dict() const {
  json::Value s = json::Value::object();
  s.set("last_step", step_);
  json::Value b = json::Value::array();
  for (double x : base_lrs_) b.push_back(x);
  s.set("base_lrs", std::move(b));
  return s;
}

void LRScheduler::load_state_dict(const json::Value& s) {
  int64_t t = s.at("last_step").as_int("lr scheduler 'last_step'");
  COLOSSAL_CHECK_INPUT(t >= 0, "lr scheduler state: last_step must be >= 0, got ", t);
  const auto& b = s.at("base_lrs").as_array("lr scheduler 'base_lrs'");
  COLOSSAL_CHECK_INPUT(b.size() == base_lrs_.size(), "lr scheduler state has ", b.size(),
                       " base lrs but the optimizer has ", base_lrs_.size(), " param groups");
  std::vector<double> base;
  for (auto& x : b) base.push_back(x.as_double("base_lrs[]"));
  base_lrs_ = std::move(base);
  step_ = t;
  apply();
}

}  // namespace colossal::optim
