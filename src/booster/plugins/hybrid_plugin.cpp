// The hybrid plugin (see hybrid_plugin.h).
#include "colossal/booster/plugins/hybrid_plugin.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "booster/plugins/plugin_common.h"
#include "colossal/amp/grad_reducer.h"
#include "colossal/amp/grad_scaler.h"
#include "colossal/booster/grad_sync.h"
#include "colossal/booster/plugins/low_level_zero_plugin.h"
#include "colossal/booster/tensor_parallel_checkpoint_io.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/costs.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/lora.h"
#include "colossal/nn/module.h"
#include "colossal/nn/plan.h"
#include "colossal/nn/sequence_parallel.h"
#include "colossal/optim/optimizer.h"
#include "colossal/pipeline/executor.h"
#include "colossal/pipeline/layers.h"
#include "colossal/pipeline/schedule.h"
#include "colossal/zero/low_level_optim.h"

namespace colossal::booster {

using dist::SequenceParallel;

void HybridOptions::register_options(OptionSet& set) {
  set.add("plugin", "tp_size", &tp_size, "hybrid: tensor parallel size")
      .alias("tp_size", "tp")
      .add("plugin", "pp_size", &pp_size, "hybrid: pipeline stages")
      .alias("pp_size", "pp")
      .add("plugin", "sp_size", &sp_size,
           "hybrid: sequence parallel axis size (all_to_all / ring_attn; 1 for split_gather)")
      .alias("sp_size", "sp")
      .add("plugin", "sequence_parallelism_mode", &sequence_parallelism_mode,
           "hybrid: sequence parallelism mode (naming one turns SP on; '' = off)",
           {"", "off", "split_gather", "ring", "all_to_all", "ring_attn"})
      .alias("sequence_parallelism_mode", "sp_mode")
      .add("plugin", "enable_sequence_parallelism", &enable_sequence_parallelism,
           "hybrid: sequence parallelism on (needs --sequence_parallelism_mode)")
      .add("plugin", "zero_stage", &zero_stage,
           "hybrid: ZeRO stage over the data-parallel group (0, 1 or 2)")
      .alias("zero_stage", "zero")
      .add("plugin", "parallel_output", &parallel_output,
           "hybrid: keep the vocab-parallel logits split (false: gather them)")
      .add("plugin", "make_vocab_size_divisible_by", &make_vocab_size_divisible_by,
           "hybrid: pad the vocabulary to a multiple of this times tp")
      .add("plugin", "inner_ring_size", &inner_ring_size,
           "hybrid: ring_attn inner ring size (0: one ring)")
      .add("plugin", "max_norm", &max_norm,
           "hybrid: clip the global gradient norm at every step (0: off)")
      .add("plugin", "zero_bucket_size_in_m", &zero_bucket_size_in_m,
           "hybrid: ZeRO gradient bucket size in millions of elements")
      .add("plugin", "num_microbatches", &num_microbatches,
           "hybrid pp: micro-batches per pipeline step (or --microbatch_size)")
      .add("plugin", "microbatch_size", &microbatch_size,
           "hybrid pp: rows per micro-batch (or --num_microbatches)")
      .alias("microbatch_size", "mbs")
      .add("plugin", "pp_style", &pp_style, "hybrid pp: schedule",
           {"1f1b", "gpipe", "interleaved", "zbh1", "zbv"})
      .add("plugin", "num_model_chunks", &num_model_chunks,
           "hybrid pp: model chunks per stage (interleaved > 1, zbv 2)")
      .alias("num_model_chunks", "n_chunks")
      .add("plugin", "num_layers_per_stage", &num_layers_per_stage,
           "hybrid pp: decoder layers per virtual stage, e.g. 8,8,8,8 (default: even)")
      .add("plugin", "pp_balance", &pp_balance,
           "hybrid pp: default layer split: layers (ColossalAI's) or cost (counts embedding, "
           "head and loss)",
           {"layers", "cost"})
      .add("plugin", "pp_schedule_table", &pp_schedule_table,
           "hybrid pp: a schedule table (CSV or JSON) instead of --pp_style")
      .add("plugin", "enable_metadata_cache", &enable_metadata_cache,
           "hybrid pp: send shapes once per step")
      .add("plugin", "num_ckpt_layers_per_stage", &num_ckpt_layers_per_stage,
           "hybrid pp: activation-checkpointed layers per stage, e.g. 2,1");
  set.min("num_microbatches", 0).min("microbatch_size", 0).min("num_model_chunks", 1);
  set.min("tp_size", 1).min("pp_size", 1).min("sp_size", 1).min("zero_stage", 0);
  set.max("zero_stage", 2)
      .min("make_vocab_size_divisible_by", 1)
      .min("inner_ring_size", 0)
      .min("max_norm", 0)
      .min("zero_bucket_size_in_m", 1e-6);
}

dist::SequenceParallel HybridOptions::sequence_parallel() const {
  if (sequence_parallelism_mode.empty()) {
    COLOSSAL_CHECK_INPUT(!enable_sequence_parallelism,
                         "hybrid: enable_sequence_parallelism needs sequence_parallelism_mode "
                         "(split_gather, ring, all_to_all or ring_attn): ColossalAI defaults to "
                         "all_to_all in its plugin but to split_gather in its ShardConfig, so "
                         "colossal.cpp asks which");
    return SequenceParallel::Off;
  }
  SequenceParallel m = dist::parse_sequence_parallel(sequence_parallelism_mode);
  COLOSSAL_CHECK_INPUT(!(enable_sequence_parallelism && m == SequenceParallel::Off),
                       "hybrid: enable_sequence_parallelism contradicts sequence_parallelism_mode "
                       "'",
                       sequence_parallelism_mode, "'");
  return m;
}

void HybridOptions::validate() const {
  COLOSSAL_CHECK_INPUT(tp_size >= 1 && pp_size >= 1 && sp_size >= 1,
                       "hybrid: tp_size, pp_size and sp_size must be >= 1, got ", tp_size, ", ",
                       pp_size, ", ", sp_size);
  COLOSSAL_CHECK_INPUT(num_microbatches >= 0 && microbatch_size >= 0 && num_model_chunks >= 1,
                       "hybrid: num_microbatches and microbatch_size must be >= 0 and "
                       "num_model_chunks >= 1, got ",
                       num_microbatches, ", ", microbatch_size, ", ", num_model_chunks);
  COLOSSAL_CHECK_INPUT(pp_balance == "layers" || pp_balance == "cost",
                       "hybrid: pp_balance must be 'layers' or 'cost', got '", pp_balance, "'");
  if (pp_size > 1) {
    COLOSSAL_CHECK_INPUT(zero_stage <= 1, "hybrid: zero_stage=", zero_stage,
                         " with pp_size=", pp_size,
                         ": pipelines take ZeRO stage 0 or 1 (the gradients stay whole until "
                         "the last micro-batch, so stage 2 would save nothing)");
    COLOSSAL_CHECK_INPUT((num_microbatches > 0) != (microbatch_size > 0),
                         "hybrid: pp_size=", pp_size,
                         " needs exactly one of num_microbatches and microbatch_size, got ",
                         num_microbatches, " and ", microbatch_size);
    COLOSSAL_CHECK_INPUT(custom_plan.empty(),
                         "hybrid: custom_plan with pp_size > 1 (pipeline stages are cut from "
                         "models::CausalLM's blocks)");
    if (pp_schedule_table.empty()) {
      const bool chunks_ok = pp_style == "interleaved" ? num_model_chunks > 1
                             : pp_style == "zbv"       ? num_model_chunks == 2
                                                       : num_model_chunks == 1;
      COLOSSAL_CHECK_INPUT(chunks_ok, "hybrid: pp_style ", pp_style,
                           " with num_model_chunks=", num_model_chunks,
                           " (1f1b, gpipe and zbh1 take 1 chunk, interleaved more than 1, zbv "
                           "exactly 2)");
    }
  } else {
    COLOSSAL_CHECK_INPUT(num_layers_per_stage.empty() && num_ckpt_layers_per_stage.empty() &&
                             pp_schedule_table.empty() && num_model_chunks == 1,
                         "hybrid: num_layers_per_stage, num_ckpt_layers_per_stage, "
                         "pp_schedule_table and num_model_chunks need pp_size > 1");
  }
  layers_per_stage();
  ckpt_layers_per_stage();
  COLOSSAL_CHECK_INPUT(zero_stage >= 0 && zero_stage <= 2,
                       "hybrid: zero_stage must be 0, 1 or 2, got ", zero_stage);
  COLOSSAL_CHECK_INPUT(make_vocab_size_divisible_by >= 1,
                       "hybrid: make_vocab_size_divisible_by must be >= 1, got ",
                       make_vocab_size_divisible_by);
  COLOSSAL_CHECK_INPUT(max_norm >= 0, "hybrid: max_norm must be >= 0, got ", max_norm);
  COLOSSAL_CHECK_INPUT(zero_bucket_size_in_m > 0 && ddp_bucket_cap_mb > 0,
                       "hybrid: bucket sizes must be > 0, got zero_bucket_size_in_m ",
                       zero_bucket_size_in_m, " and bucket_cap_mb ", ddp_bucket_cap_mb);
  const SequenceParallel m = sequence_parallel();
  COLOSSAL_CHECK_INPUT(inner_ring_size == 0 || m == SequenceParallel::RingAttn,
                       "hybrid: inner_ring_size=", inner_ring_size,
                       " applies to sequence_parallelism_mode ring_attn only, not '",
                       dist::to_string(m), "'");
  COLOSSAL_CHECK_INPUT(inner_ring_size == 0 || sp_size % inner_ring_size == 0,
                       "hybrid: inner_ring_size=", inner_ring_size,
                       " does not divide sp_size=", sp_size);
  COLOSSAL_CHECK_INPUT(!cpu_offload || zero_stage > 0,
                       "hybrid: cpu_offload needs zero_stage 1 or 2 (got 0)");
  precision_from_string(precision);
}

namespace {
std::vector<int64_t> parse_int_list(const std::string& text, const char* option) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    COLOSSAL_CHECK_INPUT(used == item.size() && !item.empty() && v >= 0, "hybrid: ", option, "='",
                         text, "': '", item,
                         "' is not a non-negative integer (a comma-separated list)");
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}
}  // namespace

