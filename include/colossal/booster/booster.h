// Booster: the one facade a training loop is written against. The plugin decides everything
// (data parallel, ZeRO, Gemini, ...); switching strategy is a config change, not a code change.
//
//   auto plugin = std::make_shared<booster::DDPPlugin>(booster::DDPOptions{});
//   booster::Booster booster(plugin);
//   auto [model, optimizer] = booster.boost(net, adamw);
//   auto loss = criterion(model->as<Net>()->forward(x), y);
//   booster.backward(loss, *optimizer);
//   optimizer->step();  optimizer->zero_grad();
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugin.h"
#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/nn/lora.h"

namespace colossal::optim {
class LRScheduler;
}

namespace colossal::booster {

struct BoosterOptions {
  // Only for plugins that do not control them (ColossalAI's Booster(device, mixed_precision));
  // our plugins all do, so a value that contradicts the plugin is an error, not a warning.
  std::optional<std::string> device;
  std::optional<std::string> mixed_precision;
};

struct Boosted {
  std::shared_ptr<ModelWrapper> model;
  std::shared_ptr<OptimizerWrapper> optimizer;
  Criterion criterion;                           // passed through
  std::shared_ptr<data::DataLoader> dataloader;  // passed through (see Plugin::prepare_dataloader)
  std::shared_ptr<optim::LRScheduler> lr_scheduler;  // passed through; drives the wrapped optimizer
};

// Restores gradient synchronisation when it goes out of scope.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(ModelWrapper& model);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  ModelWrapper& model_;
  bool previous_;
};

class Booster {
 public:
  // plugin == nullptr: the single-process "none" plugin.
  explicit Booster(std::shared_ptr<Plugin> plugin = nullptr, BoosterOptions options = {});

  Plugin& plugin() { return *plugin_; }
  // The plugin's own when it controls its checkpoint IO, else DataParallelCheckpointIO; every
  // save_* / load_* below delegates to it.
  CheckpointIO& checkpoint_io() { return *checkpoint_io_; }

  // ColossalAI's enable_lora(model, pretrained_dir, lora_config): LoRA adapters on `model`'s
  // linear layers named in target_modules (nn::apply_lora: every other parameter is frozen, the
  // adapters train), before this Booster boosts it; returns the adapted module paths. Build the
  // optimizer afterwards, over the parameters that require grad. The config is kept with the
  // model (boost hands it to the ModelWrapper) for save_lora_as_pretrained.
  //   booster.enable_lora(model, nn::LoraConfig{.r = 8, .lora_alpha = 16,
  //                                             .target_modules = {"q_proj", "v_proj"}});
  //   auto [wrapped, opt] = booster.boost(model, adamw_over_trainable(model));
  //   ... train ...
  //   booster.save_lora_as_pretrained(*wrapped, "out/adapter");
  // InputError when the plugin does not support_lora() (naming it), the model was boosted by
  // this Booster already, or for nn::apply_lora's reasons (bad config, a target matching no
  // linear layer, a layer with LoRA already). `seed` initialises A (B starts at zero).
  // QLoRA (ColossalAI's quantize=True, bitsandbytes NF4): give enable_lora a model whose linear
  // layers are nn::QuantizedLinear already: checkpoint::load_pretrained(dir, {.quantize = ...})
  // quantizes them as the folder is read (the full-precision model never exists), or
  // nn::quantize_linears(model, cfg) quantizes a built one; the adapters go on top the same way.
  std::vector<std::string> enable_lora(const std::shared_ptr<torch::nn::Module>& model,
                                       const nn::LoraConfig& lora_config, uint64_t seed = 0);
  // The same from a PEFT adapter folder (adapter_config.json + adapter_model.safetensors, as
  // save_lora_as_pretrained or peft's save_pretrained write it) to continue training it
  // (ColossalAI's pretrained_dir: PeftModel.from_pretrained(is_trainable=True)). The folder's
  // adapter_config.json decides the config; a lora_config given as well must agree with it
  // (r, lora_alpha, lora_dropout, target_modules in any order, bias, use_rslora; init does not
  // matter for loaded weights), else an InputError naming the field and the file (ColossalAI
  // ignores lora_config then). The adapter's tensors load strictly (checkpoint::load_lora_adapter).
  std::vector<std::string> enable_lora(const std::shared_ptr<torch::nn::Module>& model,
                                       const std::string& pretrained_dir,
                                       const std::optional<nn::LoraConfig>& lora_config = {});
  // The config enable_lora applied to `model` (before or after boost); null when it did not.
  const nn::LoraConfig* lora_config(const torch::nn::Module& model) const;
  // ColossalAI's save_lora_as_pretrained(model, checkpoint, use_safetensors): the adapters' trained
  // values in PEFT's folder format (checkpoint/lora.h: adapter_config.json with the config of
  // enable_lora, adapter_model.safetensors under PEFT's tensor names, always safetensors), so
  // peft.PeftModel.from_pretrained and enable_lora(model, dir) load it. `base_model` goes to
  // base_model_name_or_path. Collective: every rank calls it; the adapters alone are gathered
  // from wherever the plugin holds them (CheckpointIO::gather_model_tensors: Gemini's chunks one
  // at a time, never the whole model), and global rank 0 writes the two files into `dir`
  // (created; each file atomic, the config last; other files there stay). A write error on rank 0
  // is raised on every rank. InputError when the model has no LoRA from enable_lora.
  void save_lora_as_pretrained(ModelWrapper& model, const std::string& dir,
                               const std::string& base_model = "");

