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
// Pipeline parallelism (pp_size > 1): the model (a models::CausalLM) is cut into pp_size *
// num_model_chunks virtual stages; each pipeline rank keeps only its chunks' blocks (names
// unchanged; a tied head's last stage keeps a copy of the embedding weight, whose gradient is
// summed over the first and last stage and counted once in the norm), then the tp plan and SP
// cores apply to what it holds. Booster::execute_pipeline runs one step of the schedule (pp_style
// or a user's table, pipeline/schedule.h) through pipeline::Executor. ZeRO with pp: stage <= 1
// (ColossalAI's rule, kept: the gradients must stay whole until the last micro-batch's
// backward, so ZeRO-2's reduce-scatter during backward frees nothing that stage 1 keeps).
//
// Not yet (each refused with a named InputError): split_gather / ring with a tied embedding (the
// embedding stays whole, so nothing splits the sequence); overlap_allgather; custom_plan with
// pp_size > 1; forward-only pipeline steps (execute_pipeline needs grad mode).
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
#include "colossal/pipeline/schedule.h"

namespace colossal {
class OptionSet;
}
namespace colossal::models {
struct ModelConfig;
class CausalLM;
}  // namespace colossal::models
namespace colossal::booster {

// ColossalAI's HybridParallelPlugin arguments that apply here, with its names and defaults
// (sp_size None -> 1, inner_ring_size None -> 0).
struct HybridOptions {
  int64_t tp_size = 1;
  int64_t pp_size = 1;
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
  // Pipeline (pp_size > 1), ColossalAI's names: one of num_microbatches / microbatch_size (the
  // batch each execute_pipeline call gets is split into them); pp_style "1f1b", "gpipe",
  // "interleaved" (num_model_chunks > 1), "zbh1" or "zbv" (num_model_chunks 2).
  int64_t num_microbatches = 0;
  int64_t microbatch_size = 0;
  std::string pp_style = "1f1b";
  int64_t num_model_chunks = 1;
  // Decoder layers per virtual stage ("8,8,8,8"; empty: ColossalAI's distribute_layers, or the
  // cost-balanced split when pp_balance is "cost": the embedding and the LM head with its loss
  // counted by their FLOPs).
  std::string num_layers_per_stage;
  std::string pp_balance = "layers";  // "layers" (distribute_layers) or "cost"
  // A user's schedule table (CSV or JSON, pipeline/schedule.h) instead of pp_style's generator.
  std::string pp_schedule_table;
  bool enable_metadata_cache = true;
  // Activation checkpointing per virtual stage (ColossalAI's gradient_checkpoint_config
  // num_ckpt_layers_per_stage, "2,1"; entry stage + chunk * pp_size): the first n decoder layers
  // of that chunk recompute in backward (full recompute). Empty: the model's own setting stays.
  std::string num_ckpt_layers_per_stage;
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
  // num_layers_per_stage / num_ckpt_layers_per_stage as numbers (InputError naming the option).
  std::vector<int64_t> layers_per_stage() const;
  std::vector<int64_t> ckpt_layers_per_stage() const;
  bool non_default_layout() const;  // any of tp/pp/sp/mode/enable/zero_stage set
};

// The last pipeline step, measured and simulated (HybridParallelPlugin::pipeline_profile).
struct PipelineProfile {
  pipeline::Costs costs;          // per-rank mean F, B, W seconds (BW counted as B, W = 0)
  double measured = 0;            // the step's wall time (the slowest pipeline rank), seconds
  pipeline::SimResult simulated;  // the schedule simulated with `costs`
};

// What a rank holds, in bytes (HybridParallelPlugin::memory_report): measured from the tensors.
struct HybridMemoryReport {
  int64_t parameter_bytes = 0;  // the model's parameters on this rank (tp shards, working dtype)
  int64_t gradient_bytes = 0;   // .grad of those parameters plus ZeRO's fp32 gradient shards
  int64_t optimizer_bytes = 0;  // fp32 masters and AdamW moments (ZeRO: this rank's shards)
};

class TensorParallelCheckpointIO;
class PipelineState;

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
  // pp_size > 1: Booster::execute_pipeline runs the schedule (see execute_pipeline below).
  bool support_pipeline() const override { return options_.pp_size > 1; }
  // LoRA: the plan shards each adapter with its base (nn::LoraLinear::shard), pipeline stages
  // hold their layers' adapters, and the checkpoint IO gathers them whole.
  bool support_lora() const override { return true; }
  Precision precision() const override { return precision_; }
  std::string device() const override { return options_.device; }
  // The dp axis: tp and sp peers read the same samples.
  int dp_rank() const override;
  int dp_size() const override;
  // tp_size 1 and pp_size 1: DataParallelCheckpointIO. Otherwise TensorParallelCheckpointIO over
  // the tp, data-parallel and pp groups (each stage writes its tensors under one HF index; the
  // same tensors and optimizer file from any layout, so runs resume across layouts).
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
  // One step through the pipeline: the batch is split into micro-batches (each through
  // local_batch), the schedule runs on the pp group, then (unless inside no_sync) the tied
  // embedding's gradient is summed over its first and last stage and the gradients are
  // synchronised over the data-parallel group (all-reduce, or ZeRO-1's). The loss is broadcast
  // from the last stage to every pipeline rank.
  PipelineOutput execute_pipeline(const BatchIterator& data_iter, ModelWrapper& model,
                                  const Criterion& criterion, OptimizerWrapper* optimizer,
                                  bool return_loss, bool return_outputs,
                                  const PipelineStep& step) override;
  // The schedule a step of `microbatches` micro-batches runs (validated).
  const pipeline::Schedule& schedule(int microbatches);
  // Collective over the pp group: the last execute_pipeline step's per-instruction timings,
  // turned into per-rank costs and fed to the schedule simulator (what `colossal bench` prints).
  PipelineProfile pipeline_profile();
  // The decoder layers of each virtual stage for a model of `num_layers` layers.
  std::vector<int64_t> layers_per_virtual_stage(const models::ModelConfig& config,
                                                int64_t seq_len) const;

  const HybridOptions& options() const { return options_; }
  dist::ParallelDims& dims() { return *dims_; }
  dist::SequenceParallel sequence_parallel() const { return mode_; }
  // The bytes this rank holds now for a model and optimizer boosted by this plugin.
  HybridMemoryReport memory_report(ModelWrapper& model, OptimizerWrapper* optimizer) const;

 private:
  // Keeps this pipeline rank's chunks of the model (and the tied copy), checkpointing per stage.
  void cut_pipeline_stage(const std::shared_ptr<models::CausalLM>& model);

  HybridOptions options_;
  Precision precision_;
  dist::SequenceParallel mode_;
  std::shared_ptr<dist::ParallelDims> dims_;
  dist::Communicator world_;
  std::shared_ptr<TensorParallelCheckpointIO> tp_io_;  // tp_size > 1, made by checkpoint_io()
  std::unique_ptr<PipelineState> pipe_;                // pp_size > 1
};

}  // namespace colossal::booster