std::vector<int64_t> HybridOptions::layers_per_stage() const {
  return parse_int_list(num_layers_per_stage, "num_layers_per_stage");
}
std::vector<int64_t> HybridOptions::ckpt_layers_per_stage() const {
  return parse_int_list(num_ckpt_layers_per_stage, "num_ckpt_layers_per_stage");
}

bool HybridOptions::non_default_layout() const {
  return tp_size != 1 || pp_size != 1 || sp_size != 1 || !sequence_parallelism_mode.empty() ||
         enable_sequence_parallelism || zero_stage != 0 || num_microbatches != 0 ||
         microbatch_size != 0 || pp_style != "1f1b" || num_model_chunks != 1 ||
         !num_layers_per_stage.empty() || pp_balance != "layers" || !pp_schedule_table.empty() ||
         !num_ckpt_layers_per_stage.empty();
}

dist::ParallelDegrees HybridOptions::degrees(int world_size) const {
  validate();
  const int64_t model_ranks = tp_size * pp_size * sp_size;
  COLOSSAL_CHECK_INPUT(world_size % model_ranks == 0, "hybrid: the world size ", world_size,
                       " is not divisible by tp_size * pp_size * sp_size = ", model_ranks,
                       " (tp_size ", tp_size, ", pp_size ", pp_size, ", sp_size ", sp_size, ")");
  dist::ParallelDegrees d;
  d.tp = static_cast<int>(tp_size);
  d.pp = static_cast<int>(pp_size);
  d.sp = static_cast<int>(sp_size);
  d.dp = static_cast<int>(world_size / model_ranks);
  d.sequence_parallel = sequence_parallel();
  dist::ParallelDims::validate(d, world_size);
  return d;
}

namespace {

at::Device device_of(const std::string& device) {
  return device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);
}

dist::ModelFacts facts_of(const models::ModelConfig& c) {
  dist::ModelFacts f;
  f.num_attention_heads = c.num_attention_heads;
  f.num_key_value_heads = c.num_key_value_heads;
  f.num_layers = c.num_hidden_layers;
  f.vocab_size = c.vocab_size;
  return f;
}

