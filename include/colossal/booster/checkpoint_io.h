// Checkpoint IO (ColossalAI's CheckpointIO): how a plugin's model, optimizer and scheduler go
// to disk and come back. A plugin that answers control_checkpoint_io() with true provides its
// own through Plugin::checkpoint_io(); the Booster delegates every save_* / load_* to it, so a
// layout that shards weights differently (tensor or pipeline parallel) brings its own writer.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/json.h"
#include "colossal/optim/optimizer.h"

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
  // The tensors of module_state(model.module()) whose names `select` accepts, full and copied to
  // the host, on global rank 0 in module_state() order (other ranks get an empty list); however
  // the layout holds them (ZeRO's gathers in flight, Gemini's chunks), without gathering the rest
  // of the model. Collective: every rank calls it with the same `select`. For small parts of a
  // model such as LoRA adapters (Booster::save_lora_as_pretrained). Default: InputError (the IO
  // does not implement it).
  virtual checkpoint::TensorList gather_model_tensors(
      ModelWrapper& model, const std::function<bool(const std::string&)>& select);
};

// An optimizer checkpoint (`optimizer.safetensors` + its scalars) read tensor by tensor from
// the memory-mapped file: each read gives the pages it touched back (read_slice), so a rank
// that loads its slices holds those slices, never the file.
class FileStateSource : public optim::StateSource {
 public:
  FileStateSource(const std::string& safetensors_path, json::Value scalars)
      : reader_(safetensors_path), scalars_(std::move(scalars)) {}
  const json::Value& scalars() const override { return scalars_; }
  bool find(const std::string& name, std::vector<int64_t>* shape) const override;
  void read(const std::string& name, int64_t begin, const at::Tensor& out) const override;

 private:
  checkpoint::SafetensorsReader reader_;
  json::Value scalars_;
};

// The formats every data-parallel layout (none, ddp, low_level_zero, gemini) writes, so a run
// resumes under another plugin or data-parallel size:
// - model: HF safetensors in `dir` (`model.safetensors`, or shards + index when shard=true),
//   plus config.json for the project's own models; the weights gathered first
//   (ModelWrapper::wait_weights);
// - optimizer: full-shape states keyed by parameter name, `optimizer.safetensors` +
//   `optimizer.json` in `dir`, streamed (OptimizerWrapper::full_state_plan / full_state_tensor,
//   collective under ZeRO/Gemini): the header first, then one tensor at a time gathered to the
//   writer only, written and released, so a save holds at most one full tensor beyond training
//   memory; loaded through FileStateSource, each rank reading only the slices it keeps;
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
  checkpoint::TensorList gather_model_tensors(
      ModelWrapper& model, const std::function<bool(const std::string&)>& select) override;

 private:
  void save_model_streamed(ModelWrapper& model, const std::string& dir,
                           const checkpoint::SaveOptions& so);
};

}  // namespace colossal::booster
