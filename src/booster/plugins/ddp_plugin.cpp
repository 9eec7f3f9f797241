// The none and ddp plugins (see ddp_plugin.h).
#include "colossal/booster/plugins/ddp_plugin.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "booster/plugins/plugin_common.h"
#include "colossal/booster/grad_sync.h"
#include "colossal/booster/step_overlap.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/dist/runtime.h"
#include "colossal/optim/optimizer.h"

namespace colossal::booster {

void DDPOptions::register_options(OptionSet& set) {
  set.add("plugin", "precision", &precision, "training precision", {"fp32", "bf16", "fp16"})
      .add("plugin", "bucket_cap_mb", &bucket_cap_mb, "ddp: gradient bucket size in MB")
      .add("plugin", "broadcast_buffers", &broadcast_buffers,
           "ddp: broadcast buffers from rank 0 at boost")
      .add("plugin", "fp32_grad_reduce", &fp32_grad_reduce,
           "ddp: all-reduce bf16/fp16 gradients in fp32")
      .add("plugin", "fp8_communication", &fp8_communication,
           "ddp, low_level_zero, gemini: gradients (e5m2) and ZeRO/Gemini weight all-gathers "
           "(e4m3) travel in FP8 with per-rank scales")
      .add("plugin", "overlap_step", &overlap_step,
           "ddp: run each step's optimizer update beside the next forward, layer by layer (a "
           "side stream on CUDA; bitwise the same result). Measured 0.99x on an H100 at its "
           "power limit (docs/benchmarks.md), hence off by default")
      .add("plugin", "initial_scale", &loss_scale.initial_scale, "fp16: initial loss scale")
      .add("plugin", "min_scale", &loss_scale.min_scale, "fp16: minimum loss scale")
      .add("plugin", "max_scale", &loss_scale.max_scale, "fp16: maximum loss scale")
      .add("plugin", "growth_factor", &loss_scale.growth_factor, "fp16: loss-scale growth factor")
      .add("plugin", "backoff_factor", &loss_scale.backoff_factor,
           "fp16: loss-scale backoff factor")
      .add("plugin", "growth_interval", &loss_scale.growth_interval,
           "fp16: clean steps before growing the scale")
      .add("plugin", "hysteresis", &loss_scale.hysteresis, "fp16: overflows before backing off");
  set.min("bucket_cap_mb", 1e-6)
      .min("initial_scale", 1e-30)
      .min("min_scale", 1e-30)
      .min("growth_factor", 1.0);
  set.min("backoff_factor", 1e-9)
      .max("backoff_factor", 1.0)
      .min("growth_interval", 1)
      .min("hysteresis", 1);
}

namespace {

class DDPModel : public ModelWrapper {
 public:
  DDPModel(std::shared_ptr<torch::nn::Module> module, dist::Communicator comm,
           GradSync::Options opts, std::vector<std::pair<std::string, at::Tensor>> masters)
      : ModelWrapper(std::move(module)), masters(std::move(masters)) {
    if (comm.size() > 1)
      sync = std::make_unique<GradSync>(plugins::trainable(this->module()), comm, opts);
  }
  void set_require_grad_sync(bool s) override {
    if (sync) sync->set_enabled(s);
    require_sync_ = s;
  }
  bool require_grad_sync() const override { return require_sync_; }
  void finish_backward() override {
    if (sync) sync->finish();
  }
  // overlap_step: the update step() left running lands first.
  void wait_weights() override {
    if (auto o = overlap.lock()) o->finish();
  }
  std::unique_ptr<GradSync> sync;
  std::vector<std::pair<std::string, at::Tensor>> masters;  // handed to the optimizer once
  std::weak_ptr<StepOverlap> overlap;
  bool require_sync_ = true;
};

std::shared_ptr<OptimizerWrapper> wrap_optimizer(
    std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model, Precision precision,
    const LossScaleOptions& ls, std::vector<std::pair<std::string, at::Tensor>>& masters,
    amp::GradReducer reducer) {
  if (!optimizer) return nullptr;
  plugins::check_optimizer_params(*optimizer, model.module());
  if (precision != Precision::FP32) optimizer->adopt_masters(masters);
  masters.clear();
  return std::make_shared<OptimizerWrapper>(std::move(optimizer), precision, ls,
                                            std::move(reducer));
}

}  // namespace

DDPPlugin::DDPPlugin(DDPOptions options, dist::Communicator comm)
    : DataParallelPlugin(std::move(options), plugins::default_dp_comm(std::move(comm), "ddp")) {
  validate();
}

std::shared_ptr<ModelWrapper> DDPPlugin::configure_model(std::shared_ptr<torch::nn::Module> model) {
  COLOSSAL_CHECK(model, "boost(): model is null");
  auto masters = plugins::cast_module_in_place(*model, working_dtype(precision_), options_.device);
  // Every rank starts from rank 0's weights (and buffers), as torch DDP does.
  plugins::broadcast_from_rank0(comm_, *model, masters, options_.broadcast_buffers);
  GradSync::Options gs;
  gs.bucket_cap_mb = options_.bucket_cap_mb;
  if (options_.fp32_grad_reduce && precision_ != Precision::FP32)
    gs.communication_dtype = at::kFloat;
  if (options_.fp8_communication) {
    gs.fp8 = at::kFloat8_e5m2;
    log_info(
        "ddp: fp8 communication: gradients all-reduced in FP8 e5m2 with per-slice scales over ",
        comm_.size(), " rank(s)");
  }
  return std::make_shared<DDPModel>(std::move(model), comm_, gs, std::move(masters));
}

std::shared_ptr<OptimizerWrapper> DDPPlugin::configure_optimizer(
    std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model) {
  auto* ddp = dynamic_cast<DDPModel*>(&model);
  COLOSSAL_CHECK(ddp, "ddp plugin: the model was not configured by this plugin");
  // Gradients are identical on every rank after the all-reduce: norms and overflow are local.
  auto wrapped = wrap_optimizer(std::move(optimizer), model, precision_, options_.loss_scale,
                                ddp->masters, amp::GradReducer{});
  if (wrapped && options_.overlap_step) {
    const bool cuda = options_.device == "cuda";  // validated: "cpu" or "cuda"
    wrapped->enable_step_overlap(model.module(), /*deferred=*/!cuda);
    const auto& o = *wrapped->step_overlap();
    ddp->overlap = wrapped->step_overlap();
    log_info("ddp: overlap_step: the update runs ", cuda ? "on a side stream" : "deferred", " in ",
             o.num_buckets(), " layer buckets, each waited for by its layer's forward; ",
             o.num_unhooked(), " parameters outside any colossal layer are updated at step()");
  }
  return wrapped;
}

NonePlugin::NonePlugin(std::string precision, std::string device, LossScaleOptions loss_scale)
    : precision_(precision_from_string(precision)),
      device_(std::move(device)),
      loss_scale_(loss_scale) {
  COLOSSAL_CHECK_INPUT(!dist::is_initialized() || dist::world_size() == 1,
                       "plugin 'none' runs a single process, but ", dist::world_size(),
                       " ranks were started: use --plugin ddp");
  validate();
}

std::vector<Precision> NonePlugin::supported_precisions() const {
  return {Precision::FP32, Precision::BF16, Precision::FP16};
}

namespace {
class PlainModel : public ModelWrapper {
 public:
  PlainModel(std::shared_ptr<torch::nn::Module> m,
             std::vector<std::pair<std::string, at::Tensor>> masters)
      : ModelWrapper(std::move(m)), masters(std::move(masters)) {}
  std::vector<std::pair<std::string, at::Tensor>> masters;
};
}  // namespace

std::shared_ptr<ModelWrapper> NonePlugin::configure_model(
    std::shared_ptr<torch::nn::Module> model) {
  COLOSSAL_CHECK(model, "boost(): model is null");
  auto masters = plugins::cast_module_in_place(*model, working_dtype(precision_), device_);
  return std::make_shared<PlainModel>(std::move(model), std::move(masters));
}

std::shared_ptr<OptimizerWrapper> NonePlugin::configure_optimizer(
    std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model) {
  auto* plain = dynamic_cast<PlainModel*>(&model);
  COLOSSAL_CHECK(plain, "none plugin: the model was not configured by this plugin");
  return wrap_optimizer(std::move(optimizer), model, precision_, loss_scale_, plain->masters,
                        amp::GradReducer{});
}

}  // namespace colossal::booster
