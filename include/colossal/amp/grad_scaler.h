// Dynamic loss scaling with ColossalAI's DynamicGradScaler semantics, one quirk fixed.
//
// update(overflow):
//   overflow: growth counter = 0; hysteresis counter += 1; once it reaches `hysteresis`,
//             scale = max(scale * backoff_factor, min_scale) and the hysteresis counter resets
//             to 0 (FIX: ColossalAI never resets it, so after its first backoff every later
//             single overflow backs off at once; here each backoff needs `hysteresis`
//             overflows again).
//   clean:    growth counter += 1; once it reaches growth_interval, both counters reset and
//             scale = min(scale * growth_factor, max_scale).
// An overflowing step is always skipped (gradients zeroed), backoff or not.
#pragma once

#include <ATen/core/Tensor.h>
#include <colossal/amp/grad_reducer.h>
#include <colossal/core/json.h>

#include <cstdint>
#include <vector>

namespace colossal::amp {

struct DynamicGradScalerOptions {
  double initial_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 1000;
  int64_t hysteresis = 2;
  double min_scale = 1.0;
  double max_scale = 4294967296.0;  // 2^32
};

class DynamicGradScaler {
 public:
  explicit DynamicGradScaler(DynamicGradScalerOptions options = {});

  double scale() const { return scale_; }
  void update(bool overflow);
  int64_t growth_step() const { return growth_step_; }
  int64_t hysteresis_step() const { return hyst_step_; }
  const DynamicGradScalerOptions& options() const { return options_; }

  json::Value state_dict() const;  // {"scale", "growth_step", "hysteresis_step"}
  void load_state_dict(const json::Value& state);

 private:
  DynamicGradScalerOptions options_;
  double scale_;
  int64_t growth_step_ = 0;
  int64_t hyst_step_ = 0;
};

// True when any gradient holds inf or NaN on any rank (MAX all-reduce of a local flag).
bool grads_overflow(const std::vector<at::Tensor>& grads, const GradReducer& reducer = {});

// Sum of squares of every entry of non-empty `grads` (fp64, one 0-dim tensor on the first
// grad's device); one pass per device: the fused kernel on CUDA (when enabled), else ATen's fp64
// foreach norm.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& grads);

// The global L2 norm of grads / scale: squares summed in fp64 on every rank, SUM all-reduced,
// then sqrt / scale. Not finite when some gradient is.
// `sums_of_squares`: fp64 scalars (any device) of gradients already squared and summed
// elsewhere (Gemini sums a chunk's gradient on the GPU before copying it to the host), added to
// this rank's sum before the all-reduce.
double global_grad_norm(const std::vector<at::Tensor>& grads, double scale = 1.0,
                        const GradReducer& reducer = {},
                        const std::vector<at::Tensor>& sums_of_squares = {});

struct ClipResult {
  bool overflow = false;  // some rank had inf/NaN: grads were left untouched, skip the step
  double norm = 0.0;      // global norm of the unscaled gradients (before clipping)
  double divisor = 1.0;   // what the grads were divided by (scale / clip coefficient)
};

// Unscales (divides by `scale`) and clips to `max_norm` (<= 0: no clipping) in one pass over
// the gradients after one fp64 norm pass: clip coefficient = min(1, max_norm / (norm + 1e-6))
// as torch.nn.utils.clip_grad_norm_. Checks overflow first (agreed across ranks).
// With `apply` false the gradients are not written; use result.divisor to fuse the division
// into the optimizer (adamw_update's grad_divisor).
ClipResult unscale_and_clip(const std::vector<at::Tensor>& grads, double scale, double max_norm,
                            const GradReducer& reducer = {}, bool apply = true);

}  // namespace colossal::amp
