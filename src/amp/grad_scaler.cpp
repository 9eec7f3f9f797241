// DynamicGradScaler and the fused overflow check / unscale / clip over gradient lists.
#include "colossal/amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"

namespace colossal::amp {

DynamicGradScaler::DynamicGradScaler(DynamicGradScalerOptions o)
    : options_(o), scale_(o.initial_scale) {
  COLOSSAL_CHECK_INPUT(o.min_scale > 0, "grad scaler: min_scale must be > 0, got ", o.min_scale);
  COLOSSAL_CHECK_INPUT(o.max_scale >= o.min_scale, "grad scaler: max_scale (", o.max_scale,
                       ") must be >= min_scale (", o.min_scale, ")");
  COLOSSAL_CHECK_INPUT(o.initial_scale >= o.min_scale && o.initial_scale <= o.max_scale,
                       "grad scaler: initial_scale ", o.initial_scale, " must lie in [min_scale ",
                       o.min_scale, ", max_scale ", o.max_scale, "]");
  COLOSSAL_CHECK_INPUT(o.growth_factor > 1, "grad scaler: growth_factor must be > 1, got ",
                       o.growth_factor);
  COLOSSAL_CHECK_INPUT(o.backoff_factor > 0 && o.backoff_factor < 1,
                       "grad scaler: backoff_factor must be in (0, 1), got ", o.backoff_factor);
  COLOSSAL_CHECK_INPUT(o.growth_interval >= 1, "grad scaler: growth_interval must be >= 1, got ",
                       o.growth_interval);
  COLOSSAL_CHECK_INPUT(o.hysteresis >= 1, "grad scaler: hysteresis must be >= 1, got ",
                       o.hysteresis);
}

void DynamicGradScaler::update(bool overflow) {
  if (overflow) {
    growth_step_ = 0;
    if (++hyst_step_ >= options_.hysteresis) {
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
      hyst_step_ = 0;  // the fix: the next backoff again needs `hysteresis` overflows
    }
  } else if (++growth_step_ >= options_.growth_interval) {
    growth_step_ = 0;
    hyst_step_ = 0;
    scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
  }
}

json::Value DynamicGradScaler::state_dict() const {
  json::Value s = json::Value::object();
  s.set("scale", scale_);
  s.set("growth_step", growth_step_);
  s.set("hysteresis_step", hyst_step_);
  return s;
}

void DynamicGradScaler::load_state_dict(const json::Value& s) {
  double scale = s.at("scale").as_double("grad scaler 'scale'");
  COLOSSAL_CHECK_INPUT(scale > 0 && std::isfinite(scale),
                       "grad scaler state: scale must be finite and > 0, got ", scale);
  int64_t g = s.at("growth_step").as_int("grad scaler 'growth_step'");
  int64_t h = s.at("hysteresis_step").as_int("grad scaler 'hysteresis_step'");
  COLOSSAL_CHECK_INPUT(g >= 0 && h >= 0, "grad scaler state: negative counters (growth_step ", g,
                       ", hysteresis_step ", h, ")");
  scale_ = scale;
  growth_step_ = g;
  hyst_step_ = h;
}

namespace {
std::vector<at::Tensor> defined(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> out;
  for (auto& g : grads)
    if (g.defined() && g.numel() > 0) out.push_back(g);
  return out;
}

bool local_overflow_to_global(bool local, const at::Tensor& like, const GradReducer& r) {
  if (!r.all_reduce_max) return local;
  at::Tensor flag = at::full({1}, local ? 1.0f : 0.0f,
                             at::TensorOptions().dtype(at::kFloat).device(like.device()));
  r.all_reduce_max(flag);
  return flag.item<float>() > 0;
}
}  // namespace

// Sum of squares of every entry, fp64, as one 0-dim tensor on the first grad's device. Grads
// may live on several devices (CPU-offloaded shards next to GPU ones): one foreach pass per
// device, partial sums gathered on the first device.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& grads) {
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> by_device;
  for (const auto& g : grads) {
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](auto& e) { return e.first == g.device(); });
    if (it == by_device.end()) {
      by_device.emplace_back(g.device(), std::vector<at::Tensor>{});
      it = std::prev(by_device.end());
    }
    it->second.push_back(g);
  }
  at::Tensor total;
  for (auto& [dev, list] : by_device) {
    // On CUDA one multi-tensor kernel reads each gradient once at the bandwidth ceiling (fp32
    // squares within blocks, fp64 across them); elsewhere ATen's fp64 foreach norm.
    at::Tensor part = dev.is_cuda() && kernels::enabled() ? kernels::sum_squares(list)
                                                          : kernels::sum_squares_reference(list);
    total = total.defined() ? total + part.to(total.device()) : part;
  }
  return total;
}

bool grads_overflow(const std::vector<at::Tensor>& grads_in, const GradReducer& r) {
  c10::NoGradGuard no_grad;
  auto grads = defined(grads_in);
  if (grads.empty()) return local_overflow_to_global(false, at::empty({0}), r);
  double sq = sum_of_squares(grads).item<double>();
  return local_overflow_to_global(!std::isfinite(sq), grads[0], r);
}

double global_grad_norm(const std::vector<at::Tensor>& grads_in, double scale, const GradReducer& r,
                        const std::vector<at::Tensor>& sums_of_squares) {
  c10::NoGradGuard no_grad;
  auto grads = defined(grads_in);
  at::Tensor sq = grads.empty() ? at::zeros({}, at::kDouble) : sum_of_squares(grads);
  for (const at::Tensor& part : sums_of_squares)
    sq = sq + part.to(sq.device(), at::kDouble).reshape({});
  if (r.all_reduce_sum) {
    sq = sq.reshape({1}).contiguous();
    r.all_reduce_sum(sq);
  }
  return std::sqrt(sq.item<double>()) / scale;
}

ClipResult unscale_and_clip(const std::vector<at::Tensor>& grads_in, double scale, double max_norm,
                            const GradReducer& r, bool apply) {
  COLOSSAL_CHECK(scale > 0, "unscale_and_clip: scale must be > 0, got ", scale);
  c10::NoGradGuard no_grad;
  auto grads = defined(grads_in);
  ClipResult res;
  // One fp64 pass gives both the overflow flag (a non-finite sum) and the norm.
  at::Tensor sq = grads.empty() ? at::zeros({}, at::kDouble) : sum_of_squares(grads);
  double local_sq = sq.item<double>();
  res.overflow = local_overflow_to_global(!std::isfinite(local_sq),
                                          grads.empty() ? at::empty({0}) : grads[0], r);
  if (res.overflow) {
    res.norm = std::numeric_limits<double>::infinity();
    return res;
  }
  double total_sq = local_sq;
  if (r.all_reduce_sum) {
    at::Tensor t = sq.reshape({1}).contiguous();
    r.all_reduce_sum(t);
    total_sq = t.item<double>();
  }
  res.norm = std::sqrt(total_sq) / scale;
  double coef = 1.0;
  if (max_norm > 0) coef = std::min(1.0, max_norm / (res.norm + 1e-6));
  res.divisor = scale / coef;
  if (apply && res.divisor != 1.0 && !grads.empty()) at::_foreach_mul_(grads, coef / scale);
  return res;
}

}  // namespace colossal::amp
