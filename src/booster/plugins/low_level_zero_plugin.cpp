// The low_level_zero plugin (see low_level_zero_plugin.h).
#include "colossal/booster/plugins/low_level_zero_plugin.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "booster/plugins/plugin_common.h"
#include "colossal/amp/grad_scaler.h"
#include "colossal/booster/grad_sync.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/dist/runtime.h"
#include "colossal/nn/module.h"
#include "colossal/optim/optimizer.h"
#include "colossal/zero/low_level_optim.h"

namespace colossal::booster {

void ZeroOptions::register_options(OptionSet& set) {
  set.add("plugin", "stage", &stage,
          "low_level_zero: ZeRO stage (1: sharded optimizer states, 2: and gradients)")
      .add("plugin", "reduce_bucket_size_in_m", &reduce_bucket_size_in_m,
           "low_level_zero: gradient bucket size in millions of elements")
      .add("plugin", "communication_dtype", &communication_dtype,
           "low_level_zero: dtype gradients are reduced in ('' = their own)",
           {"", "fp32", "bf16", "fp16"})
      .add("plugin", "overlap_communication", &overlap_communication,
           "low_level_zero: reduce gradient buckets while backward runs")
      .add("plugin", "overlap_allgather", &overlap_allgather,
           "low_level_zero: all-gather updated weights in the background; forward waits per layer")
      .add("plugin", "cpu_offload", &cpu_offload,
           "low_level_zero: fp32 masters, gradient shards and moments on the CPU");
  set.min("stage", 1).max("stage", 2).min("reduce_bucket_size_in_m", 1e-6);
}

namespace {

class ZeroModel : public ModelWrapper {
 public:
  ZeroModel(std::shared_ptr<torch::nn::Module> module,
            std::vector<std::pair<std::string, at::Tensor>> masters)
      : ModelWrapper(std::move(module)), masters(std::move(masters)) {}
  void set_require_grad_sync(bool s) override {
    // Stage 2 reduce-scatters every micro-step and accumulates slices: its sync stays on.
    if (sync && stage == 1) sync->set_enabled(s);
    require_sync_ = s;
  }
  bool require_grad_sync() const override { return require_sync_; }
  void finish_backward() override {
    if (sync) sync->finish();
  }
  // fp8_communication: the weights are gathered again exactly (checkpoints read exact values).
  void wait_weights() override {
    if (auto z = zero.lock()) z->exact_weights();
  }
  ~ZeroModel() override {
    for (auto& h : hooks) h.remove();
  }
  int stage = 1;
  std::weak_ptr<zero::LowLevelZeroOptimizer> zero;  // in-flight / FP8 weight gathers
  std::vector<nn::HookHandle> hooks;
  std::unique_ptr<GradSync> sync;
  std::vector<std::pair<std::string, at::Tensor>> masters;  // fp32 values before the cast
  bool require_sync_ = true;
};

// overlap_allgather: every parameter is waited for by the forward pre hook of the nearest
// colossal::nn::Module at or above the module that registers it (its own layer, or the
// colossal layer around a plain torch::nn::Module child). Parameters with no colossal::nn::Module
// above them cannot be hooked: they are not deferrable and step() finishes their gathers.
void plan_gathers(zero::LowLevelZeroOptimizer& zopt, ZeroModel& zm,
                  const std::shared_ptr<zero::LowLevelZeroOptimizer>& shared) {
  torch::nn::Module& root = zm.module();
  std::vector<int64_t> position(zopt.num_params(), 0);
  std::vector<bool> deferrable(zopt.num_params(), false);
  int64_t pos = 0;
  for (auto& item : root.named_parameters(true)) {
    int64_t i = zopt.index_of(item.value());
    if (i >= 0) position[static_cast<size_t>(i)] = pos++;
  }
  std::map<nn::Module*, std::vector<size_t>> covered;
  std::function<void(torch::nn::Module&, nn::Module*)> walk = [&](torch::nn::Module& m,
                                                                  nn::Module* nearest) {
    if (auto* cm = dynamic_cast<nn::Module*>(&m)) nearest = cm;
    for (auto& item : m.named_parameters(false)) {
      int64_t i = zopt.index_of(item.value());
      if (i < 0 || !nearest) continue;
      covered[nearest].push_back(static_cast<size_t>(i));
      deferrable[static_cast<size_t>(i)] = true;
    }
    for (auto& child : m.children()) walk(*child, nearest);
  };
  walk(root, nullptr);
  std::weak_ptr<zero::LowLevelZeroOptimizer> weak = shared;
  for (auto& [module, idx] : covered)
    zm.hooks.push_back(module->add_forward_pre_hook([weak, idx](nn::Module&) {
      if (auto z = weak.lock()) z->wait_params(idx);
    }));
  zm.zero = shared;
  const auto deferred = std::count(deferrable.begin(), deferrable.end(), true);
  log_info("low_level_zero: overlap_allgather: ", deferred, " of ", zopt.num_params(),
           " parameters gathered in the background (", covered.size(), " layer hooks); ",
           static_cast<int64_t>(zopt.num_params()) - deferred,
           " outside any colossal::nn::Module are gathered before step() returns");
  zopt.set_gather_plan(std::move(position), std::move(deferrable));
}

}  // namespace

LowLevelZeroPlugin::LowLevelZeroPlugin(ZeroOptions options, dist::Communicator comm)
    : DataParallelPlugin(std::move(options),
                         plugins::default_dp_comm(std::move(comm), "low_level_zero")) {
  COLOSSAL_CHECK_INPUT(options_.stage == 1 || options_.stage == 2,
                       "low_level_zero: stage must be 1 or 2, got ", options_.stage);
  COLOSSAL_CHECK_INPUT(options_.reduce_bucket_size_in_m > 0,
                       "low_level_zero: reduce_bucket_size_in_m must be > 0, got ",
                       options_.reduce_bucket_size_in_m);
  COLOSSAL_CHECK_INPUT(options_.master_weights || precision_ == Precision::FP32,
                       "low_level_zero: master_weights=false is not supported with ",
                       to_string(precision_), " (fp32 master shards are always kept)");
  COLOSSAL_CHECK_INPUT(options_.max_norm >= 0, "low_level_zero: max_norm must be >= 0, got ",
                       options_.max_norm);
  validate();
}

std::shared_ptr<ModelWrapper> LowLevelZeroPlugin::configure_model(
    std::shared_ptr<torch::nn::Module> model) {
  COLOSSAL_CHECK(model, "boost(): model is null");
  auto masters = plugins::cast_module_in_place(*model, working_dtype(precision_), options_.device);
  // Every rank starts from rank 0's weights.
  plugins::broadcast_from_rank0(comm_, *model, masters, /*buffers=*/true);
  return std::make_shared<ZeroModel>(std::move(model), std::move(masters));
}

std::shared_ptr<OptimizerWrapper> LowLevelZeroPlugin::configure_optimizer(
    std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model) {
  auto* zm = dynamic_cast<ZeroModel*>(&model);
  COLOSSAL_CHECK(zm, "low_level_zero plugin: the model was not configured by this plugin");
  if (!optimizer) return nullptr;
  plugins::check_optimizer_params(*optimizer, model.module());
  zero::ZeroOptimizerOptions zo;
  zo.cpu_offload = options_.cpu_offload;
  zo.allgather_bucket_numel = static_cast<int64_t>(options_.reduce_bucket_size_in_m * 1024 * 1024);
  zo.overlap_allgather = options_.overlap_allgather;
  if (options_.fp8_communication) zo.fp8_allgather = at::kFloat8_e4m3fn;
  auto zopt = std::make_shared<zero::LowLevelZeroOptimizer>(optimizer, comm_, zm->masters, zo);
  zm->masters.clear();
  for (auto& h : zm->hooks) h.remove();
  zm->hooks.clear();
  if (options_.overlap_allgather) plan_gathers(*zopt, *zm, zopt);
  zm->zero = zopt;

  GradSync::Options gs;
  const int64_t elem = at::elementSize(working_dtype(precision_));
  gs.bucket_cap_mb = options_.reduce_bucket_size_in_m * static_cast<double>(elem);
  gs.overlap = options_.overlap_communication;
  if (!options_.communication_dtype.empty())
    gs.communication_dtype = working_dtype(precision_from_string(options_.communication_dtype));
  if (options_.fp8_communication) gs.fp8 = at::kFloat8_e5m2;
  auto params = plugins::trainable(model.module());
  zm->stage = static_cast<int>(options_.stage);
  if (options_.stage == 2) {
    std::vector<int64_t> index;
    for (auto& [n, p] : params) index.push_back(zopt->index_of(p));
    zero::LowLevelZeroOptimizer* raw = zopt.get();
    gs.on_shard = [raw, index](size_t k, const at::Tensor& slice) {
      if (index[k] >= 0) raw->add_grad_shard(static_cast<size_t>(index[k]), slice);
    };
    if (!params.empty()) zm->sync = std::make_unique<GradSync>(params, comm_, gs);
  } else if (comm_.size() > 1 && !params.empty()) {
    zm->sync = std::make_unique<GradSync>(params, comm_, gs);
  }
  zm->set_require_grad_sync(zm->require_grad_sync());
  log_info("low_level_zero: stage ", options_.stage, ", ", to_string(precision_), ", dp ",
           comm_.size(), options_.cpu_offload ? ", cpu offload" : "",
           options_.fp8_communication ? ", fp8 communication" : "",
           "; optimizer state on this rank ", zopt->state_bytes(), " bytes");
  return std::make_shared<ZeroOptimizerWrapper>(std::move(optimizer), std::move(zopt), precision_,
                                                options_.loss_scale, options_.max_norm);
}

ZeroOptimizerWrapper::ZeroOptimizerWrapper(std::shared_ptr<optim::Optimizer> optimizer,
                                           std::shared_ptr<zero::LowLevelZeroOptimizer> zero,
                                           Precision precision, const LossScaleOptions& loss_scale,
                                           double max_norm)
    : OptimizerWrapper(std::move(optimizer), precision, loss_scale), zero_(std::move(zero)) {
  default_max_norm_ = max_norm;
}

double ZeroOptimizerWrapper::grad_norm_now() {
  zero_->take_full_grads();  // stage 1 (and anything left on .grad); a no-op for stage 2
  return zero_->grad_norm(loss_scale());
}

void ZeroOptimizerWrapper::apply_update(double divisor) {
  zero_->step(divisor);
}

void ZeroOptimizerWrapper::drop_grads() {
  zero_->zero_grad();
}

void ZeroOptimizerWrapper::zero_grad(bool set_to_none) {
  (void)set_to_none;  // shards are zeroed in place; working .grad always dropped
  zero_->zero_grad();
}

optim::StateDict ZeroOptimizerWrapper::full_state_dict() {
  return zero_->state_dict();
}
void ZeroOptimizerWrapper::load_full_state_dict(const optim::StateDict& state) {
  zero_->load_state_dict(state);
}
OptimizerWrapper::FullStatePlan ZeroOptimizerWrapper::full_state_plan() {
  FullStatePlan plan;
  plan.tensors = zero_->state_plan(&plan.scalars);
  return plan;
}
at::Tensor ZeroOptimizerWrapper::full_state_tensor(const FullStatePlan& plan, size_t i) {
  COLOSSAL_CHECK(i < plan.tensors.size(), "full_state_tensor: tensor ", i, " of a plan of ",
                 plan.tensors.size());
  return zero_->gather_state(i, /*dst=*/0);
}
void ZeroOptimizerWrapper::load_full_state(const optim::StateSource& source) {
  zero_->load_state(source);
}
void ZeroOptimizerWrapper::sync_masters_from_params() {
  zero_->sync_masters_from_params();
}

}  // namespace colossal::booster
