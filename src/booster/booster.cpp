// The Booster facade (see booster.h): boost, backward, no_sync and checkpoints delegated to the
// plugin's checkpoint IO.
#include "colossal/booster/booster.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/dist/runtime.h"

namespace colossal::booster {

NoSyncGuard::NoSyncGuard(ModelWrapper& model)
    : model_(model), previous_(model.require_grad_sync()) {
  model_.set_require_grad_sync(false);
}
NoSyncGuard::~NoSyncGuard() {
  model_.set_require_grad_sync(previous_);
}

Booster::Booster(std::shared_ptr<Plugin> plugin, BoosterOptions options)
    : plugin_(std::move(plugin)) {
  if (!plugin_) {
    plugin_ = std::make_shared<NonePlugin>(options.mixed_precision.value_or("fp32"),
                                           options.device.value_or("cpu"));
  } else {
    check_against_plugin(options);
  }
  if (plugin_->control_checkpoint_io()) {
    checkpoint_io_ = plugin_->checkpoint_io();
    COLOSSAL_CHECK(checkpoint_io_, "plugin '", plugin_->name(),
                   "' controls its checkpoint IO but checkpoint_io() returned null");
  } else {
    checkpoint_io_ = std::make_shared<DataParallelCheckpointIO>();
  }
}

void Booster::check_against_plugin(const BoosterOptions& options) const {
  // Every plugin of ours controls precision and device: a contradicting Booster argument is a
  // mistake worth stopping for (ColossalAI only warns and ignores it).
  if (options.mixed_precision)
    COLOSSAL_CHECK_INPUT(precision_from_string(*options.mixed_precision) == plugin_->precision(),
                         "Booster: mixed_precision '", *options.mixed_precision,
                         "' contradicts plugin '", plugin_->name(), "' precision '",
                         to_string(plugin_->precision()), "'; set the precision on the plugin");
  if (options.device)
    COLOSSAL_CHECK_INPUT(*options.device == plugin_->device(), "Booster: device '", *options.device,
                         "' contradicts plugin '", plugin_->name(), "' device '", plugin_->device(),
                         "'");
}

Boosted Booster::boost(std::shared_ptr<torch::nn::Module> model,
                       std::shared_ptr<optim::Optimizer> optimizer, Criterion criterion,
                       std::shared_ptr<data::DataLoader> dataloader,
                       std::shared_ptr<optim::LRScheduler> lr_scheduler) {
  plugin_->validate();
  Boosted out;
  out.model = plugin_->configure_model(std::move(model));
  if (optimizer) out.optimizer = plugin_->configure_optimizer(std::move(optimizer), *out.model);
  out.criterion = std::move(criterion);
  out.dataloader = std::move(dataloader);
  out.lr_scheduler = std::move(lr_scheduler);
  return out;
}

void Booster::backward(const at::Tensor& loss, OptimizerWrapper& optimizer) {
  // Gradient synchronisation (ddp) finishes inside backward, from the autograd engine's final
  // callback, so a plain loss.backward() is synchronised as well.
  optimizer.backward(loss);
}

std::unique_ptr<NoSyncGuard> Booster::no_sync(ModelWrapper& model, OptimizerWrapper* optimizer) {
  (void)optimizer;
  COLOSSAL_CHECK_INPUT(plugin_->support_no_sync(), "plugin '", plugin_->name(),
                       "' does not support no_sync (gradient accumulation)");
  return std::make_unique<NoSyncGuard>(model);
}

double Booster::clip_grad_by_norm(OptimizerWrapper& optimizer, double max_norm, double norm_type) {
  return optimizer.clip_grad_by_norm(max_norm, norm_type);
}

PipelineOutput Booster::execute_pipeline(const BatchIterator& data_iter, ModelWrapper& model,
                                         const Criterion& criterion, OptimizerWrapper* optimizer,
                                         bool return_loss, bool return_outputs,
                                         const PipelineStep& step) {
  COLOSSAL_CHECK_INPUT(plugin_->support_pipeline(), "plugin '", plugin_->name(),
                       "' is not a pipeline plugin: execute_pipeline needs the hybrid plugin with "
                       "pp_size > 1");
  COLOSSAL_CHECK_INPUT(data_iter, "execute_pipeline: data_iter is empty");
  return plugin_->execute_pipeline(data_iter, model, criterion, optimizer, return_loss,
                                   return_outputs, step);
}

checkpoint::AsyncWriter& Booster::async_writer() {
  if (!async_) async_ = std::make_unique<checkpoint::AsyncWriter>();
  return *async_;
}

void Booster::wait_async_save() {
  if (!async_pending_) return;
  async_pending_ = false;
  std::exception_ptr error;
  try {
    async_->wait();
  } catch (...) {
    error = std::current_exception();
  }
  // Folders may hold files of several ranks: publish them once every rank has written its own.
  // A rank whose writes failed says so, and then no rank publishes.
  at::Tensor failed = at::full({1}, error ? 1 : 0, at::kInt);
  const bool multi = dist::is_initialized() && dist::world_size() > 1;
  if (multi) dist::world_cpu().all_reduce(failed, dist::ReduceOp::Max);
  auto commits = async_->take_deferred_commits();
  if (error) std::rethrow_exception(error);
  COLOSSAL_CHECK(failed.item<int>() == 0,
                 "asynchronous checkpoint save failed on another rank: nothing was published");
  if (!multi || dist::rank() == 0)
    for (auto& c : commits) c();
  if (multi) dist::world_cpu().barrier();
}

namespace {
// Runs `save` with this thread's checkpoint writes going to `writer` (use_async) or the disk.
template <class F>
void maybe_async(checkpoint::AsyncWriter* writer, const F& save) {
  if (!writer) return save();
  checkpoint::WriteCapture capture(*writer);
  save();
}
}  // namespace

void Booster::save_model(ModelWrapper& model, const std::string& dir, bool shard,
                         int64_t size_per_shard, bool use_async) {
  COLOSSAL_CHECK_INPUT(size_per_shard > 0, "save_model: size_per_shard must be > 0 MB, got ",
                       size_per_shard);
  if (use_async) async_pending_ = true;
  maybe_async(use_async ? &async_writer() : nullptr,
              [&] { checkpoint_io_->save_model(model, dir, shard, size_per_shard); });
}

void Booster::load_model(ModelWrapper& model, const std::string& path, bool strict,
                         OptimizerWrapper* optimizer) {
  wait_async_save();
  checkpoint_io_->load_model(model, path, strict, optimizer);
}

void Booster::save_optimizer(OptimizerWrapper& optimizer, const std::string& dir, bool use_async) {
  if (use_async) async_pending_ = true;
  maybe_async(use_async ? &async_writer() : nullptr,
              [&] { checkpoint_io_->save_optimizer(optimizer, dir); });
}

void Booster::load_optimizer(OptimizerWrapper& optimizer, const std::string& dir) {
  wait_async_save();
  checkpoint_io_->load_optimizer(optimizer, dir);
}

void Booster::save_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file,
                                bool use_async) {
  if (use_async) async_pending_ = true;
  maybe_async(use_async ? &async_writer() : nullptr,
              [&] { checkpoint_io_->save_lr_scheduler(scheduler, file); });
}

void Booster::load_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) {
  wait_async_save();
  checkpoint_io_->load_lr_scheduler(scheduler, file);
}

}  // namespace colossal::booster
