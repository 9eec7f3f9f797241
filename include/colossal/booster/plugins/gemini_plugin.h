// The `gemini` plugin: ZeRO-3 with chunk-based memory management (ColossalAI's GeminiPlugin).
// Parameters live in chunks (zero/gemini/chunk.h) sharded across the data-parallel group; the
// forward hooks of every colossal::nn::Module gather the chunks a layer needs and prefetch the
// next ones; gradients are reduce-scattered per chunk as soon as backward completes it; fp32
// master chunks pair the working fp32/bf16/fp16 chunks; placement `static` (shard_param_frac,
// offload_optim_frac, offload_param_frac) or `auto` (device budget from a warm-up step); the
// update is HybridAdam (CPU Adam on host chunks, fused AdamW on device chunks), with global
// grad-norm clipping and fp16 dynamic loss scaling.
//
// Departures from ColossalAI, on purpose:
// - no_sync / gradient accumulation works (every micro-step is reduced into the fp32 gradient
//   shard; exact, memory stays at the shard). ColossalAI's Gemini has none by default.
// - fp32 is a supported precision (tests compare against ddp in fp32).
// - Optimizer checkpoints are full-shape by parameter name (optim::Optimizer's format), so a
//   gemini run resumes under ddp/zero and the reverse; the model is saved gathered as HF.
// - Frozen parameters (requires_grad false, e.g. LoRA's base weights) are chunked too (their own
//   chunks, no gradient or optimizer data), not refused.
// - The memory report is a method returning JSON (and logged by rank 0 after warm-up).
#pragma once

#include <memory>
#include <string>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugin.h"
#include "colossal/booster/plugins/data_parallel_plugin.h"
#include "colossal/booster/wrappers.h"
#include "colossal/core/json.h"
#include "colossal/zero/gemini/options.h"

namespace colossal {
class OptionSet;
}
namespace colossal::zero::gemini {
class ChunkManager;
}

namespace colossal::booster {

// The chunk manager's options (placement_policy, shard_param_frac, offload_optim_frac,
// offload_param_frac, warmup_non_model_data_ratio, steady_cuda_cap_ratio, device_capacity_mb,
// host_capacity_mb, max_prefetch, overlap_cpu_adam, search_range_m, min_chunk_size_m,
// hidden_dim, communication_dtype) are inherited, not copied; the plugin adds its own.
struct GeminiPluginOptions : zero::gemini::GeminiOptions {
  std::string precision = "fp16";  // ColossalAI's default
  std::string device = "cpu";
  double max_norm = 0.0;
  LossScaleOptions loss_scale;  // ColossalAI's Gemini: initial_scale 2**16

  // Registers the Gemini fields under section "plugin" (placement_policy, shard_param_frac,
  // offload_optim_frac, offload_param_frac, warmup_non_model_data_ratio, steady_cuda_cap_ratio,
  // device_capacity_mb, host_capacity_mb, max_prefetch, overlap_cpu_adam, search_range_m,
  // min_chunk_size_m, hidden_dim). Precision, loss scale and communication_dtype are shared with
  // the ddp/zero options.
  void register_options(OptionSet& set);
};

// Checkpoints: the model gathered from the chunks (GeminiModel::wait_weights) and full-shape
// optimizer states.
class GeminiPlugin : public DataParallelPlugin<GeminiPluginOptions> {
 public:
  explicit GeminiPlugin(GeminiPluginOptions options = {}, dist::Communicator comm = {});
  std::string name() const override { return "gemini"; }
  std::shared_ptr<ModelWrapper> configure_model(std::shared_ptr<torch::nn::Module> model) override;
  std::shared_ptr<OptimizerWrapper> configure_optimizer(std::shared_ptr<optim::Optimizer> optimizer,
                                                        ModelWrapper& model) override;
};

// What configure_optimizer returns: norm, clipping, loss scaling and the update run on chunks.
class GeminiOptimizerWrapper : public OptimizerWrapper {
 public:
  GeminiOptimizerWrapper(std::shared_ptr<optim::Optimizer> optimizer,
                         std::shared_ptr<zero::gemini::ChunkManager> manager, Precision precision,
                         const LossScaleOptions& loss_scale, double max_norm);
  void backward(const at::Tensor& loss) override;
  bool step() override;  // the base sequence; logs the memory report after the first step
  void zero_grad(bool set_to_none = true) override;
  optim::StateDict full_state_dict() override;
  void load_full_state_dict(const optim::StateDict& state) override;
  FullStatePlan full_state_plan() override;
  at::Tensor full_state_tensor(const FullStatePlan& plan, size_t i) override;
  void load_full_state(const optim::StateSource& source) override;
  void sync_masters_from_params() override;
  zero::gemini::ChunkManager& manager() { return *manager_; }
  // Bytes of parameters, gradients, masters and optimizer states on device and host, chunk
  // utilisation and the peak device memory seen (logged by rank 0 after the first step).
  json::Value memory_report() const;

 protected:
  double grad_norm_now() override;
  void apply_update(double divisor) override;
  void drop_grads() override;

 private:
  std::shared_ptr<zero::gemini::ChunkManager> manager_;
  int64_t steps_ = 0;
};

}  // namespace colossal::booster