// Megatron sequence parallelism inside the TP group (split_gather; ring, its chunked overlap):
// activations between the linears are sequence shards of the tp group.
bool sequence_in_tp_group(SequenceParallel m) {
  return m == SequenceParallel::SplitGather || m == SequenceParallel::Ring;
}

// How a parameter lies over the tensor-parallel group.
struct ParamRole {
  // Its gradient after backward is this rank's full share of the gradient (a tp shard, or a
  // replicated key/value head whose layer sums the gradient over the ranks sharing it); false:
  // the parameter is whole on every tp rank (norms, a row-parallel bias, an unsharded head) and
  // under split_gather / ring its gradient is a per-sequence-shard partial.
  bool complete = false;
  // Whether this tp rank adds it to the gradient norm: ranks holding the same values (replicated
  // over r ranks, r = Module::replication or tp for a whole parameter) count it on the first.
  bool counted_on_tp = true;
  // false for the last pipeline stage's copy of a tied embedding (the first stage counts it).
  bool counted_on_pp = true;
};

std::map<std::string, ParamRole> param_roles(torch::nn::Module& root, int tp_rank, int tp) {
  std::map<std::string, ParamRole> out;
  for (auto& item : root.named_parameters(true)) {
    const std::string& name = item.key();
    const size_t dot = name.rfind('.');
    nn::Module* layer = nullptr;
    if (dot != std::string::npos)
      layer = dynamic_cast<nn::Module*>(nn::find_module(root, name.substr(0, dot)).get());
    ParamRole role;
    int64_t replicated = tp;
    if (layer && layer->shard_spec() && layer->shard_spec()->communicates()) {
      const std::string key = name.substr(dot + 1);
      const bool split = layer->full_shape(key) != item.value().sizes().vec();
      role.complete = split || layer->shard_spec()->replicas > 1;
      replicated = layer->replication(key);
    }
    role.counted_on_tp = tp_rank % replicated == 0;
    out[name] = role;
  }
  return out;
}

class HybridModel : public ModelWrapper {
 public:
  HybridModel(std::shared_ptr<torch::nn::Module> module,
              std::vector<std::pair<std::string, at::Tensor>> masters)
      : ModelWrapper(std::move(module)), masters(std::move(masters)) {}
  ~HybridModel() override {
    for (auto& [p, h] : grad_hooks) p.remove_hook(h);
  }
  void set_require_grad_sync(bool s) override {
    // ZeRO-2 reduce-scatters every micro-step and accumulates slices: its sync stays on.
    if (sync && stage != 2) sync->set_enabled(s);
    require_sync_ = s;
  }
  bool require_grad_sync() const override { return require_sync_; }
  void finish_backward() override {
    if (sync) sync->finish();
  }

  int stage = 0;
  std::map<std::string, ParamRole> roles;
  std::unique_ptr<GradSync> sync;
  std::vector<std::pair<std::string, at::Tensor>> masters;  // handed to the optimizer once
  std::vector<std::pair<at::Tensor, unsigned>> grad_hooks;
  bool require_sync_ = true;
};

// zero_stage 0: full gradients on every rank after the dp all-reduce; the norm counts each
// gradient on dp rank 0 only, and a tp-replicated one on tp rank 0 only.
class HybridOptimizer : public OptimizerWrapper {
 public:
  HybridOptimizer(std::shared_ptr<optim::Optimizer> optimizer, Precision precision,
                  const LossScaleOptions& ls, amp::GradReducer reducer,
                  std::set<const void*> counted, double max_norm)
      : OptimizerWrapper(std::move(optimizer), precision, ls, std::move(reducer)),
        counted_(std::move(counted)) {
    default_max_norm_ = max_norm;
  }

 protected:
  double grad_norm_now() override {
    std::vector<at::Tensor> grads, others;
    for (auto& g : optimizer_->param_groups())
      for (auto& p : g.params)
        if (p.grad().defined())
          (counted_.count(p.unsafeGetTensorImpl()) ? grads : others).push_back(p.grad());
    // A gradient this rank does not count still decides overflow: a non-finite one enters the
    // sum as NaN, which the reduction carries to every rank.
    std::vector<at::Tensor> flags;
    if (!others.empty() && !std::isfinite(amp::global_grad_norm(others, 1.0, amp::GradReducer{})))
      flags.push_back(at::full({}, std::numeric_limits<double>::quiet_NaN(), at::kDouble));
    return amp::global_grad_norm(grads, loss_scale(), reducer_, flags);
  }

 private:
  std::set<const void*> counted_;
};

}  // namespace

// What the plugin keeps for pipeline steps: the stage model, the placement of its chunks, the
// tied embedding's group and one executor per micro-batch count.
class PipelineState {
 public:
  std::shared_ptr<models::CausalLM> model;
  pipeline::Placement placement = pipeline::Placement::Loop;
  std::optional<pipeline::Schedule> table;  // pp_schedule_table, loaded at configure time
  std::map<int, pipeline::Schedule> schedules;
  std::map<int, std::unique_ptr<pipeline::Executor>> executors;
  dist::Communicator embedding_group;        // first and last stage of a tied head (Loop placement)
  std::vector<int64_t> layers;               // decoder layers per virtual stage
  const pipeline::Executor* last = nullptr;  // the executor of the last step
};

HybridParallelPlugin::HybridParallelPlugin(HybridOptions options,
                                           std::shared_ptr<dist::ParallelDims> dims)
    : options_(std::move(options)),
      precision_(precision_from_string(options_.precision)),
      mode_(options_.sequence_parallel()),
      dims_(std::move(dims)),
      world_(plugins::default_dp_comm({}, "hybrid")) {
  COLOSSAL_CHECK(dims_, "hybrid plugin: no ParallelDims");
  options_.validate();
  const dist::ParallelDegrees want = options_.degrees(world_.size());
  const dist::ParallelDegrees& got = dims_->degrees();
  COLOSSAL_CHECK_INPUT(got.dp == want.dp && got.tp == want.tp && got.pp == want.pp &&
                           got.sp == want.sp && got.ep == 1 &&
                           got.sequence_parallel == want.sequence_parallel,
                       "hybrid: the layout ", got.describe(), " (",
                       dist::to_string(got.sequence_parallel), ") is not the options' ",
                       want.describe(), " (", dist::to_string(want.sequence_parallel), ")");
  COLOSSAL_CHECK_INPUT(dims_->world_size() == world_.size(), "hybrid: the mesh spans ",
                       dims_->world_size(), " ranks, the world ", world_.size());
  // Every rank creates the axis groups in the same order.
  dims_->dp();
  dims_->tp();
  dims_->pp();
  dims_->sp();
  dims_->dp_sp();
  validate();
  log_info("hybrid: ", dims_->degrees().describe(), ", sequence parallelism ",
           dist::to_string(mode_), ", zero_stage ", options_.zero_stage, ", ",
           to_string(precision_));
}

