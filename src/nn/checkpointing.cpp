// Activation checkpointing as a torch::autograd::Function: forward runs the block with grad off
// (nothing but its input is saved); backward restores the RNG state, re-runs the block with grad
// on and differentiates it with torch::autograd::grad for the input and the parameters.
#include "colossal/nn/checkpointing.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"

namespace colossal::nn {

const char* to_string(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::None:
      return "none";
    case CheckpointMode::Full:
      return "full";
    case CheckpointMode::Attention:
      return "attention";
  }
  return "?";
}

CheckpointMode checkpoint_mode_from_string(const std::string& name) {
  if (name == "none") return CheckpointMode::None;
  if (name == "full") return CheckpointMode::Full;
  if (name == "attention") return CheckpointMode::Attention;
  throw InputError("unknown activation checkpointing mode '" + name +
                   "': use none, full or attention");
}

namespace {

std::atomic<int64_t> g_recomputes{0};

using BlockFn = std::function<at::Tensor(const at::Tensor&)>;

// The block function and RNG states travel in the autograd context as a capsule.
struct Saved : torch::CustomClassHolder {
  BlockFn fn;
  bool input_requires_grad = false;
  c10::Device device = c10::Device(c10::kCPU);
  at::Tensor cpu_rng, device_rng;  // device_rng undefined for CPU inputs
};

Accelerator* device_accelerator(const c10::Device& d) {
  if (d.is_cuda()) return &Accelerator::cuda();
  return nullptr;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::Tensor x,
                                                at::TensorList params,
                                                c10::intrusive_ptr<Saved> saved) {
    // Function::apply already runs this with grad mode off: fn's graph is not recorded.
    saved->cpu_rng = Accelerator::cpu().get_rng_state();
    if (Accelerator* acc = device_accelerator(saved->device))
      saved->device_rng = acc->get_rng_state(saved->device.index());
    at::Tensor y = saved->fn(x);
    std::vector<at::Tensor> to_save{x};
    to_save.insert(to_save.end(), params.begin(), params.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["block"] = c10::IValue::make_capsule(saved);
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["block"].toCapsule());
    COLOSSAL_CHECK(saved->fn,
                   "activation checkpointing: backward ran twice over one forward "
                   "(retain_graph is not supported with recompute)");
    std::vector<at::Tensor> all = ctx->get_saved_variables();
    at::Tensor x = all[0].detach().requires_grad_(saved->input_requires_grad);
    std::vector<at::Tensor> params(all.begin() + 1, all.end());

    // Recompute under the forward's RNG state, then give the generators their current state back.
    Accelerator* acc = device_accelerator(saved->device);
    const int dev_index = saved->device.index();
    at::Tensor cpu_now = Accelerator::cpu().get_rng_state();
    at::Tensor dev_now = acc ? acc->get_rng_state(dev_index) : at::Tensor();
    Accelerator::cpu().set_rng_state(saved->cpu_rng);
    if (acc) acc->set_rng_state(saved->device_rng, dev_index);
    at::Tensor y;
    try {
      at::AutoGradMode grad_on(true);
      y = saved->fn(x);
    } catch (...) {
      Accelerator::cpu().set_rng_state(cpu_now);
      if (acc) acc->set_rng_state(dev_now, dev_index);
      throw;
    }
    Accelerator::cpu().set_rng_state(cpu_now);
    if (acc) acc->set_rng_state(dev_now, dev_index);
    ++g_recomputes;

    std::vector<at::Tensor> inputs;
    std::vector<size_t> slot;  // index into the returned gradient list
    if (x.requires_grad()) inputs.push_back(x), slot.push_back(0);
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].requires_grad()) inputs.push_back(params[i]), slot.push_back(i + 1);
    torch::autograd::variable_list grads(params.size() + 2);  // x, params..., the capsule
    if (!inputs.empty() && y.requires_grad()) {
      auto g = torch::autograd::grad({y}, inputs, {grad_out[0]}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t i = 0; i < g.size(); ++i) grads[slot[i]] = g[i];
    }
    saved->fn = nullptr;  // drops the captured tensors (cos/sin, masks) now
    return grads;
  }
};

}  // namespace

at::Tensor checkpoint(const BlockFn& fn, const at::Tensor& x,
                      const std::vector<at::Tensor>& params) {
  bool needs_grad = x.requires_grad();
  for (const auto& p : params) needs_grad = needs_grad || p.requires_grad();
  if (!at::GradMode::is_enabled() || !needs_grad) return fn(x);
  auto saved = c10::make_intrusive<Saved>();
  saved->fn = fn;
  saved->input_requires_grad = x.requires_grad();
  saved->device = x.device();
  // A TensorList argument counts each tensor as an input (a std::vector would count as one).
  return CheckpointFunction::apply(x, at::TensorList(params), saved)[0];
}

int64_t checkpoint_recompute_count() {
  return g_recomputes.load();
}

}  // namespace colossal::nn
