#include "colossal/booster/booster.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <filesystem>

#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/logging.h"
#include "colossal/dist/runtime.h"
#include "colossal/nn/causal_lm.h"
#include "colossal/optim/lr_scheduler.h"
#include "colossal/optim/optimizer.h"

namespace colossal::booster {

NoSyncGuard::NoSyncGuard(ModelWrapper& model) : model_(model), previous_(model.require_grad_sync()) {
  model_.set_require_grad_sync(false);
}
NoSyncGuard::~NoSyncGuard() { model_.set_require_grad_sync(previous_); }

Booster::Booster(std::shared_ptr<Plugin> plugin, BoosterOptions options) : plugin_(std::move(plugin)) {
  if (!plugin_) {
    plugin_ = std::make_shared<NonePlugin>(options.mixed_precision.value_or("fp32"), options.device.value_or("cpu"));
    return;
  }
  // Every plugin of ours controls precision and device: a contradicting Booster argument is a
  // mistake worth stopping for (ColossalAI only warns and ignores it).
  if (options.mixed_precision)
    COLOSSAL_CHECK_INPUT(precision_from_string(*options.mixed_precision) == plugin_->precision(), "Booster: mixed_precision '",
                         *options.mixed_precision, "' contradicts plugin '", plugin_->name(), "' precision '",
                         to_string(plugin_->precision()), "'; set the precision on the plugin");
  if (options.device)
    COLOSSAL_CHECK_INPUT(*options.device == plugin_->device(), "Booster: device '", *options.device,
                         "' contradicts plugin '", plugin_->name(), "' device '", plugin_->device(), "'");
}

Boosted Booster::boost(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<optim::Optimizer> optimizer,
                       Criterion criterion, std::shared_ptr<data::DataLoader> dataloader,
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

void Booster::execute_pipeline() {
  throw InputError(str("plugin '", plugin_->name(), "' is not a pipeline plugin: execute_pipeline needs pp_size > 1 "
                       "(the hybrid plugin)"));
}

bool Booster::is_writer() const { return !dist::is_initialized() || dist::rank() == 0; }

void Booster::barrier() {
  if (dist::is_initialized() && dist::world_size() > 1) dist::world_cpu().barrier();
}

void Booster::save_model(ModelWrapper& model, const std::string& dir, bool shard, int64_t size_per_shard) {
  COLOSSAL_CHECK_INPUT(size_per_shard > 0, "save_model: size_per_shard must be > 0 MB, got ", size_per_shard);
  model.wait_weights();
  if (is_writer()) {
    checkpoint::SaveOptions so;
    so.shard = shard;
    so.size_per_shard_mb = size_per_shard;
    if (auto lm = std::dynamic_pointer_cast<nn::CausalLM>(model.module_ptr())) {
      checkpoint::save_pretrained(*lm, dir, so);
    } else {
      checkpoint::save_state_dict(dir, checkpoint::module_state(model.module()), so);
    }
  }
  barrier();
}

void Booster::load_model(ModelWrapper& model, const std::string& path, bool strict, OptimizerWrapper* optimizer) {
  model.wait_weights();  // a late all-gather must not overwrite the loaded weights
  checkpoint::load_into_module(model.module(), checkpoint::load_state_dict(path), strict);
  // fp32 masters follow the loaded weights (ColossalAI's update_master_params).
  if (optimizer) optimizer->sync_masters_from_params();
}

void Booster::save_optimizer(OptimizerWrapper& optimizer, const std::string& dir) {
  optim::StateDict sd = optimizer.full_state_dict();  // collective under ZeRO
  if (is_writer()) {
    std::filesystem::create_directories(dir);
    json::Value scalars = sd.scalars;
    scalars.set("wrapper", optimizer.state());
    checkpoint::TensorList tensors;
    for (auto& [n, t] : sd.tensors) tensors.emplace_back(n, t.detach().to(at::kCPU));
    checkpoint::save_safetensors(dir + "/optimizer.safetensors", tensors, {{"format", "colossal-optimizer"}});
    std::string text = scalars.dump(2);
    checkpoint::write_file_atomic(dir + "/optimizer.json", [&](int fd) {
      checkpoint::write_all(fd, text.data(), text.size(), dir + "/optimizer.json");
    });
  }
  barrier();
}

void Booster::load_optimizer(OptimizerWrapper& optimizer, const std::string& dir) {
  optim::StateDict sd;
  sd.tensors = checkpoint::load_safetensors(dir + "/optimizer.safetensors");
  sd.scalars = json::parse_file(dir + "/optimizer.json");
  optimizer.load_full_state_dict(sd);
  if (const json::Value* w = sd.scalars.find("wrapper")) optimizer.load_state(*w);
}

void Booster::save_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) {
  if (is_writer()) {
    std::string text = scheduler.state_dict().dump(2);
    checkpoint::write_file_atomic(file, [&](int fd) { checkpoint::write_all(fd, text.data(), text.size(), file); });
  }
  barrier();
}

void Booster::load_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file) {
  scheduler.load_state_dict(json::parse_file(file));
}

}  // namespace colossal::booster