HybridParallelPlugin::HybridParallelPlugin(HybridOptions options)
    : HybridParallelPlugin(options, std::make_shared<dist::ParallelDims>(options.degrees(
                                        plugins::default_dp_comm({}, "hybrid").size()))) {}

HybridParallelPlugin::~HybridParallelPlugin() = default;

std::vector<Precision> HybridParallelPlugin::supported_precisions() const {
  return {Precision::FP32, Precision::BF16, Precision::FP16};
}

int HybridParallelPlugin::dp_rank() const {
  return dims_->dp().rank();
}
int HybridParallelPlugin::dp_size() const {
  return dims_->dp().size();
}

std::shared_ptr<CheckpointIO> HybridParallelPlugin::checkpoint_io() {
  if (options_.tp_size == 1 && options_.pp_size == 1)
    return std::make_shared<DataParallelCheckpointIO>();
  if (!tp_io_)
    tp_io_ = std::make_shared<TensorParallelCheckpointIO>(
        dims_->tp(), dims_->degrees().sp > 1 ? dims_->dp_sp() : dims_->dp(), dims_->pp());
  return tp_io_;
}

LocalBatch HybridParallelPlugin::local_batch(const at::Tensor& inputs,
                                             const at::Tensor& targets) const {
  if (mode_ == SequenceParallel::AllToAll || mode_ == SequenceParallel::RingAttn) {
    // The sequence axis: each sp rank holds its shard of the tokens (contiguous for all_to_all,
    // zigzag for ring_attn) at their global positions, and its loss is the mean over its own
    // targets; with equal shards the data-parallel average over dp x sp is the global mean.
    nn::SequenceShard sh = nn::shard_sequence(inputs, targets, dims_->sp(), mode_);
    LocalBatch lb{sh.input, sh.targets, 0, 0};
    lb.positions = sh.positions;
    return lb;
  }
  if (!sequence_in_tp_group(mode_)) return {inputs, targets, 0, 0};
  const int64_t tp = dims_->tp().size(), s = targets.size(1);
  COLOSSAL_CHECK_INPUT(s % tp == 0, "hybrid: ", dist::to_string(mode_),
                       " sequence parallelism needs the sequence length divisible by tp_size "
                       "(it is not padded): seq_len ",
                       s, ", tp_size ", tp);
  const int64_t n = s / tp;
  LocalBatch lb{inputs, targets.narrow(1, dims_->tp().rank() * n, n).contiguous(), 0, 0};
  // The plan's vocab-parallel head gathers the sequence and takes the loss of the whole step
  // (the same on every tp rank; the local targets are gathered back): nothing to weight.
  lb.loss_weight = 1.0;
  return lb;
}

