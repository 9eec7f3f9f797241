// The gemini plugin (see gemini_plugin.h).
#include "colossal/booster/plugins/gemini_plugin.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>

#include "booster/plugins/plugin_common.h"
#include "colossal/amp/grad_scaler.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/dist/runtime.h"
#include "colossal/nn/module.h"
#include "colossal/optim/optimizer.h"
#include "colossal/zero/gemini/chunk_manager.h"

namespace colossal::booster {

void GeminiPluginOptions::register_options(OptionSet& set) {
  set.add("plugin", "placement_policy", &placement_policy, "gemini: chunk placement",
          {"static", "auto"})
      .add(
          "plugin", "shard_param_frac", &shard_param_frac,
          "gemini static: fraction of chunk memory sharded over the dp group (the rest replicated)")
      .add(
          "plugin", "offload_optim_frac", &offload_optim_frac,
          "gemini static: fraction of chunks whose masters, gradients and moments live on the host")
      .add("plugin", "offload_param_frac", &offload_param_frac,
           "gemini static: fraction of sharded chunks whose parameter shard lives on the host")
      .add("plugin", "warmup_non_model_data_ratio", &warmup_non_model_data_ratio,
           "gemini auto: share of device memory kept for non-model data during warm-up")
      .add("plugin", "steady_cuda_cap_ratio", &steady_cuda_cap_ratio,
           "gemini auto: share of device memory model + non-model data may use after warm-up")
      .add("plugin", "device_capacity_mb", &device_capacity_mb,
           "gemini auto: device memory to plan for, MB (0: the GPU's total)")
      .add("plugin", "host_capacity_mb", &host_capacity_mb,
           "gemini auto: host memory the host-placed chunks may take, MB (0: 85 % of the RAM)")
      .add("plugin", "max_prefetch", &max_prefetch,
           "gemini: chunks gathered ahead in compute order")
      .add("plugin", "overlap_cpu_adam", &overlap_cpu_adam,
           "gemini: the CPU Adam of chunks held on the host runs beside the next forward "
           "(each chunk waits for its own update before use)")
      .add("plugin", "search_range_m", &search_range_m,
           "gemini: chunk size search range, millions (2^20) of elements")
      .add("plugin", "min_chunk_size_m", &min_chunk_size_m,
           "gemini: smallest chunk size, millions (2^20) of elements")
      .add("plugin", "hidden_dim", &hidden_dim, "gemini: chunk size search step (0: 1024)");
  set.min("shard_param_frac", 0)
      .max("shard_param_frac", 1)
      .min("offload_optim_frac", 0)
      .max("offload_optim_frac", 1);
  set.min("offload_param_frac", 0).max("offload_param_frac", 1).min("steady_cuda_cap_ratio", 0);
  set.max("steady_cuda_cap_ratio", 1)
      .min("warmup_non_model_data_ratio", 0)
      .max("warmup_non_model_data_ratio", 1);
  set.min("device_capacity_mb", 0)
      .min("host_capacity_mb", 0)
      .min("max_prefetch", 0)
      .min("search_range_m", 0)
      .min("min_chunk_size_m", 1e-9);
  set.min("hidden_dim", 0);
}

namespace {

class GeminiModel : public ModelWrapper {
 public:
  using ModelWrapper::ModelWrapper;
  ~GeminiModel() override {
    for (auto& h : hooks) h.remove();
  }
  // Every micro-step is reduced into the fp32 gradient shards; no_sync only records the flag.
  void set_require_grad_sync(bool s) override { sync_ = s; }
  bool require_grad_sync() const override { return sync_; }
  // Checkpoint save/load read and write the parameters: gather every chunk (collective).
  void wait_weights() override { manager->gather_all(); }
  // Saves and loads gather one chunk at a time instead.
  bool streams_weights() const override { return true; }
  void read_weight(const at::Tensor& param, bool write) override {
    manager->read_param(param, write);
  }
  void end_weight_reads() override { manager->end_reads(); }

