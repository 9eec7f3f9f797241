// Checkpoint IO of tensor-parallel layouts (ColossalAI's HybridParallelCheckpointIO; pipeline
// stages below). It writes exactly the files DataParallelCheckpointIO writes for the same
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
//   parameter name, streamed as the model is: OptimizerWrapper::full_state_plan declares the
//   states (this rank's tensor-parallel slice of each), and each is made whole over ZeRO's
//   data-parallel group on dp rank 0 (full_state_tensor, one at a time, the other dp ranks only
//   send) just before the tp gather that writes it, so a save holds one state tensor beyond
//   training memory, never the whole state. Loads read through a StateSource over the mapped
//   file that cuts each rank's tp slice row by row (read_slice gives the pages back), so the
//   optimizer (ZeRO: only its dp shard) copies its own elements in place; the model's load
//   gives each tensor's pages back after copying its slice.
// - scheduler: as DataParallelCheckpointIO.
// Which parameters are sharded is found by walking the module tree: any colossal::nn::Module
// with a ShardSpec whose full_shape differs from its local one along one dimension (a user's
// model built from the project's layers works); everything else is replicated and written once.
//
// Pipeline stages (the (tp, dp, pp) constructor, pp > 1). A stage is saved as a tensor-parallel
// group is (the same gathers, slices and full-shape optimizer states) with one level on top, so
// this class takes an optional pp group rather than a PipelineCheckpointIO duplicating it; tp
// may be a group of one. Every rank holds only its stage's tensors (CausalLM::keep_blocks, or
// any module whose state names are the whole model's); the stages' names are gathered over pp,
// and a name held by several stages (a tied embedding's copy on the last stage) belongs to the
// lowest stage holding it. What is written:
// - model: always the sharded HF form, whatever `shard` says: the writer of each stage (tp rank
//   0 of its dp rank 0 group, dp being dp x sp under sequence parallelism) streams the tensors its
//   stage owns into its own `model-0000k-of-0000N.safetensors` files (one per stage, or several
//   when shard=true cuts at size_per_shard_mb; k runs over the stages in order), and global rank 0
//   writes one `model.safetensors.index.json` (every tensor once, metadata.total_size in bytes) and
//   config.json. Atomic as a folder: global rank 0 stages `dir` (checkpoint::StagedDirectory),
//   the stage writers write into the staging folder, and after a barrier rank 0 adds the index
//   and swaps the folder into place (files of an existing `dir` that are not model files, e.g.
//   optimizer states saved there, are carried over by hard link). A crash leaves the previous
//   `dir` intact. The stage writers need a file system they all see (a shared one across
//   hosts).
// - load: any layout's files (one file, index + shards, HF's own): every rank opens only the
//   shards holding its stage's tensors and copies its slices; both holders of a shared name get
//   it. strict: a tensor of this stage missing from the files, or a file tensor that no stage
//   holds (checked over pp), is an InputError raised on every rank, naming the stage and the
//   tensors.
// - optimizer: the same single `optimizer.safetensors` + `optimizer.json` as every other layout
//   (so DataParallelCheckpointIO and the pp = 1 path read it unchanged, and it reads theirs):
//   each stage writer streams its stage's full-shape states, tensor by tensor in file order, to
//   global rank 0 over the pp group of rank 0 (stage writers are its members), which writes one
//   file holding one full tensor at a time; the stages' scalars (param_groups, steps) are merged
//   in stage order. Loading keeps the states and group entries of this stage's parameters.
// With a pp group of one (or none) every method is exactly the tensor-parallel one: the files
// are byte-identical to those written without pp.
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
  // With pipeline stages: pp, the group of the ranks holding the same slices of the other stages
  // (its group rank is the stage index). tp, dp and pp must be orthogonal axes of one mesh with
  // global rank 0 at tp rank 0 of stage 0 (InputError otherwise; checked here, no
  // communication). The hybrid plugin, whenever tp > 1 or pp > 1:
  //   TensorParallelCheckpointIO(dims.tp(), sp > 1 ? dims.dp_sp() : dims.dp(), dims.pp())
  // then set_model(stage module) when it boosts the model, as for tp alone.
  TensorParallelCheckpointIO(dist::Communicator tp, dist::Communicator dp, dist::Communicator pp);

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
  // The selected tensors whole on global rank 0 (CheckpointIO::gather_model_tensors): each
  // sharded one assembled from its tp slices on the stage writer (tp rank 0 of dp rank 0, by the
  // layer's own shard_slice, as save_model does), later stages' sent to rank 0 over pp (a name
  // two stages hold, e.g. a tied embedding, once). Stage 0's tensors in module_state() order,
  // then each later stage's.
  checkpoint::TensorList gather_model_tensors(
      ModelWrapper& model, const std::function<bool(const std::string&)>& select) override;

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
  const dist::Communicator& pp() const { return pp_; }
  // Whether saves and loads go through the stage level (a pp group of more than one rank).
  bool pipelined() const { return pp_.valid() && pp_.size() > 1; }

 private:
  std::shared_ptr<torch::nn::Module> model_for_optimizer(const char* what) const;

  dist::Communicator tp_, dp_, pp_;
  std::weak_ptr<torch::nn::Module> model_;
  SaveStats stats_;
};

}  // namespace colossal::booster