std::shared_ptr<ModelWrapper> HybridParallelPlugin::configure_model(
    std::shared_ptr<torch::nn::Module> model) {
  COLOSSAL_CHECK(model, "boost(): model is null");
  const int64_t tp = dims_->tp().size();
  auto lm = std::dynamic_pointer_cast<models::CausalLM>(model);
  const bool custom = !options_.custom_plan.empty();
  COLOSSAL_CHECK_INPUT(lm || tp == 1 || custom, "hybrid: tp_size ", tp,
                       " needs a model with a tensor-parallel plan (models::CausalLM: the Llama, "
                       "Mistral and Qwen2 families) or a custom_plan for this model");
  COLOSSAL_CHECK_INPUT(!custom || mode_ == SequenceParallel::Off,
                       "hybrid: custom_plan takes no sequence parallelism (mode ",
                       dist::to_string(mode_), "): the built-in plans place the sequence splits");
  if (lm) {
    const models::ModelConfig& cfg = lm->config();
    dist::ParallelDims::validate(dims_->degrees(), dims_->world_size(), facts_of(cfg));
    if (tp > 1 && !custom) models::check_tensor_parallel(cfg, tp);
  }
  // Every shard is cut from rank 0's whole model: the values are the unsharded model's.
  std::vector<std::pair<std::string, at::Tensor>> none;
  plugins::broadcast_from_rank0(world_, *model, none, /*buffers=*/true);
  if (options_.pp_size > 1) {
    COLOSSAL_CHECK_INPUT(lm, "hybrid: pp_size ", options_.pp_size,
                         " needs a models::CausalLM (pipeline stages are cut from its blocks)");
    cut_pipeline_stage(lm);
  }
  if (tp > 1) {
    COLOSSAL_CHECK_INPUT(custom || !std::dynamic_pointer_cast<nn::LoraLinear>(lm->lm_head),
                         "hybrid: LoRA on lm_head with tp_size ", tp,
                         " is not supported: the tensor-parallel plan makes lm_head the "
                         "vocabulary-parallel head, whose loss takes a plain linear layer; adapt "
                         "the decoder's projections, or train with tp_size 1");
    nn::PlanOptions po;
    if (pipe_) po.absent_modules = lm->dropped_blocks();  // rules for other stages' layers
    po.tp = dims_->tp();
    // all_to_all / ring_attn shard the sequence on their own axis: the tp layers see whole
    // sequences there.
    po.sequence_parallel = sequence_in_tp_group(mode_) ? mode_ : SequenceParallel::Off;
    models::TensorParallelOptions tpo;
    tpo.make_vocab_size_divisible_by = options_.make_vocab_size_divisible_by;
    tpo.parallel_output = options_.parallel_output;
    nn::apply_plan(*model,
                   custom ? options_.custom_plan : models::tensor_parallel_plan(lm->config(), tpo),
                   po);
    if (sequence_in_tp_group(mode_) && lm->owns_block(0)) {
      // (Later pipeline stages receive the sequence shards the first stage's embedding made.)
      auto* embed = lm->model->embed_tokens.get();
      COLOSSAL_CHECK_INPUT(
          embed && embed->shard_spec() && embed->shard_spec()->communicates(),
          "hybrid: split_gather / ring need the vocab-parallel embedding to split the "
          "sequence");
    }
  }
  COLOSSAL_CHECK_INPUT(
      lm || (mode_ != SequenceParallel::AllToAll && mode_ != SequenceParallel::RingAttn),
      "hybrid: sequence_parallelism_mode ", dist::to_string(mode_),
      " needs a model with a sequence-parallel plan (models::CausalLM)");
  if (mode_ == SequenceParallel::AllToAll || mode_ == SequenceParallel::RingAttn) {
    // The attention cores of the sequence axis replace each layer's core attention.
    nn::PlanOptions so;
    if (pipe_) so.absent_modules = lm->dropped_blocks();
    nn::apply_plan(
        *model,
        models::sequence_parallel_plan(lm->config(), mode_, dims_->sp(), options_.inner_ring_size),
        so);
  }
  auto roles = param_roles(*model, dims_->tp().rank(), dims_->tp().size());
  if (pipe_ && lm->holds_tied_copy()) roles.at("model.embed_tokens.weight").counted_on_pp = false;
  auto masters = plugins::cast_module_in_place(*model, working_dtype(precision_), options_.device);
  // (Frozen parameters, a LoRA run's base, get no fp32 master: cast_module_in_place.)
  if (tp_io_) tp_io_->set_model(model);
  auto hm = std::make_shared<HybridModel>(std::move(model), std::move(masters));
  hm->stage = static_cast<int>(options_.zero_stage);
  hm->roles = std::move(roles);
  if (sequence_in_tp_group(mode_) && tp > 1) {
    // Each rank's loss is the whole step's (the vocab-parallel head gathers the sequence), so
    // backward gives the whole gradient where it is complete (a shard, a replicated head summed
    // by its layer) and a per-sequence-shard part of it on tp-whole parameters: those are summed
    // over tp here, before any accumulation or data-parallel reduction sees them.
    dist::Communicator group = dims_->tp();
    for (auto& [name, p] : plugins::trainable(hm->module())) {
      if (hm->roles.at(name).complete) continue;
      const unsigned h = p.register_hook([group](const at::Tensor& g) {
        at::Tensor out = g.contiguous().clone();
        dist::Communicator c = group;
        c.all_reduce(out, dist::ReduceOp::Sum);
        return out;
      });
      hm->grad_hooks.emplace_back(p, h);
    }
  }
  dist::Communicator& dpg = dims_->degrees().sp > 1 ? dims_->dp_sp() : dims_->dp();
  if (options_.zero_stage == 0 && dpg.size() > 1) {
    GradSync::Options gs;
    gs.bucket_cap_mb = options_.ddp_bucket_cap_mb;
    gs.overlap = options_.overlap_communication;
    if (!options_.communication_dtype.empty())
      gs.communication_dtype = working_dtype(precision_from_string(options_.communication_dtype));
    hm->sync = std::make_unique<GradSync>(plugins::trainable(hm->module()), dpg, gs);
  }
  return hm;
}

std::shared_ptr<OptimizerWrapper> HybridParallelPlugin::configure_optimizer(
    std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model) {
  auto* hm = dynamic_cast<HybridModel*>(&model);
  COLOSSAL_CHECK(hm, "hybrid plugin: the model was not configured by this plugin");
  if (!optimizer) return nullptr;
  if (pipe_) {
    // An optimizer built over the whole model keeps this stage's parameters only.
    std::set<const void*> held;
    for (auto& item : model.module().named_parameters(true))
      held.insert(item.value().unsafeGetTensorImpl());
    optimizer->retain_params(
        [&held](const at::Tensor& p) { return held.count(p.unsafeGetTensorImpl()) > 0; });
  }
  plugins::check_optimizer_params(*optimizer, model.module());
  const at::Device dev = device_of(options_.device);
  amp::GradReducer reducer = amp::over_parallel_dims(*dims_, dev);
  const auto& roles = hm->roles;
  if (options_.zero_stage == 0) {
    if (precision_ != Precision::FP32) optimizer->adopt_masters(hm->masters);
    hm->masters.clear();
    std::set<const void*> counted;
    for (auto& item : model.module().named_parameters(true))
      if (reducer.counts({"dp"}) && roles.at(item.key()).counted_on_tp &&
          roles.at(item.key()).counted_on_pp)
        counted.insert(item.value().unsafeGetTensorImpl());
    return std::make_shared<HybridOptimizer>(std::move(optimizer), precision_, options_.loss_scale,
                                             std::move(reducer), std::move(counted),
                                             options_.max_norm);
  }
  dist::Communicator& dpg = dims_->degrees().sp > 1 ? dims_->dp_sp() : dims_->dp();
  zero::ZeroOptimizerOptions zo;
  zo.cpu_offload = options_.cpu_offload;
  zo.allgather_bucket_numel = static_cast<int64_t>(options_.zero_bucket_size_in_m * 1024 * 1024);
  auto zopt = std::make_shared<zero::LowLevelZeroOptimizer>(optimizer, dpg, hm->masters, zo);
  hm->masters.clear();
  // A rank that does not count a parameter names the tp axis, along which it is not rank 0.
  zopt->set_norm_reducer(std::move(reducer), [roles](const std::string& name) {
    auto it = roles.find(name);
    std::vector<std::string> axes;
    if (it != roles.end() && !it->second.counted_on_tp) axes.push_back("tp");
    // The tied copy lives on a pipeline rank other than 0 (the first stage counts it).
    if (it != roles.end() && !it->second.counted_on_pp) axes.push_back("pp");
    return axes;
  });
  GradSync::Options gs;
  const int64_t elem = at::elementSize(working_dtype(precision_));
  gs.bucket_cap_mb = options_.zero_bucket_size_in_m * static_cast<double>(elem);
  gs.overlap = options_.overlap_communication;
  if (!options_.communication_dtype.empty())
    gs.communication_dtype = working_dtype(precision_from_string(options_.communication_dtype));
  auto params = plugins::trainable(model.module());
  if (options_.zero_stage == 2) {
    std::vector<int64_t> index;
    for (auto& [n, p] : params) index.push_back(zopt->index_of(p));
    zero::LowLevelZeroOptimizer* raw = zopt.get();
    gs.on_shard = [raw, index](size_t k, const at::Tensor& slice) {
      if (index[k] >= 0) raw->add_grad_shard(static_cast<size_t>(index[k]), slice);
    };
    if (!params.empty()) hm->sync = std::make_unique<GradSync>(params, dpg, gs);
  } else if (dpg.size() > 1 && !params.empty()) {
    hm->sync = std::make_unique<GradSync>(params, dpg, gs);
  }
  hm->set_require_grad_sync(hm->require_grad_sync());
  log_info("hybrid: ZeRO stage ", options_.zero_stage, " over ", dpg.size(),
           " data-parallel rank(s); optimizer state on this rank ", zopt->state_bytes(), " bytes");
  return std::make_shared<ZeroOptimizerWrapper>(std::move(optimizer), std::move(zopt), precision_,
                                                options_.loss_scale, options_.max_norm);
}