  std::shared_ptr<zero::gemini::ChunkManager> manager;
  std::vector<nn::HookHandle> hooks;
  bool sync_ = true;
};

}  // namespace

GeminiPlugin::GeminiPlugin(GeminiPluginOptions options, dist::Communicator comm)
    : DataParallelPlugin(std::move(options), plugins::default_dp_comm(std::move(comm), "gemini")) {
  COLOSSAL_CHECK_INPUT(options_.max_norm >= 0, "gemini: max_norm must be >= 0, got ",
                       options_.max_norm);
  validate();
}

std::shared_ptr<ModelWrapper> GeminiPlugin::configure_model(
    std::shared_ptr<torch::nn::Module> model) {
  COLOSSAL_CHECK(model, "boost(): model is null");
  // Masters stay on the host (dropped once the chunk manager has its shards): a model that fits
  // the device in its working dtype is boosted without a full fp32 copy there.
  auto masters = plugins::cast_module_in_place(*model, working_dtype(precision_), options_.device,
                                               plugins::MasterCopies::kHostWhenHalf);
  // Every rank starts from rank 0's weights.
  plugins::broadcast_from_rank0(comm_, *model, masters, /*buffers=*/true);
  const zero::gemini::GeminiOptions& go = options_;
  auto unhooked = zero::gemini::unhooked_parameters(*model);
  if (!unhooked.empty())
    log_warn("gemini: ", unhooked.size(), " parameter(s) (first: '", unhooked.front(),
             "') have no colossal::nn::Module around them to gather them: kept replicated");
  auto wrapper = std::make_shared<GeminiModel>(model);
  wrapper->manager =
      std::make_shared<zero::gemini::ChunkManager>(*model, comm_, go, std::move(masters));
  wrapper->hooks = zero::gemini::install_hooks(*model, wrapper->manager);
  if (go.fp8_communication)
    log_info("gemini: fp8 communication: chunk gathers in FP8 e4m3, gradient reductions in e5m2 ",
             "over ", comm_.size(), " rank(s)");
  return wrapper;
}

std::shared_ptr<OptimizerWrapper> GeminiPlugin::configure_optimizer(
    std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model) {
  auto* gm = dynamic_cast<GeminiModel*>(&model);
  COLOSSAL_CHECK(gm, "gemini plugin: the model was not configured by this plugin");
  if (!optimizer) return nullptr;
  gm->manager->bind_optimizer(optimizer);
  return std::make_shared<GeminiOptimizerWrapper>(std::move(optimizer), gm->manager, precision_,
                                                  options_.loss_scale, options_.max_norm);
}

GeminiOptimizerWrapper::GeminiOptimizerWrapper(std::shared_ptr<optim::Optimizer> optimizer,
                                               std::shared_ptr<zero::gemini::ChunkManager> manager,
                                               Precision precision,
                                               const LossScaleOptions& loss_scale, double max_norm)
    : OptimizerWrapper(std::move(optimizer), precision, loss_scale), manager_(std::move(manager)) {
  default_max_norm_ = max_norm;
}

void GeminiOptimizerWrapper::backward(const at::Tensor& loss) {
  manager_->set_in_backward(true);
  try {
    OptimizerWrapper::backward(loss);
  } catch (...) {
    manager_->set_in_backward(false);
    throw;
  }
  manager_->set_in_backward(false);
}

double GeminiOptimizerWrapper::grad_norm_now() {
  return manager_->grad_norm(loss_scale());
}

void GeminiOptimizerWrapper::apply_update(double divisor) {
  manager_->step(divisor);
}

void GeminiOptimizerWrapper::drop_grads() {
  manager_->zero_grad();
}

bool GeminiOptimizerWrapper::step() {
  if (!OptimizerWrapper::step()) return false;
  if (++steps_ == 1 && (!dist::is_initialized() || dist::rank() == 0))
    log_info("gemini memory after warm-up: ", memory_report().dump());
  return true;
}

void GeminiOptimizerWrapper::zero_grad(bool set_to_none) {
  (void)set_to_none;  // shards are zeroed in place; .grad never outlives backward
  manager_->zero_grad();
}

optim::StateDict GeminiOptimizerWrapper::full_state_dict() {
  return manager_->state_dict();
}
void GeminiOptimizerWrapper::load_full_state_dict(const optim::StateDict& state) {
  manager_->load_state_dict(state);
}
OptimizerWrapper::FullStatePlan GeminiOptimizerWrapper::full_state_plan() {
  FullStatePlan plan;
  plan.tensors = manager_->state_plan(&plan.scalars);
  return plan;
}
at::Tensor GeminiOptimizerWrapper::full_state_tensor(const FullStatePlan& plan, size_t i) {
  COLOSSAL_CHECK(i < plan.tensors.size(), "full_state_tensor: tensor ", i, " of a plan of ",
                 plan.tensors.size());
  return manager_->gather_state(i, /*dst=*/0);
}
void GeminiOptimizerWrapper::load_full_state(const optim::StateSource& source) {
  manager_->load_state(source);
}
void GeminiOptimizerWrapper::sync_masters_from_params() {
  manager_->sync_masters_from_params();
}
json::Value GeminiOptimizerWrapper::memory_report() const {
  return manager_->memory_report().to_json();
}

}  // namespace colossal::booster
