// The `low_level_zero` plugin: ZeRO stage 1 (optimizer states and fp32 masters sharded across
// the data-parallel group, gradients all-reduced in buckets) and stage 2 (gradients
// reduce-scattered in buckets while backward runs, each rank keeping only its slice). The
// sharded state lives in zero::LowLevelZeroOptimizer (colossal/zero/low_level_optim.h); this
// plugin wires it to the model through GradSync (all-reduce mode for stage 1, reduce-scatter
// mode for stage 2).
//
// Differences from ColossalAI, on purpose:
// - no_sync works for both stages with an exact result. Stage 1 accumulates .grad locally and
//   reduces once; stage 2 reduce-scatters every micro-step and accumulates the averaged slices
//   in the rank's fp32 gradient shard (ColossalAI refuses no_sync under stage 2), so memory
//   stays at one slice during accumulation.
// - Optimizer checkpoints are full-shape (gathered), in the format of optim::Optimizer, so they
//   load under another group size, ddp or one process.
// - overlap_allgather (default off, as in ColossalAI): step() launches the bucketed all-gathers
//   of the updated weights asynchronously and returns. A parameter whose layer (or the nearest
//   enclosing layer) is a colossal::nn::Module is waited for by that layer's forward pre hook, so
//   later layers' gathers overlap earlier layers' compute. Parameters with no colossal::nn::Module
//   at or above them (a plain torch::nn::Module model) cannot be hooked, so their gathers are
//   finished before step() returns: a stale weight is never read. Everything still in flight is
//   finished before the next step, gradient intake, norm, optimizer state export or
//   load, master re-sync, and Booster::save_model/load_model (ModelWrapper::wait_weights).
//   Reading a hooked parameter's tensor directly between step() and the next forward needs
//   ModelWrapper::wait_weights() first.
// - Only AdamW (or CPUAdam: same state) is supported as the inner optimizer (its update runs on
//   flat shards). Under stage 2 a trainable parameter the optimizer does not hold loses its
//   gradient after backward (only optimizer parameters have slices to keep it in).
#pragma once

#include <memory>
#include <string>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugin.h"
#include "colossal/booster/plugins/data_parallel_plugin.h"
#include "colossal/booster/wrappers.h"

namespace colossal {
class OptionSet;
}
namespace colossal::zero {
class LowLevelZeroOptimizer;
}

namespace colossal::booster {

struct ZeroOptions {
  int64_t stage = 1;               // 1 or 2
  std::string precision = "fp16";  // ColossalAI's default
  std::string device = "cpu";
  // ColossalAI's LowLevelZeroPlugin passes initial_scale 2**32 (max_scale 2**32).
  LossScaleOptions loss_scale = [] {
    LossScaleOptions l;
    l.initial_scale = 4294967296.0;
    return l;
  }();
  double max_norm = 0.0;                // clip every step at this global norm (0: off)
  double reduce_bucket_size_in_m = 12;  // gradient bucket, millions of elements
  std::string communication_dtype;      // "" (the gradients' own), "fp32", "bf16", "fp16"
  bool overlap_communication = true;    // launch buckets from backward's hooks as they fill
  bool overlap_allgather = false;       // background weight all-gather, waited per layer
  bool cpu_offload = false;             // masters, grad shards and moments in CPU memory
  bool master_weights = true;           // false is refused for bf16/fp16 (fp32 masters always)
  // ColossalAI's fp8_communication: gradient buckets reduce-scattered (stage 2) or all-reduced
  // (stage 1) in FP8 e5m2 and the updated weights all-gathered in FP8 e4m3, with per-rank scales
  // (dist/fp8_collectives.h). Set through DDPOptions' shared flag by the factory. The model's
  // wait_weights() (checkpoint saves and loads) then gathers the weights again exactly, so it
  // is collective.
  bool fp8_communication = false;

  // Registers the ZeRO-specific fields under section "plugin" (stage, reduce_bucket_size_in_m,
  // communication_dtype, overlap_communication, overlap_allgather, cpu_offload). Precision and
  // the loss-scale fields are shared with DDPOptions::register_options.
  void register_options(OptionSet& set);
};

// Checkpoints: the HF model and full-shape optimizer states gathered from the shards.
class LowLevelZeroPlugin : public DataParallelPlugin<ZeroOptions> {
 public:
  explicit LowLevelZeroPlugin(ZeroOptions options = {}, dist::Communicator comm = {});
  std::string name() const override { return "low_level_zero"; }
  std::shared_ptr<ModelWrapper> configure_model(std::shared_ptr<torch::nn::Module> model) override;
  std::shared_ptr<OptimizerWrapper> configure_optimizer(std::shared_ptr<optim::Optimizer> optimizer,
                                                        ModelWrapper& model) override;
};

// What configure_optimizer returns: an OptimizerWrapper whose step, norm, zero_grad and
// checkpoint export run on the shards.
class ZeroOptimizerWrapper : public OptimizerWrapper {
 public:
  ZeroOptimizerWrapper(std::shared_ptr<optim::Optimizer> optimizer,
                       std::shared_ptr<zero::LowLevelZeroOptimizer> zero, Precision precision,
                       const LossScaleOptions& loss_scale, double max_norm);
  void zero_grad(bool set_to_none = true) override;
  optim::StateDict full_state_dict() override;
  void load_full_state_dict(const optim::StateDict& state) override;
  FullStatePlan full_state_plan() override;
  at::Tensor full_state_tensor(const FullStatePlan& plan, size_t i) override;
  void load_full_state(const optim::StateSource& source) override;
  void sync_masters_from_params() override;
  zero::LowLevelZeroOptimizer& zero() { return *zero_; }

 protected:
  double grad_norm_now() override;
  void apply_update(double divisor) override;
  void drop_grads() override;

 private:
  std::shared_ptr<zero::LowLevelZeroOptimizer> zero_;
};

}  // namespace colossal::booster