std::vector<int64_t> HybridParallelPlugin::layers_per_virtual_stage(const models::ModelConfig& cfg,
                                                                    int64_t seq_len) const {
  const int stages = static_cast<int>(options_.pp_size);
  const int chunks =
      pipe_ && pipe_->table ? pipe_->table->chunks : static_cast<int>(options_.num_model_chunks);
  const int64_t L = cfg.num_hidden_layers;
  COLOSSAL_CHECK_INPUT(L >= static_cast<int64_t>(stages) * chunks, "hybrid: ", stages,
                       " pipeline stages x ", chunks, " chunks need at least ", stages * chunks,
                       " decoder layers; the model has ", L);
  std::vector<int64_t> given = options_.layers_per_stage();
  if (!given.empty()) {
    pipeline::check_layers_per_stage(given, L, stages * chunks);
    return given;
  }
  if (options_.pp_balance == "cost") {
    const models::BlockCosts c = models::block_costs(cfg, seq_len);
    return pipeline::balance_layers(L, stages * chunks, c.layer, c.embedding, c.head);
  }
  return pipeline::distribute_layers(L, stages, chunks);
}

void HybridParallelPlugin::cut_pipeline_stage(const std::shared_ptr<models::CausalLM>& lm) {
  pipe_ = std::make_unique<PipelineState>();
  pipe_->model = lm;
  const int pp = dims_->pp().size(), rank = dims_->pp().rank();
  if (!options_.pp_schedule_table.empty()) {
    pipe_->table = pipeline::load_schedule_table(options_.pp_schedule_table);
    COLOSSAL_CHECK_INPUT(pipe_->table->stages == pp, "hybrid: the schedule table ",
                         options_.pp_schedule_table, " has ", pipe_->table->stages,
                         " stages, pp_size is ", pp);
    pipe_->placement = pipe_->table->placement;
  } else {
    pipe_->placement =
        options_.pp_style == "zbv" ? pipeline::Placement::V : pipeline::Placement::Loop;
  }
  // The cost-balanced split weighs attention at the longest sequence the model is made for
  // (capped at 4096 tokens): the split is fixed before any batch is seen.
  const int64_t seq = std::min<int64_t>(lm->config().max_position_embeddings, 4096);
  pipe_->layers = layers_per_virtual_stage(lm->config(), seq);
  lm->keep_chunks(pipeline::rank_block_ranges(pipe_->layers, pp, rank,
                                              pipe_->placement == pipeline::Placement::V));
  std::vector<int64_t> ckpt = options_.ckpt_layers_per_stage();
  if (!ckpt.empty()) {
    // One entry per virtual stage (ColossalAI's num_ckpt_layers_per_stage, indexed by
    // stage + chunk * stages): this rank's chunks take theirs.
    const int V = static_cast<int>(pipe_->layers.size());
    COLOSSAL_CHECK_INPUT(static_cast<int>(ckpt.size()) == V, "hybrid: num_ckpt_layers_per_stage='",
                         options_.num_ckpt_layers_per_stage, "' has ", ckpt.size(), " entries for ",
                         V, " virtual stages (pp_size x num_model_chunks)");
    std::vector<int64_t> per_chunk;
    for (int v :
         pipeline::rank_virtual_stages(V, pp, rank, pipe_->placement == pipeline::Placement::V))
      per_chunk.push_back(ckpt[static_cast<size_t>(v)]);
    lm->set_activation_checkpointing(nn::CheckpointMode::Full, per_chunk);
  }
  if (lm->tied() && pipe_->placement == pipeline::Placement::Loop) {
    // The embedding (stage 0) and the last stage's copy used by the head: one group per
    // (dp, tp, sp) coordinate, its two members along pp.
    std::vector<int> along = dims_->mesh().group_ranks({dist::Axis::PP});
    std::vector<int> members{along.front(), along.back()};
    if (rank == 0 || rank == pp - 1)
      pipe_->embedding_group =
          dims_->pp().new_group(members, "hybrid-tied-embedding-" + std::to_string(members[0]));
  }
  log_info(
      "hybrid: pipeline rank ", rank, " of ", pp, " holds blocks ",
      [&] {
        std::string out;
        for (int64_t c = 0; c < lm->num_chunks(); ++c) {
          auto [b, e] = lm->chunk_blocks(c);
          out += (c ? ", " : "") + std::string("[") + std::to_string(b) + ", " + std::to_string(e) +
                 ")";
        }
        return out;
      }(),
      lm->holds_tied_copy() ? " + the tied embedding copy" : "");
}

