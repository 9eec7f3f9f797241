// ZeRO stage 1/2 optimizer state: fp32 master weights, gradients and AdamW moments partitioned
// across the data-parallel group (ColossalAI's LowLevelZeroOptimizer, without its gaps).
//
// Partition: every parameter is flattened, padded with zeros to a multiple of the group size W
// and split into W equal slices of s = ceil(numel / W) elements; rank r owns elements
// [r*s, (r+1)*s) of every parameter (its "shard"). A rank keeps, per parameter, an fp32 master
// shard, an fp32 gradient shard and the optimizer's moments for that shard only, so optimizer
// memory is 1/W of the unsharded one plus at most W-1 padding elements per parameter. Padding
// elements carry zero gradients, so they never change and never enter the norm.
//
// Gradients arrive either as full averaged .grad of the working parameters (stage 1, after an
// all-reduce: take_full_grads() slices them) or as this rank's averaged slice (stage 2, from a
// reduce-scatter: add_grad_shard() accumulates into the fp32 shard, which is how no_sync
// accumulation stays exact). step() runs optim::adamw_update on the shards (hyper-parameters read
// from the wrapped optimizer's groups, so LR schedulers keep working) and all-gathers the updated
// masters, cast to the working dtype, into the working parameters in buckets — synchronously,
// or (overlap_allgather) launched asynchronously and finished by wait_params()/wait_all(), which
// the low_level_zero plugin calls from forward pre hooks and before any other access.
//
// Checkpoints are full-shape and named exactly as optim::Optimizer::state_dict() writes them
// ("<param>.exp_avg", "<param>.exp_avg_sq", "<param>.master" for half working params), gathered
// from the shards, so they load under any group size, ddp or a single process, and the reverse.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/amp/grad_reducer.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/dist/communicator.h"
#include "colossal/optim/optimizer.h"

namespace colossal::zero {

struct ZeroOptimizerOptions {
  // Master shards, gradient shards and moments live in (pinned, when the parameters are on a
  // GPU) CPU memory and the update runs on the CPU with optim::cpu_adam_update (SIMD, threaded),
  // which also writes the working-dtype shard to all-gather in the same pass.
  bool cpu_offload = false;
  // All-gather bucket size of the updated working weights, in elements.
  int64_t allgather_bucket_numel = 12 * 1024 * 1024;
  // step() launches the all-gathers of the updated weights asynchronously and returns; a
  // parameter's new value lands when wait_params()/wait_all() finishes the bucket holding it.
  // Only parameters marked deferrable (set_gather_plan) stay in flight after step(): the others'
  // buckets are still waited for before step() returns.
  bool overlap_allgather = false;
  // FP8 communication: the updated working weights are all-gathered in this format
  // (dist::all_gather_fp8: each rank's bucket slice with its own scale; every rank, the owner
  // too, takes the dequantized values, so replicas stay identical). The fp32 masters stay exact
  // and checkpoints are gathered exactly. One rank: no gather, no cast.
  c10::optional<at::ScalarType> fp8_allgather;
};

class LowLevelZeroOptimizer {
 public:
  // `inner`: the user's optimizer (AdamW), whose parameter groups, names and hyper-parameters
  // are used; it keeps no state itself. `masters`: (name, fp32 full value) of every parameter
  // before its cast to the working dtype (missing names: taken from the parameter).
  LowLevelZeroOptimizer(std::shared_ptr<optim::Optimizer> inner, dist::Communicator comm,
                        const std::vector<std::pair<std::string, at::Tensor>>& masters,
                        ZeroOptimizerOptions options = {});
  ~LowLevelZeroOptimizer();

  int world() const { return world_; }
  int rank() const { return rank_; }
  size_t num_params() const { return params_.size(); }
  // Index of a parameter (by its TensorImpl), or -1 when the optimizer does not hold it.
  int64_t index_of(const at::Tensor& param) const;
  // Elements per shard of parameter i: ceil(numel / world).
  int64_t shard_numel(size_t i) const;

  // Stage 2: adds this rank's averaged gradient slice of parameter i (shard_numel(i) elements,
  // any floating dtype) to its fp32 gradient shard.
  void add_grad_shard(size_t i, const at::Tensor& slice);
  // Stage 1: slices the full (already averaged) .grad of every parameter that has one into its
  // gradient shard and drops the .grad. Idempotent until the next zero_grad()/step().
  void take_full_grads();

  // Parameter i's gradient shard as it is held now (shard_numel(i) elements, fp32 or, on one
  // rank, the working dtype), undefined when it has no gradient this step (for tests and
  // inspection; the values are averaged over the group).
  at::Tensor grad_shard(size_t i) const;
  // Global L2 norm of the gradients / scale: fp64 sum of squares of the shards, SUM all-reduced
  // by the norm reducer (inf/nan on any rank makes it non-finite on every rank).
  double grad_norm(double scale);
  // The norm reducer (default: over the sharding group, axis "dp"); a composed one also sums
  // over tensor / pipeline ranks. `replicated_over(name)`: the reducer axes over which that
  // parameter is the same on every rank (counted on rank 0 of each; default: none).
  using ReplicatedAxes = std::function<std::vector<std::string>(const std::string& name)>;
  void set_norm_reducer(amp::GradReducer reducer, ReplicatedAxes replicated_over = {});
  // One AdamW update of the shards with every gradient divided by `divisor`, then the all-gather
  // of the working parameters. Parameters without a gradient (on every rank) are skipped.
  void step(double divisor);
  // Marks the gradient shards empty (the next gradient overwrites them) and drops any .grad left
  // on the working parameters.
  void zero_grad();

