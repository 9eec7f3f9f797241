// What the data-parallel plugins (ddp, low_level_zero, gemini) share: their options (each with a
// precision and a device field), the precision parsed from them, the data-parallel group, and
// the answers of the Plugin interface that follow from those. Each plugin adds its own checks,
// model and optimizer wrappers; the checkpoints are DataParallelCheckpointIO's (HF model,
// full-shape optimizer states by parameter name).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugin.h"

namespace colossal::booster {

template <class Options>
class DataParallelPlugin : public Plugin {
 public:
  std::vector<Precision> supported_precisions() const override {
    return {Precision::FP32, Precision::BF16, Precision::FP16};
  }
  std::vector<std::string> supported_devices() const override { return {"cpu", "cuda"}; }
  bool support_no_sync() const override { return true; }
  bool support_lora() const override { return true; }
  Precision precision() const override { return precision_; }
  std::string device() const override { return options_.device; }
  int dp_rank() const override { return comm_.rank(); }
  int dp_size() const override { return comm_.size(); }
  bool control_checkpoint_io() const override { return true; }
  std::shared_ptr<CheckpointIO> checkpoint_io() override {
    return std::make_shared<DataParallelCheckpointIO>();
  }
  const Options& options() const { return options_; }

 protected:
  // comm: the data-parallel group, already resolved (plugins::default_dp_comm).
  DataParallelPlugin(Options options, dist::Communicator comm)
      : options_(std::move(options)),
        precision_(precision_from_string(options_.precision)),
        comm_(std::move(comm)) {}

  Options options_;
  Precision precision_;
  dist::Communicator comm_;
};

}  // namespace colossal::booster
