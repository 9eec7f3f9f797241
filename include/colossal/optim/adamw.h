// AdamW exactly as torch.optim.AdamW (decoupled weight decay, bias correction, no amsgrad):
//   p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
//   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
// The math is a free function over lists of tensors so sharded optimizers can call it on flat
// shards; the AdamW class applies it to named parameters.
#pragma once

#include <ATen/core/Tensor.h>
#include <colossal/kernels/adamw_hyper.h>
#include <colossal/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace colossal::optim {

// The hyper-parameters (defined once in kernels/adamw_hyper.h; GroupOptions derives from it).
using AdamWHyper = kernels::AdamWHyper;

enum class AdamWImpl {
  Auto,    // Fused when ATen has the fused kernel for the tensors' device and dtype, else ForEach
  Fused,   // at::_fused_adamw_ (CPU and CUDA, one kernel over all tensors); Error if unusable
  ForEach  // ATen _foreach_ ops (any device and floating dtype)
};

// Updates params/exp_avgs/exp_avg_sqs in place from grads; `step` is the step number AFTER
// increment (1 on the first update). All lists have equal length; tensors of one index share
// shape, device and dtype. `grad_divisor` (>0) divides gradients on the fly (loss-scale
// unscaling + clipping fused into the update), 1 = none.
void adamw_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs, int64_t step, const AdamWHyper& hyper,
                  AdamWImpl impl = AdamWImpl::Auto, double grad_divisor = 1.0);

// Whether the fused kernel serves tensors of this device type and dtype in this LibTorch.
bool fused_adamw_available(const at::Tensor& example);

class AdamW : public Optimizer {
 public:
  explicit AdamW(OptimizerOptions options = {}, AdamWImpl impl = AdamWImpl::Auto)
      : Optimizer(options), impl_(impl) {}
  const char* type() const override { return "adamw"; }

 protected:
  void update(const GroupOptions& group, std::vector<at::Tensor>& params,
              std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) override;
  // kernels::fused_adamw (bf16 grads in, fp32 masters and moments, bf16 weights out in one pass)
  // when the fused kernels are enabled and serve these tensors.
  bool update_masters_fused(const GroupOptions& group, const std::vector<at::Tensor>& masters,
                            const std::vector<at::Tensor>& grads, std::vector<ParamState*>& states,
                            const std::vector<at::Tensor>& working) override;
  std::vector<std::string> state_keys(const GroupOptions&) const override {
    return {"exp_avg", "exp_avg_sq"};
  }

 private:
  AdamWImpl impl_;
};

}  // namespace colossal::optim