  // Overlapped all-gather (options.overlap_allgather). `position[i]`: order in which parameter i
  // is first used by forward (buckets are launched in that order); `deferrable[i]`: something
  // (a forward pre hook) calls wait_params() before parameter i is read, so its gather may stay
  // in flight after step(). Both sized num_params(); default: declaration order, none deferrable.
  void set_gather_plan(std::vector<int64_t> position, std::vector<bool> deferrable);
  // Finishes the in-flight all-gather buckets holding these parameters (writes their new
  // values); a no-op for parameters with none in flight.
  void wait_params(const std::vector<size_t>& which);
  // Finishes every in-flight all-gather. step(), the gradient intake, grad_norm(), state_dict(),
  // load_state_dict(), sync_masters_from_params() and the destructor call it first (zero_grad()
  // touches no weight and leaves the gathers running).
  void wait_all();
  // wait_all(), then, when the working parameters came from an FP8 all-gather, all-gathers them
  // again exactly (the masters cast to the working dtype): what checkpoint saves and loads read
  // (the plugin's wait_weights). Collective when it gathers (every rank calls it).
  void exact_weights();
  // Number of all-gather buckets still in flight (for tests).
  size_t gathers_in_flight() const;

  // Full-shape state (collective: every rank calls it; every rank gets the whole dict).
  optim::StateDict state_dict() const;
  // Loads a full-shape state written by state_dict() or by optim::Optimizer::state_dict() of
  // the same optimizer type; each rank keeps its slices. Working parameters follow the masters.
  void load_state_dict(const optim::StateDict& state);
  // Streamed checkpoints (bounded memory): state_plan() declares the tensors state_dict() would
  // hold (same names and order, fp32, full shapes) and fills `scalars` (its scalars), without
  // any communication; gather_state(i) then assembles tensor i of that list on group rank `dst`
  // only (collective: every rank calls it with the same i after the same state_plan(); the
  // others get an undefined tensor). A rank never holds more than one full tensor.
  std::vector<checkpoint::TensorDecl> state_plan(json::Value* scalars);
  at::Tensor gather_state(size_t i, int dst);
  // load_state_dict read tensor by tensor: each rank reads only its slices, into the shards it
  // has (no second copy of the state). Names and shapes are checked before anything changes.
  void load_state(const optim::StateSource& source);
  // Master shards re-taken from the working parameters (after a model checkpoint load).
  void sync_masters_from_params();

  // Accounting: bytes this rank holds in optimizer state (masters + moments) and in gradient
  // shards; and the same figures for the whole model unsharded (fp32 masters, two moments).
  int64_t state_bytes() const;
  int64_t grad_shard_bytes() const;
  int64_t padded_numel() const;  // sum over parameters of world * shard_numel
  int64_t total_numel() const;

  optim::Optimizer& inner() { return *inner_; }

 private:
  struct Param {
    std::string name;
    at::Tensor param;  // working parameter (full)
    size_t group;
    at::Tensor master, grad, exp_avg, exp_avg_sq;  // shards (fp32, shard device)
    // One rank, no offload: the step's only gradient kept as it came (the working-dtype .grad
    // itself), instead of copied into the fp32 `grad` shard, which is allocated only when a
    // second micro-step has to be added.
    at::Tensor held;
    // cpu_offload on CUDA: the step's only gradient's sum of squares (fp64, on the device),
    // taken before the copy down so the norm never reads the host shard; undefined otherwise.
    at::Tensor grad_sq;
    at::Tensor working;  // cpu_offload: the updated shard in the working dtype (CPU Adam writes it)
    bool has_grad = false;
    int64_t step = 0;
  };
  at::Tensor slice_of(const at::Tensor& full, size_t i) const;    // this rank's fp32 slice
  at::Tensor local_part(const at::Tensor& flat, size_t i) const;  // its unpadded elements
  at::Tensor gather_full(const at::Tensor& shard, size_t i) const;
  at::Tensor gather_to(const at::Tensor& shard, size_t i, int dst);  // on dst only
  void all_gather_params(std::vector<size_t> which);
  struct Gather;  // one all-gather bucket: its Work, buffers and parameters
  void finish_gather(Gather& g);
  at::Tensor new_shard(size_t i) const;
  // Takes gradient part `g` (shard_numel elements of parameter i, any float dtype) into the
  // shard: held, copied or added.
  void intake(size_t i, const at::Tensor& g);
  // Whether parameter i is updated in place by the fused AdamW (direct_, half, contiguous).
  bool writes_working(size_t i) const;
  const at::Tensor& grad_of(const Param& p) const { return p.held.defined() ? p.held : p.grad; }

  std::shared_ptr<optim::Optimizer> inner_;
  dist::Communicator comm_;
  ZeroOptimizerOptions options_;
  amp::GradReducer reducer_;
  ReplicatedAxes replicated_;
  int world_ = 1, rank_ = 0;
  // One rank, shards on the parameters' device: gradients are held (Param::held) and half
  // parameters are written by the fused AdamW itself (no all-gather copy).
  bool direct_ = false;
  at::Device shard_device_{at::kCPU};
  bool pin_ = false;
  std::vector<Param> params_;
  bool grads_taken_ = false;
  bool fp8_weights_ = false;  // some working parameters hold FP8-gathered values
  std::vector<int64_t> position_;
  std::vector<bool> deferrable_;
  std::vector<std::unique_ptr<Gather>> gathers_;  // in flight, launch order
  std::vector<Gather*> gather_of_;                // per parameter: its in-flight bucket or null
  std::vector<std::pair<size_t, int>> plan_;      // state_plan(): (parameter, 0 master / 1 / 2)
};

}  // namespace colossal::zero
