// CPU Adam: AdamW (the math of adamw.h, torch.optim.AdamW) on CPU fp32 master weights and fp32
// moments in ONE pass over memory, vectorised with AVX-512 or AVX2 (picked at run time from the
// CPU's features, scalar fallback) and split over at::get_num_threads() threads (its own
// persistent std::threads: at::parallel_for is serial in code built without OpenMP).
//
// The offload step of ZeRO: gradients may be bf16 or fp16 (upcast on the fly), a `grad_divisor`
// (loss-scale unscaling and clipping) is fused in, and an optional bf16/fp16 buffer receives the
// updated weights cast down (round to nearest even, exactly as at::Tensor::to does) in the same
// pass. PyTorch needs an upcast, the step and a downcast for that: three passes.
//
// Path choice: the best the CPU supports, unless the environment variable COLOSSAL_CPU_ADAM is
// "scalar", "avx2" or "avx512" (caps the path, for testing every kernel on one machine; a path
// the CPU lacks is an InputError), or a call names a path explicitly.
#pragma once

#include <ATen/core/Tensor.h>
#include <colossal/optim/adamw.h>
#include <colossal/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace colossal::optim {

enum class CpuAdamPath { Auto, Scalar, AVX2, AVX512 };

const char* cpu_adam_path_name(CpuAdamPath path);
// Whether this CPU (and this build) can run the path; Auto and Scalar are always available.
bool cpu_adam_path_available(CpuAdamPath path);
// Threads an update of `numel` elements runs on: at::get_num_threads(), fewer for small updates
// (at least 64K elements per thread).
int64_t cpu_adam_num_threads(int64_t numel);
// The path Auto resolves to: the best available one, capped by COLOSSAL_CPU_ADAM when set.
CpuAdamPath cpu_adam_default_path();

// Updates one tensor: `param`, `exp_avg`, `exp_avg_sq` are contiguous fp32 CPU tensors of equal
// numel (modified in place); `grad` is contiguous fp32, bf16 or fp16 of the same numel; `step`
// is the step number after increment (1 on the first update); gradients are divided by
// `grad_divisor` (> 0) inside the update. When `param_out` is defined (contiguous bf16, fp16 or
// fp32 CPU, same numel) it receives the updated param cast to its dtype.
void cpu_adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, int64_t step, const AdamWHyper& hyper,
                     double grad_divisor = 1.0, const at::Tensor& param_out = {},
                     CpuAdamPath path = CpuAdamPath::Auto);

// The same over lists (all of equal length; `params_out` empty or of the same length with
// undefined entries allowed).
void cpu_adam_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& exp_avg_sqs, int64_t step,
                     const AdamWHyper& hyper, double grad_divisor = 1.0,
                     const std::vector<at::Tensor>& params_out = {},
                     CpuAdamPath path = CpuAdamPath::Auto);

// AdamW through the CPU Adam kernel for contiguous fp32 CPU tensors (other tensors go through
// adamw_update). Its state is AdamW's (type "adamw", keys exp_avg / exp_avg_sq), so checkpoints
// interchange with AdamW both ways.
class CPUAdam : public Optimizer {
 public:
  explicit CPUAdam(OptimizerOptions options = {}, CpuAdamPath path = CpuAdamPath::Auto)
      : Optimizer(options), path_(path) {}
  const char* type() const override { return "adamw"; }

 protected:
  void update(const GroupOptions& group, std::vector<at::Tensor>& params,
              std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) override;
  std::vector<std::string> state_keys(const GroupOptions&) const override {
    return {"exp_avg", "exp_avg_sq"};
  }

 private:
  CpuAdamPath path_;
};

}  // namespace colossal::optim
