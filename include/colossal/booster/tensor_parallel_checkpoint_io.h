// Checkpoint IO of tensor-parallel layouts (ColossalAI's HybridParallelCheckpointIO without
// pipeline stages). It writes exactly the files DataParallelCheckpointIO writes for the same
// weights, so a run saves from any layout and resumes in any other (dp-only, tp2, tp4, tp x dp,
// ZeRO, Gemini):
// - model: HF safetensors (`model.safetensors`, or shards + `model.safetensors.index.json`
//   when shard=true, cut at size_per_shard_mb) plus config.json for the project's own models.
//   Streamed: tensor by tensor in file order, a sharded parameter is gathered over its tensor-
//   parallel group to global rank 0, written and freed before the next one, so no rank ever
//   holds more than one full tensor (and one received shard of it) beyond its training memory.
//   Only the tensor-parallel group of global rank 0 takes part; the other ranks wait.
// - load: every rank maps the files and copies only its slice of each tensor into its shard
//   (Module::shard_slice), whatever layout wrote them; strict names missing and unexpected keys.
// - optimizer: `optimizer.safetensors` + `optimizer.json` with full-shape states keyed by
//   parameter name: OptimizerWrapper::full_state_dict (which gathers ZeRO's data-parallel
//   shards) holds this rank's tensor-parallel slice of each state; slices are gathered over tp
//   the same streamed way on save and cut again on load.
// - scheduler: as DataParallelCheckpointIO.
// Which parameters are sharded is found by walking the module tree: any colossal::nn::Module
// with a ShardSpec whose full_shape differs from its local one along one dimension (a user's
// model built from the project's layers works); everything else is replicated and written once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/dist/communicator.h"

namespace torch::nn {
class Module;
}
namespace colossal::nn {
class Module;
}

namespace colossal::booster {

// A parameter split over a tensor-parallel group: its layer, the layer's name for it, the
// unsharded shape and the dimension along which ranks hold different slices.
struct ShardedParameter {
  nn::Module* module = nullptr;
  std::string key;
  std::vector<int64_t> full_shape;
  int64_t dim = 0;
  dist::Communicator group;  // the spec's group (the IO's tp group for a storage-only spec)
};

// Every sharded parameter under `root`, by its state name ("model.layers.0.mlp.up_proj.weight").
// A spec whose group contradicts its rank/world, or a shard that differs from its full shape in
// more than one dimension, is an Error naming the parameter.
std::map<std::string, ShardedParameter> find_sharded_parameters(torch::nn::Module& root,
                                                                const dist::Communicator& tp);

class TensorParallelCheckpointIO : public CheckpointIO {
 public:
  // tp: the group the layers are sharded over (every sharded parameter's group must have its
  // members); dp: the data-parallel group (ranks holding the same slices; may be invalid when
  // there is none). InputError when tp is invalid.
  TensorParallelCheckpointIO(dist::Communicator tp, dist::Communicator dp);

  // The model whose parameters the optimizer states belong to (save_optimizer/load_optimizer
  // find each state's slicing through it; the optimizer alone does not know its layers). The
  // plugin sets it when it boosts the model; held weakly. save_model/load_model take the model
  // they are given and do not need it.
  void set_model(std::shared_ptr<torch::nn::Module> model);

  void save_model(ModelWrapper& model, const std::string& dir, bool shard,
                  int64_t size_per_shard_mb) override;
  void load_model(ModelWrapper& model, const std::string& path, bool strict,
                  OptimizerWrapper* optimizer) override;
  void save_optimizer(OptimizerWrapper& optimizer, const std::string& dir) override;
  void load_optimizer(OptimizerWrapper& optimizer, const std::string& dir) override;
  void save_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) override;
  void load_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) override;

  // What the last save_model / save_optimizer materialised on this rank beyond the training
  // state, counted where the buffers are made and released (the memory bound's evidence).
  struct SaveStats {
    int64_t gathered = 0;               // full tensors assembled from slices here
    int64_t peak_full_tensors = 0;      // most assembled full tensors alive at once
    uint64_t peak_bytes = 0;            // most bytes of full tensors + shard buffers alive at once
    uint64_t largest_full_bytes = 0;    // the largest full tensor assembled here
    uint64_t largest_buffer_bytes = 0;  // the largest shard receive/send buffer made here
  };
  const SaveStats& last_save_stats() const { return stats_; }

  const dist::Communicator& tp() const { return tp_; }
  const dist::Communicator& dp() const { return dp_; }

 private:
  std::shared_ptr<torch::nn::Module> model_for_optimizer(const char* what) const;

  dist::Communicator tp_, dp_;
  std::weak_ptr<torch::nn::Module> model_;
  SaveStats stats_;
};

}  // namespace colossal::booster
