// The `none` (single process) and `ddp` plugins.
//
// ddp: parameters broadcast from rank 0 at boost, gradients all-reduced (averaged) in buckets
// overlapped with backward (GradSync), no_sync accumulation. Options follow ColossalAI's
// TorchDDPPlugin names; precision is the plugin's (fp32, or bf16/fp16 working weights with fp32
// masters in the optimizer and a dynamic loss scale for fp16). fp8_communication: gradients
// travel in FP8 with scales.
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

namespace colossal::booster {

struct DDPOptions {
  std::string precision = "fp32";
  std::string device = "cpu";
  double bucket_cap_mb = 25.0;
  bool broadcast_buffers = true;
  // Reduce gradients in fp32 even when they are bf16/fp16 (costs bandwidth, saves precision).
  bool fp32_grad_reduce = false;
  // ColossalAI's fp8_communication: gradient buckets all-reduced in FP8 (e5m2, as ColossalAI's
  // DDP comm hook) with per-slice scales (dist/fp8_collectives.h). The flag is shared with
  // low_level_zero and gemini (PluginOptions); hybrid and none refuse it.
  bool fp8_communication = false;
  // The optimizer update of each step runs beside the next step's forward, layer by layer
  // (booster/step_overlap.h): a CUDA side stream, or deferred to each layer's forward on the
  // CPU. Bitwise the same result; not in ColossalAI. Off by default: on an H100 at its power
  // limit it measured 0.99x (the update's memory traffic costs the GEMMs as much clock as it
  // hides; docs/benchmarks.md).
  bool overlap_step = false;
  LossScaleOptions loss_scale;

  // Registers every field under section "plugin" (flags --bucket_cap_mb, ...).
  void register_options(OptionSet& set);
};

class DDPPlugin : public DataParallelPlugin<DDPOptions> {
 public:
  // comm: the data-parallel group (default: the world communicator of dist::init()).
  explicit DDPPlugin(DDPOptions options = {}, dist::Communicator comm = {});
  std::string name() const override { return "ddp"; }
  std::shared_ptr<ModelWrapper> configure_model(std::shared_ptr<torch::nn::Module> model) override;
  std::shared_ptr<OptimizerWrapper> configure_optimizer(std::shared_ptr<optim::Optimizer> optimizer,
                                                        ModelWrapper& model) override;
};

// Single process: no communication. Refuses to run with more than one rank (use ddp).
class NonePlugin : public Plugin {
 public:
  explicit NonePlugin(std::string precision = "fp32", std::string device = "cpu",
                      LossScaleOptions loss_scale = {});
  std::string name() const override { return "none"; }
  std::vector<Precision> supported_precisions() const override;
  std::vector<std::string> supported_devices() const override { return {"cpu", "cuda"}; }
  bool support_no_sync() const override { return true; }
  bool support_lora() const override { return true; }
  Precision precision() const override { return precision_; }
  std::string device() const override { return device_; }
  int dp_rank() const override { return 0; }
  int dp_size() const override { return 1; }
  bool control_checkpoint_io() const override { return true; }
  std::shared_ptr<CheckpointIO> checkpoint_io() override {
    return std::make_shared<DataParallelCheckpointIO>();
  }
  std::shared_ptr<ModelWrapper> configure_model(std::shared_ptr<torch::nn::Module> model) override;
  std::shared_ptr<OptimizerWrapper> configure_optimizer(std::shared_ptr<optim::Optimizer> optimizer,
                                                        ModelWrapper& model) override;

 private:
  Precision precision_;
  std::string device_;
  LossScaleOptions loss_scale_;
};

}  // namespace colossal::booster
