// Learning-rate schedules as multipliers of each group's base lr, defined exactly as HF
// transformers' schedulers (LambdaLR semantics: construction applies factor(0), every step()
// advances one step and applies factor(step)). With warmup W and total T:
//   warmup (t < W):  t / max(1, W)                                  (all kinds)
//   constant:        1
//   linear:          max(0, (T - t) / max(1, T - W))
//   cosine:          0.5 * (1 + cos(pi * 2 * num_cycles * (t - W) / max(1, T - W)))
// min_lr_ratio r (linear and cosine): after warmup, factor = max(0, f * (1 - r) + r), as HF's
// get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=r); for linear the same blend.
#pragma once

#include <colossal/core/json.h>

#include <cstdint>
#include <string>
#include <vector>

namespace colossal::optim {

class Optimizer;

enum class ScheduleKind { Constant, Linear, Cosine };
ScheduleKind schedule_kind_from_string(const std::string& s);  // "constant" | "linear" | "cosine"

struct LRScheduleOptions {
  ScheduleKind kind = ScheduleKind::Constant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // needed by linear and cosine
  double min_lr_ratio = 0.0;
  double num_cycles = 0.5;  // cosine only
};

// The multiplier at step t (pure function; validates nothing).
double lr_factor(const LRScheduleOptions& o, int64_t t);

class LRScheduler {
 public:
  // Captures each group's current lr as its base lr and applies factor(0).
  LRScheduler(Optimizer& optimizer, LRScheduleOptions options);

  void step();  // t += 1, then applies factor(t)
  int64_t last_step() const { return step_; }
  double factor() const { return lr_factor(options_, step_); }
  std::vector<double> lrs() const;  // current lr of each group

  json::Value state_dict() const;  // {"last_step", "base_lrs"}
  void load_state_dict(const json::Value& state);

 private:
  void apply();
  Optimizer& opt_;
  LRScheduleOptions options_;
  std::vector<double> base_lrs_;
  int64_t step_ = 0;
};

}  // namespace colossal::optim
