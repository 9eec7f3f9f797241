// The Booster facade (see booster.h): boost, backward, no_sync and checkpoints delegated to the
// plugin's checkpoint IO.
#include "colossal/booster/booster.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <exception>

#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/checkpoint/lora.h"
#include "colossal/core/weights_epoch.h"
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
  std::erase_if(boosted_, [](const auto& b) { return b.expired(); });
  if (model) boosted_.push_back(model);
  std::shared_ptr<const nn::LoraConfig> lora_cfg;  // enable_lora's, for save_lora_as_pretrained
  for (const auto& [m, cfg] : lora_)
    if (model && m.lock() == model) lora_cfg = cfg;
  out.model = plugin_->configure_model(std::move(model));
  if (lora_cfg) out.model->set_lora_config(std::move(lora_cfg));
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

// ---- LoRA ----

void Booster::check_lora_allowed(const std::shared_ptr<torch::nn::Module>& model) const {
  COLOSSAL_CHECK_INPUT(model, "Booster::enable_lora: the model is null");
  COLOSSAL_CHECK_INPUT(plugin_->support_lora(), "Booster::enable_lora: LoRA under plugin '",
                       plugin_->name(),
                       "' is not supported yet; use none, ddp, low_level_zero (zero1, zero2), "
                       "gemini or gemini_auto");
  for (const auto& b : boosted_)
    COLOSSAL_CHECK_INPUT(b.lock() != model,
                         "Booster::enable_lora: the model was boosted already; call enable_lora "
                         "before boost (the plugin has placed and wrapped its parameters, and "
                         "the optimizer does not know the adapters)");
}

std::vector<std::string> Booster::remember_lora(const std::shared_ptr<torch::nn::Module>& model,
                                                nn::LoraConfig config) {
  std::erase_if(lora_, [](const auto& e) { return e.first.expired(); });
  lora_.emplace_back(model, std::make_shared<const nn::LoraConfig>(std::move(config)));
  std::vector<std::string> paths;
  for (const auto& m : model->named_modules("", /*include_self=*/false))
    if (std::dynamic_pointer_cast<nn::LoraLinear>(m.value())) paths.push_back(m.key());
  return paths;
}

std::vector<std::string> Booster::enable_lora(const std::shared_ptr<torch::nn::Module>& model,
                                              const nn::LoraConfig& lora_config, uint64_t seed) {
  check_lora_allowed(model);
  nn::apply_lora(*model, lora_config, seed);
  return remember_lora(model, lora_config);
}

namespace {

// The first field in which `given` contradicts the adapter folder's `file` config ("" if none).
std::string lora_config_difference(const nn::LoraConfig& given, const nn::LoraConfig& file) {
  auto sorted = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& t : v) s += (s.empty() ? "" : ",") + t;
    return "[" + s + "]";
  };
  if (given.r != file.r) return str("r = ", given.r, " but the folder's is ", file.r);
  if (given.lora_alpha != file.lora_alpha)
    return str("lora_alpha = ", given.lora_alpha, " but the folder's is ", file.lora_alpha);
  if (given.lora_dropout != file.lora_dropout)
    return str("lora_dropout = ", given.lora_dropout, " but the folder's is ", file.lora_dropout);
  if (sorted(given.target_modules) != sorted(file.target_modules))
    return str("target_modules = ", list(given.target_modules), " but the folder's are ",
               list(file.target_modules));
  if (given.bias != file.bias)
    return str("bias = '", given.bias, "' but the folder's is '", file.bias, "'");
  if (given.use_rslora != file.use_rslora)
    return str("use_rslora = ", given.use_rslora ? "true" : "false", " but the folder's is ",
               file.use_rslora ? "true" : "false");
  return "";
}

}  // namespace

std::vector<std::string> Booster::enable_lora(const std::shared_ptr<torch::nn::Module>& model,
                                              const std::string& pretrained_dir,
                                              const std::optional<nn::LoraConfig>& lora_config) {
  check_lora_allowed(model);
  COLOSSAL_CHECK_INPUT(!pretrained_dir.empty(),
                       "Booster::enable_lora: pretrained_dir is empty (give an adapter folder, or "
                       "a LoraConfig for new adapters)");
  if (lora_config) {
    const nn::LoraConfig file = checkpoint::read_lora_config(pretrained_dir);
    const std::string diff = lora_config_difference(*lora_config, file);
    COLOSSAL_CHECK_INPUT(diff.empty(), "Booster::enable_lora: lora_config contradicts ",
                         pretrained_dir, "/adapter_config.json: ", diff,
                         " (the adapter folder decides its config: pass no lora_config, or one "
                         "that agrees)");
  }
  nn::LoraConfig cfg = checkpoint::load_lora_adapter(*model, pretrained_dir);
  return remember_lora(model, std::move(cfg));
}

const nn::LoraConfig* Booster::lora_config(const torch::nn::Module& model) const {
  for (const auto& [m, cfg] : lora_)
    if (auto p = m.lock(); p.get() == &model) return cfg.get();
  return nullptr;
}

void Booster::save_lora_as_pretrained(ModelWrapper& model, const std::string& dir,
                                      const std::string& base_model) {
  COLOSSAL_CHECK_INPUT(!dir.empty(), "Booster::save_lora_as_pretrained: the folder is empty");
  const nn::LoraConfig* cfg = model.lora_config();
  if (!cfg) {
    bool has_lora = false;
    for (const auto& m : model.module().modules(/*include_self=*/false))
      has_lora = has_lora || std::dynamic_pointer_cast<nn::LoraLinear>(m) != nullptr;
    COLOSSAL_CHECK_INPUT(!has_lora,
                         "Booster::save_lora_as_pretrained: the model's LoRA layers were not "
                         "applied by Booster::enable_lora of the Booster that boosted it, so "
                         "their config is unknown (use checkpoint::save_lora_adapter with the "
                         "config)");
    throw InputError(
        "Booster::save_lora_as_pretrained: the model has no LoRA adapters (call "
        "Booster::enable_lora before boost)");
  }
  const checkpoint::TensorList adapters = checkpoint_io_->gather_model_tensors(
      model, [](const std::string& name) { return nn::is_lora_parameter(name); });
  const bool multi = dist::is_initialized() && dist::world_size() > 1;
  std::exception_ptr error;
  if (!multi || dist::rank() == 0) {
    try {
      checkpoint::save_lora_adapter(adapters, *cfg, dir, base_model);
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Rank 0's verdict reaches every rank, which all return (or throw) together.
  at::Tensor failed = at::full({1}, error ? 1 : 0, at::kInt);
  if (multi) dist::world_cpu().all_reduce(failed, dist::ReduceOp::Max);
  if (error) std::rethrow_exception(error);
  COLOSSAL_CHECK(failed.item<int>() == 0,
                 "Booster::save_lora_as_pretrained: rank 0 failed to write the adapter to ", dir);
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
  bump_weights_epoch();
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