const pipeline::Schedule& HybridParallelPlugin::schedule(int microbatches) {
  COLOSSAL_CHECK(pipe_, "hybrid: no pipeline (pp_size 1 or the model was not boosted)");
  auto it = pipe_->schedules.find(microbatches);
  if (it != pipe_->schedules.end()) return it->second;
  pipeline::Schedule s;
  if (pipe_->table) {
    COLOSSAL_CHECK_INPUT(pipe_->table->microbatches == microbatches, "hybrid: the schedule table ",
                         options_.pp_schedule_table, " is for ", pipe_->table->microbatches,
                         " micro-batches, the step has ", microbatches);
    s = *pipe_->table;
  } else {
    pipeline::ScheduleOptions so;
    so.style = options_.pp_style;
    so.stages = static_cast<int>(options_.pp_size);
    so.microbatches = microbatches;
    so.chunks = static_cast<int>(options_.num_model_chunks);
    s = pipeline::make_schedule(so);
  }
  pipeline::validate(s);
  return pipe_->schedules.emplace(microbatches, std::move(s)).first->second;
}

PipelineOutput HybridParallelPlugin::execute_pipeline(
    const BatchIterator& data_iter, ModelWrapper& model, const Criterion& criterion,
    OptimizerWrapper* optimizer, bool return_loss, bool return_outputs, const PipelineStep& step) {
  auto* hm = dynamic_cast<HybridModel*>(&model);
  COLOSSAL_CHECK(hm && pipe_,
                 "hybrid: execute_pipeline needs a model boosted by this plugin "
                 "with pp_size > 1");
  COLOSSAL_CHECK_INPUT(at::GradMode::is_enabled(),
                       "hybrid: execute_pipeline runs a training step (forward-only pipeline "
                       "steps are not supported); grad mode is off");
  models::CausalLM& lm = *pipe_->model;
  auto [inputs, targets] = data_iter();
  COLOSSAL_CHECK_INPUT(inputs.defined() && targets.defined() && inputs.dim() == 2 &&
                           targets.sizes() == inputs.sizes(),
                       "hybrid: execute_pipeline's data_iter must give token ids and targets "
                       "[batch, seq] of one shape, got ",
                       inputs.defined() ? inputs.sizes() : at::IntArrayRef{}, " and ",
                       targets.defined() ? targets.sizes() : at::IntArrayRef{});
  const int64_t B = inputs.size(0);
  int64_t M = options_.num_microbatches;
  if (M > 0) {
    COLOSSAL_CHECK_INPUT(B % M == 0, "hybrid: a batch of ", B,
                         " rows does not split into num_microbatches=", M);
  } else {
    COLOSSAL_CHECK_INPUT(B % options_.microbatch_size == 0, "hybrid: a batch of ", B,
                         " rows is not divisible by microbatch_size=", options_.microbatch_size);
    M = B / options_.microbatch_size;
  }
  const pipeline::Schedule& sched = schedule(static_cast<int>(M));
  if (sched.splits_backward()) {
    // W runs a second backward over the chunk's graph; a recomputed layer's node runs once.
    for (auto& layer : lm.model->layers->layers)
      COLOSSAL_CHECK_INPUT(!layer || layer->checkpointing == nn::CheckpointMode::None,
                           "hybrid: the schedule '", sched.name,
                           "' splits the backward into B and W, which activation checkpointing "
                           "does not support (decoder layer ",
                           layer->self_attn->layer_idx(),
                           " recomputes); use 1f1b, gpipe or interleaved, or no checkpointing");
  }
  auto& exec = pipe_->executors[static_cast<int>(M)];
  const at::Device dev = device_of(options_.device);
  // This step's micro-batches, each cut for this rank (sequence shards) as local_batch does.
  std::vector<LocalBatch> mbs;
  const int64_t rows = B / M;
  for (int64_t m = 0; m < M; ++m)
    mbs.push_back(local_batch(inputs.narrow(0, m * rows, rows).to(dev),
                              targets.narrow(0, m * rows, rows).to(dev)));
  COLOSSAL_CHECK_INPUT(
      step.counted_targets < 0 || (!criterion && !return_outputs && step.global_targets > 0),
      "hybrid: masked targets (PipelineStep::counted_targets) take the plugin's "
      "own loss: no criterion, no return_outputs, and global_targets > 0");
  const bool vocab_head = lm.vocab_parallel_head();
  COLOSSAL_CHECK_INPUT(!(return_outputs && vocab_head),
                       "hybrid: return_outputs with a "
                       "vocab-parallel head (parallel_output) returns no whole logits; set "
                       "parallel_output=false");
  std::vector<at::Tensor> outputs(static_cast<size_t>(M));
  const int64_t L = lm.config().num_hidden_layers;
  pipeline::StageFunctions fns;
  fns.forward = [&](int mb, int chunk, const at::Tensor& input) -> at::Tensor {
    const LocalBatch& lb = mbs[static_cast<size_t>(mb)];
    models::ForwardOptions fo;
    fo.seq_offset = lb.seq_offset;
    fo.global_seq_len = lb.global_seq_len;
    if (lb.positions.defined()) fo.positions = lb.positions.to(lb.inputs.device());
    const auto [begin, end] = lm.chunk_blocks(chunk);
    const at::Tensor x = begin == 0 ? lb.inputs : input;
    // A later stage's input stands for this rank's tokens (split_gather: S/tp rows of S tokens).
    if (begin > 0) fo.input_tokens = lb.inputs.size(1);
    if (end < L + 3) return lm.forward_chunk(chunk, x, fo);
    const double w = lb.loss_weight * step.loss_weight / static_cast<double>(M);
    if (step.counted_targets >= 0) {
      // The trainer's normalization of masked targets (PipelineStep): sum / divisor.
      const double n = static_cast<double>(lb.targets.numel());
      fo.loss_divisor = step.counted_targets > 0
                            ? n * static_cast<double>(step.counted_targets) /
                                  static_cast<double>(step.global_targets)
                            : n;  // nothing counts: the sum is 0 whatever divides it
      return lm.forward_chunk_loss(chunk, x, lb.targets, step.ce_chunk_tokens, fo) * w;
    }
    if (vocab_head || (!criterion && !return_outputs))
      return lm.forward_chunk_loss(chunk, x, lb.targets, step.ce_chunk_tokens, fo) * w;
    at::Tensor logits = lm.forward_chunk(chunk, x, fo);
    if (return_outputs) outputs[static_cast<size_t>(mb)] = logits.detach();
    at::Tensor loss =
        criterion ? criterion(logits, lb.targets)
                  : at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                           lb.targets.reshape({-1}), std::nullopt,
                                           at::Reduction::Mean, -100);
    return loss * w;
  };
  // Asked only by W without the weight-gradient store (never on this plugin's schedules).
  fns.parameters = [&model](int) {
    std::vector<at::Tensor> params;
    for (auto& [name, p] : plugins::trainable(model.module())) params.push_back(p);
    return params;
  };
  if (optimizer && optimizer->scaler()) {
    const double scale = optimizer->loss_scale();
    fns.scale_loss = [scale](const at::Tensor& loss) { return loss * scale; };
  }
  if (!exec) {
    pipeline::ExecutorOptions eo;
    eo.enable_metadata_cache = options_.enable_metadata_cache;
    eo.device = dev;
    eo.record_timings = true;
    if (sched.splits_backward()) {
      // ZB's W = the weight GEMMs: every linear of the stage defers its dW to the schedule's W,
      // except one whose weight carries a gradient hook of this plugin (a tp-whole parameter
      // under split_gather, summed over tp as autograd accumulates it).
      std::set<const void*> hooked;
      for (auto& [p, h] : hm->grad_hooks) hooked.insert(p.unsafeGetTensorImpl());
      for (auto& m : lm.modules(/*include_self=*/false))
        if (auto* linear = dynamic_cast<nn::Linear*>(m.get()))
          if (!hooked.count(linear->weight().unsafeGetTensorImpl()))
            linear->set_defer_weight_grad(true);
      eo.weight_grad_store = true;
    }
    exec = std::make_unique<pipeline::Executor>(sched, dims_->pp(), fns, eo);
  } else {
    exec->set_stage(fns);
  }
  // The schedule's backward passes accumulate; the data-parallel reduction runs once after it.
  const bool sync = hm->require_grad_sync();
  hm->set_require_grad_sync(false);
  std::vector<at::Tensor> losses;
  try {
    losses = exec->run();
  } catch (...) {
    hm->set_require_grad_sync(sync);
    throw;
  }
  hm->set_require_grad_sync(sync);
  if (optimizer) optimizer->invalidate_norm();
  if (sync) {
    if (pipe_->embedding_group.valid()) {
      // The head's copy and the embedding: each holds part of the tied weight's gradient.
      at::Tensor w;
      for (auto& item : lm.named_parameters(true))
        if (item.key() == "model.embed_tokens.weight") w = item.value();
      COLOSSAL_CHECK(w.defined(), "hybrid: a tied stage without model.embed_tokens.weight");
      if (w.requires_grad()) {
        if (!w.grad().defined()) w.mutable_grad() = at::zeros_like(w);
        pipe_->embedding_group.all_reduce(w.mutable_grad(), dist::ReduceOp::Sum);
      }
    }
    if (hm->sync) hm->sync->reduce_now();
  }
  PipelineOutput out;
  if (return_loss) {
    // The step's loss from the last stage to every pipeline rank (rank 0 logs it).
    at::Tensor total = at::zeros({1}, at::TensorOptions(at::kDouble).device(dev));
    for (auto& l : losses) total += l.to(at::kDouble).reshape({1});
    const int last = sched.holder(sched.virtual_stages() - 1).first;
    if (dims_->pp().size() > 1) dims_->pp().broadcast(total, last);
    out.loss = total.reshape({});
  }
  if (return_outputs && exec->holds_last()) out.outputs = std::move(outputs);
  pipe_->last = exec.get();
  return out;
}