  // ColossalAI's boost(model, optimizer, criterion, dataloader, lr_scheduler).
  Boosted boost(std::shared_ptr<torch::nn::Module> model,
                std::shared_ptr<optim::Optimizer> optimizer = nullptr, Criterion criterion = {},
                std::shared_ptr<data::DataLoader> dataloader = nullptr,
                std::shared_ptr<optim::LRScheduler> lr_scheduler = nullptr);

  void backward(const at::Tensor& loss, OptimizerWrapper& optimizer);
  // Gradients accumulate locally until the guard ends; the next synchronised backward reduces
  // the accumulated sum. Requires plugin().support_no_sync().
  [[nodiscard]] std::unique_ptr<NoSyncGuard> no_sync(ModelWrapper& model,
                                                     OptimizerWrapper* optimizer = nullptr);
  double clip_grad_by_norm(OptimizerWrapper& optimizer, double max_norm, double norm_type = 2.0);
  // ColossalAI's execute_pipeline(data_iter, model, criterion, optimizer, return_loss,
  // return_outputs): one step of forward + backward over the plugin's pipeline schedule, the
  // batch from data_iter split into num_microbatches (or batches of microbatch_size); the
  // gradients are synchronised unless inside no_sync. criterion empty: the model's own loss (a
  // models::CausalLM's fused or vocab-parallel cross-entropy). Needs plugin().support_pipeline()
  // (the hybrid plugin with pp_size > 1); the others reject it with a clear error.
  PipelineOutput execute_pipeline(const BatchIterator& data_iter, ModelWrapper& model,
                                  const Criterion& criterion = {},
                                  OptimizerWrapper* optimizer = nullptr, bool return_loss = true,
                                  bool return_outputs = false, const PipelineStep& step = {});

  // Checkpoints, through checkpoint_io() (formats: see DataParallelCheckpointIO).
  // Model: HF safetensors (`model.safetensors`, or shards + index when shard=true), plus
  // config.json for the project's own models. Written by global rank 0, atomically.
  //
  // use_async (ColossalAI's): the save gathers and stages what this rank writes in host memory
  // and returns; a background thread writes the files (checkpoint::AsyncWriter: costs host
  // memory for all this rank writes, where a synchronous save holds one tensor). Files land
  // atomically, in call order; folders the IO stages (pipeline-stage saves) are published by
  // wait_async_save(). Every load waits for this Booster's asynchronous saves first.
  void save_model(ModelWrapper& model, const std::string& dir, bool shard = false,
                  int64_t size_per_shard = 1024, bool use_async = false);
  void load_model(ModelWrapper& model, const std::string& path, bool strict = true,
                  OptimizerWrapper* optimizer = nullptr);
  // Optimizer: full-shape states keyed by parameter name (`optimizer.safetensors` +
  // `optimizer.json` in `dir`), so they load into any layout.
  void save_optimizer(OptimizerWrapper& optimizer, const std::string& dir, bool use_async = false);
  void load_optimizer(OptimizerWrapper& optimizer, const std::string& dir);
  void save_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file,
                         bool use_async = false);
  void load_lr_scheduler(optim::LRScheduler& scheduler, const std::string& file);
  // Collective: blocks until every asynchronous save of this Booster is written on every rank,
  // then publishes the folders they staged (rank 0); rethrows a background write error (then
  // nothing of that save is published). The destructor finishes the writes but publishes
  // nothing and cannot report errors: call this before exiting.
  void wait_async_save();
  bool async_save_pending() const { return async_pending_; }
  // The background writer of use_async saves (for callers that stage more files, e.g. the
  // trainer's state, under a checkpoint::WriteCapture of it).
  checkpoint::AsyncWriter& async_writer();

 private:
  // A Booster argument contradicting the plugin's own precision or device is an InputError.
  void check_against_plugin(const BoosterOptions& options) const;
  std::shared_ptr<Plugin> plugin_;
  std::shared_ptr<CheckpointIO> checkpoint_io_;
  std::unique_ptr<checkpoint::AsyncWriter> async_;  // made by the first use_async save
  // enable_lora's checks; records `config` for `model`.
  void check_lora_allowed(const std::shared_ptr<torch::nn::Module>& model) const;
  std::vector<std::string> remember_lora(const std::shared_ptr<torch::nn::Module>& model,
                                         nn::LoraConfig config);
  // The modules boost() was given (enable_lora refuses them) and the configs enable_lora
  // applied, by module (weak: the Booster does not keep models alive).
  std::vector<std::weak_ptr<torch::nn::Module>> boosted_;
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::shared_ptr<const nn::LoraConfig>>>
      lora_;
  bool async_pending_ = false;
};

}  // namespace colossal::booster
