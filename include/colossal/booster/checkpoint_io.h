// Checkpoint IO (ColossalAI's CheckpointIO): how a plugin's model, optimizer and scheduler go
// to disk and come back. A plugin that answers control_checkpoint_io() with true provides its
// own through Plugin::checkpoint_io(); the Booster delegates every save_* / load_* to it, so a
// layout that shards weights differently (tensor or pipeline parallel) brings its own writer.
#pragma once

#include <cstdint>
#include <string>

namespace colossal::optim {
class LRScheduler;
}

namespace colossal::booster {

class ModelWrapper;
class OptimizerWrapper;

class CheckpointIO {
 public:
  virtual ~CheckpointIO() = default;
  // Every rank calls each of these (they may be collective).
  virtual void save_model(ModelWrapper& model, const std::string& dir, bool shard,
                          int64_t size_per_shard_mb) = 0;
  // optimizer (may be null): its fp32 masters follow the loaded weights.
  virtual void load_model(ModelWrapper& model, const std::string& path, bool strict,
                          OptimizerWrapper* optimizer) = 0;
  virtual void save_optimizer(OptimizerWrapper& optimizer, const std::string& dir) = 0;
  virtual void load_optimizer(OptimizerWrapper& optimizer, const std::string& dir) = 0;
  virtual void save_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) = 0;
  virtual void load_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) = 0;
};

// The formats every data-parallel layout (none, ddp, low_level_zero, gemini) writes, so a run
// resumes under another plugin or data-parallel size:
// - model: HF safetensors in `dir` (`model.safetensors`, or shards + index when shard=true),
//   plus config.json for the project's own models; the weights gathered first
//   (ModelWrapper::wait_weights);
// - optimizer: full-shape states keyed by parameter name, `optimizer.safetensors` +
//   `optimizer.json` in `dir` (OptimizerWrapper::full_state_dict, collective under ZeRO/Gemini);
// - scheduler: its JSON state.
// Written by global rank 0, atomically, followed by a barrier; every rank reads. Also what the
// Booster uses for a plugin that does not control its checkpoint IO.
class DataParallelCheckpointIO : public CheckpointIO {
 public:
  void save_model(ModelWrapper& model, const std::string& dir, bool shard,
                  int64_t size_per_shard_mb) override;
  void load_model(ModelWrapper& model, const std::string& path, bool strict,
                  OptimizerWrapper* optimizer) override;
  void save_optimizer(OptimizerWrapper& optimizer, const std::string& dir) override;
  void load_optimizer(OptimizerWrapper& optimizer, const std::string& dir) override;
  void save_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) override;
  void load_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) override;
};

}  // namespace colossal::booster
