// The `hybrid` plugin (ColossalAI's HybridParallelPlugin; `3d` in ColossalAI's benchmark):
// tensor parallelism over the tp axis of a (dp, pp, tp, sp) mesh in C order (dist::ParallelDims:
// TP peers are neighbouring ranks), Megatron sequence parallelism (split_gather) inside the TP
// group, and data parallelism over the dp axis with ZeRO 0, 1 or 2.
//
// What boost() does with a model (configure_model):
// - rank 0's whole model is broadcast to every rank, then the model's tensor-parallel plan
//   (models::tensor_parallel_plan) is applied in place over dims().tp(): every shard holds the
//   slice of the values the unsharded model has (layout-invariant init), whatever tp is;
// - parameters are cast to the working precision (fp32 masters kept for bf16/fp16);
// - gradients are averaged over the data-parallel group (dp x sp; dp when sp == 1): zero_stage 0
//   all-reduces them in buckets during backward (GradSync, as ddp), 1 and 2 hand them to
//   zero::LowLevelZeroOptimizer over that group (stage 2 reduce-scatters). no_sync accumulates
//   exactly under every stage.
// - the global gradient norm sums squares over dp, tp and pp, each tensor once: a tensor-parallel
//   shard is counted on every tp rank, a tensor replicated over tp (norm weights, a row-parallel
//   bias, an unsharded lm_head) on tp rank 0 only. A non-finite norm (fp16 overflow) is seen by
//   every rank, so every rank skips the step.
//
// Sequence parallelism, decided here rather than ColossalAI's silent default: SP is on when
// `sequence_parallelism_mode` names a mode. `enable_sequence_parallelism` without a mode is an
// InputError (ColossalAI picks all_to_all in the plugin but split_gather in ShardConfig, so a
// run must say which). `colossal bench -p 3d` keeps ColossalAI's benchmark default (--sp_mode
// all_to_all when --sp > 1) and prints it.
//
// split_gather (Megatron SP, tp > 1, sp_size 1): the vocab-parallel embedding reduce-scatters the
// sequence, norms and residuals run on sequence shards, column linears gather it and row linears
// reduce-scatter it. local_batch() gives a rank the targets of its sequence shard and the weight
// 1/tp: it backpropagates its tokens' share of the global mean. Backward then yields the whole
// gradient on tp shards (and on key/value heads replicated over tp, which their layer sums) and a
// per-shard part on tp-whole parameters (norm weights, a row-parallel bias, an unsharded
// lm_head); gradient hooks installed here sum those over tp (ColossalAI's sp_partial_derived
// all-reduce), so .grad holds the gradient of the mean loss over the whole sequence.
//
// ring (the sequence gather / reduce-scatter overlapped with the GEMMs in chunks) is handled
// exactly as split_gather here. Key/value heads fewer than tp are replicated by the layers (their
// gradients summed over the sharing ranks there); the norm counts them once per replica group.
//
// Not yet (each refused with a named InputError): pp_size > 1 (pipelines come with their own
// issue); the all_to_all and ring_attn modes (their attention cores are built by other work;
// local_batch() is their seam); split_gather / ring with a tied embedding (the embedding stays
// whole, so nothing splits the sequence); overlap_allgather.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugin.h"
#include "colossal/booster/wrappers.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/nn/plan.h"

namespace colossal {
class OptionSet;
}
namespace colossal::booster {

// ColossalAI's HybridParallelPlugin arguments that apply here, with its names and defaults
// (sp_size None -> 1, inner_ring_size None -> 0).
struct HybridOptions {
  int64_t tp_size = 1;
  int64_t pp_size = 1;  // must be 1: pipeline parallelism is not available yet
  int64_t sp_size = 1;  // the sp axis (all_to_all / ring_attn); 1 for split_gather / ring
  // "" (no mode chosen: SP off), "split_gather", "ring", "all_to_all" or "ring_attn".
  std::string sequence_parallelism_mode;
  bool enable_sequence_parallelism = false;  // true needs a mode (see the header comment)
  int64_t zero_stage = 0;                    // 0, 1 or 2 over the data-parallel group
  std::string precision = "fp16";            // ColossalAI's default; `colossal train`: fp32
  std::string device = "cpu";
  // The vocab-parallel lm_head and the vocabulary padding read these two.
  bool parallel_output = true;
  int64_t make_vocab_size_divisible_by = 64;
  int64_t inner_ring_size = 0;  // ring_attn's double ring (0: ColossalAI's None)
  // ColossalAI's custom_policy: the tensor-parallel plan of a user's own model built from our
  // layers (nn::Linear, nn::Embedding, ...), rules by module-path pattern, applied over tp
  // instead of a models::CausalLM's plan (for which it replaces the built-in plan). The model's
  // code is not edited. Sequence parallelism needs the built-in plans (a named error otherwise).
  nn::ParallelPlan custom_plan;
  LossScaleOptions loss_scale;        // fp16: initial_scale 2**16, ... (ColossalAI's Hybrid values)
  double max_norm = 0.0;              // clip every step at this global norm (0: off)
  double zero_bucket_size_in_m = 12;  // ZeRO gradient bucket, millions of elements
  double ddp_bucket_cap_mb = 25;      // zero_stage 0 gradient bucket, MB
  std::string communication_dtype;    // "" (the gradients' own), "fp32", "bf16", "fp16"
  bool overlap_communication = true;  // launch gradient buckets while backward runs
  bool cpu_offload = false;           // ZeRO: masters, gradient shards and moments on the CPU