PipelineProfile HybridParallelPlugin::pipeline_profile() {
  COLOSSAL_CHECK(pipe_ && pipe_->last, "hybrid: pipeline_profile needs a pipeline step first");
  const pipeline::Executor& exec = *pipe_->last;
  // This rank's mean compute times: [f, b, w, measured step].
  double sum[3] = {0, 0, 0};
  int count[3] = {0, 0, 0};
  for (const auto& t : exec.last_timings()) {
    const int k = t.instr.op == pipeline::Op::F                                     ? 0
                  : t.instr.op == pipeline::Op::B || t.instr.op == pipeline::Op::BW ? 1
                  : t.instr.op == pipeline::Op::W                                   ? 2
                                                                                    : -1;
    if (k < 0) continue;
    sum[k] += t.end - t.start;
    ++count[k];
  }
  at::Tensor mine = at::zeros({4}, at::kDouble);
  for (int k = 0; k < 3; ++k) mine[k] = count[k] ? sum[k] / count[k] : 0.0;
  mine[3] = exec.last_run_seconds();
  dist::Communicator& pp = dims_->pp();
  const at::Device dev = device_of(options_.device);
  at::Tensor all = at::zeros({4 * pp.size()}, at::TensorOptions(at::kDouble).device(dev));
  pp.all_gather(all, mine.to(dev));
  all = all.to(at::kCPU).view({pp.size(), 4});
  PipelineProfile out;
  for (int r = 0; r < pp.size(); ++r) {
    out.costs.f_rank.push_back(all[r][0].item<double>());
    out.costs.b_rank.push_back(all[r][1].item<double>());
    out.costs.w_rank.push_back(all[r][2].item<double>());
    out.measured = std::max(out.measured, all[r][3].item<double>());
  }
  out.costs.comm = 0.0;
  out.simulated = pipeline::simulate(exec.schedule(), out.costs);
  return out;
}

HybridMemoryReport HybridParallelPlugin::memory_report(ModelWrapper& model,
                                                       OptimizerWrapper* optimizer) const {
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : int64_t{0};
  };
  HybridMemoryReport r;
  for (auto& item : model.module().named_parameters(true)) {
    r.parameter_bytes += bytes(item.value());
    r.gradient_bytes += bytes(item.value().grad());
  }
  if (!optimizer) return r;
  if (auto* z = dynamic_cast<ZeroOptimizerWrapper*>(optimizer)) {
    r.gradient_bytes += z->zero().grad_shard_bytes();
    r.optimizer_bytes = z->zero().state_bytes();
    return r;
  }
  optim::Optimizer& opt = optimizer->optimizer();
  for (const auto& g : opt.param_groups())
    for (const auto& name : g.names) {
      if (const optim::ParamState* st = opt.state(name))
        for (const auto& [key, t] : st->tensors) r.optimizer_bytes += bytes(t);
      r.optimizer_bytes += bytes(opt.master(name));
    }
  return r;
}

}  // namespace colossal::booster