  // Registers the hybrid-only fields under section "plugin": tp_size (--tp), pp_size (--pp),
  // sp_size (--sp), sequence_parallelism_mode (--sp_mode), enable_sequence_parallelism,
  // zero_stage (--zero), parallel_output, make_vocab_size_divisible_by, inner_ring_size,
  // max_norm, zero_bucket_size_in_m. Precision, loss scale, bucket_cap_mb, communication_dtype,
  // overlap_communication and cpu_offload are the flags the other plugins register (the factory
  // copies them in).
  void register_options(OptionSet& set);
  // The sequence-parallel mode these options ask for (InputError: enable without a mode).
  dist::SequenceParallel sequence_parallel() const;
  // The mesh degrees over `world_size` ranks (dp = world / (tp * pp * sp)). InputError naming the
  // option: pp_size > 1, a size < 1, a world size not divisible by tp * pp * sp, and everything
  // ParallelDims::validate refuses (modes that need tp > 1 or sp > 1, ...).
  dist::ParallelDegrees degrees(int world_size) const;
  // Range and combination checks that need no world size or model.
  void validate() const;
  bool non_default_layout() const;  // any of tp/pp/sp/mode/enable/zero_stage set
};

// What a rank holds, in bytes (HybridParallelPlugin::memory_report): measured from the tensors.
struct HybridMemoryReport {
  int64_t parameter_bytes = 0;  // the model's parameters on this rank (tp shards, working dtype)
  int64_t gradient_bytes = 0;   // .grad of those parameters plus ZeRO's fp32 gradient shards
  int64_t optimizer_bytes = 0;  // fp32 masters and AdamW moments (ZeRO: this rank's shards)
};

class TensorParallelCheckpointIO;

class HybridParallelPlugin : public Plugin {
 public:
  // The mesh `dims` (its degrees must be options.degrees(world)); built over dist::world() by the
  // second constructor.
  HybridParallelPlugin(HybridOptions options, std::shared_ptr<dist::ParallelDims> dims);
  explicit HybridParallelPlugin(HybridOptions options);
  ~HybridParallelPlugin() override;

  std::string name() const override { return "hybrid"; }
  std::vector<Precision> supported_precisions() const override;
  std::vector<std::string> supported_devices() const override { return {"cpu", "cuda"}; }
  bool support_no_sync() const override { return true; }
  Precision precision() const override { return precision_; }
  std::string device() const override { return options_.device; }
  // The dp axis: tp and sp peers read the same samples.
  int dp_rank() const override;
  int dp_size() const override;
  // tp_size 1: DataParallelCheckpointIO. tp_size > 1: TensorParallelCheckpointIO over the tp and
  // data-parallel groups (the same files from any layout, so runs resume across layouts).
  bool control_checkpoint_io() const override { return true; }
  std::shared_ptr<CheckpointIO> checkpoint_io() override;
  // split_gather (and ring): the targets of this rank's sequence shard (tp rank r of tp holds
  // tokens [r S/tp, (r+1) S/tp)) and loss_weight 1 (the vocab-parallel head's loss is the whole
  // step's, gathered over the sequence); the inputs stay whole (the embedding
  // splits them). InputError when the sequence length is not divisible by tp. Identity otherwise.
  LocalBatch local_batch(const at::Tensor& inputs, const at::Tensor& targets) const override;

  std::shared_ptr<ModelWrapper> configure_model(std::shared_ptr<torch::nn::Module> model) override;
  std::shared_ptr<OptimizerWrapper> configure_optimizer(std::shared_ptr<optim::Optimizer> optimizer,
                                                        ModelWrapper& model) override;

  const HybridOptions& options() const { return options_; }
  dist::ParallelDims& dims() { return *dims_; }
  dist::SequenceParallel sequence_parallel() const { return mode_; }
  // The bytes this rank holds now for a model and optimizer boosted by this plugin.
  HybridMemoryReport memory_report(ModelWrapper& model, OptimizerWrapper* optimizer) const;

 private:
  HybridOptions options_;
  Precision precision_;
  dist::SequenceParallel mode_;
  std::shared_ptr<dist::ParallelDims> dims_;
  dist::Communicator world_;
  std::shared_ptr<TensorParallelCheckpointIO> tp_io_;  // tp_size > 1, made by checkpoint_io()
};

}  // namespace colossal::booster
