// What boost() returns: the model and optimizer wrapped so they behave like the originals, with
// the strategy (gradient sync, mixed precision, loss scaling, clipping) inside.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <typeinfo>

#include "colossal/amp/grad_reducer.h"
#include "colossal/booster/plugin.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"

namespace torch::nn {
class Module;
}
namespace colossal::amp {
class DynamicGradScaler;
}
namespace colossal::nn {
struct LoraConfig;
}
namespace colossal::optim {
struct StateDict;
class StateSource;
}  // namespace colossal::optim

namespace colossal::booster {

class StepOverlap;

class ModelWrapper {
 public:
  explicit ModelWrapper(std::shared_ptr<torch::nn::Module> module) : module_(std::move(module)) {}
  virtual ~ModelWrapper() = default;

  // The original module (same object the user passed in), e.g. to call its typed forward.
  torch::nn::Module& module() { return *module_; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return module_; }
  template <class M>
  std::shared_ptr<M> as() const {
    auto p = std::dynamic_pointer_cast<M>(module_);
    COLOSSAL_CHECK(p, "the boosted model is not a ", typeid(M).name());
    return p;
  }

  // Gradient synchronisation hooks used by Booster::backward and no_sync.
  virtual void set_require_grad_sync(bool sync) { (void)sync; }
  virtual bool require_grad_sync() const { return true; }
  virtual void finish_backward() {}
  // Blocks until every in-flight update of the module's weights has landed (ZeRO's
  // overlap_allgather, ddp's overlap_step); Booster calls it before reading or writing weights
  // outside forward.
  virtual void wait_weights() {}
  // Weights held sharded (Gemini) are saved and loaded one group at a time instead of all
  // gathered at once (bounded memory): streams_weights() says so; read_weight(p, write) makes
  // parameter p readable (and, with write, writable: the change reaches the shards) on every
  // rank (collective: every rank calls it for the same parameters in the same order), keeping
  // at most one group (chunk) gathered beyond training; end_weight_reads() releases it.
  virtual bool streams_weights() const { return false; }
  virtual void read_weight(const at::Tensor& param, bool write = false) {
    (void)param;
    (void)write;
  }
  virtual void end_weight_reads() {}

  // The LoRA config Booster::enable_lora applied to the module (null when it has none from
  // there): what Booster::save_lora_as_pretrained writes to adapter_config.json.
  const nn::LoraConfig* lora_config() const { return lora_config_.get(); }
  void set_lora_config(std::shared_ptr<const nn::LoraConfig> cfg) { lora_config_ = std::move(cfg); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<const nn::LoraConfig> lora_config_;
};

class OptimizerWrapper {
 public:
  OptimizerWrapper(std::shared_ptr<optim::Optimizer> optimizer, Precision precision,
                   const LossScaleOptions& loss_scale, amp::GradReducer reducer = {});
  virtual ~OptimizerWrapper();

  optim::Optimizer& optimizer() { return *optimizer_; }
  const std::shared_ptr<optim::Optimizer>& optimizer_ptr() const { return optimizer_; }

  // loss.backward(), scaled by the loss scale under fp16.
  virtual void backward(const at::Tensor& loss);
  // Gradients changed outside backward() (a pipeline schedule ran its own backward passes): the
  // norm computed before is stale.
  void invalidate_norm() { norm_valid_ = false; }
  // Computes the global gradient norm now (fp64, unscaled) and clips at step time: unscaling
  // and clipping are applied in the same pass as the update. Returns the norm (inf/nan on
  // fp16 overflow).
  virtual double clip_grad_by_norm(double max_norm, double norm_type = 2.0);
  // One update; under fp16, a step with inf/nan gradients on any rank is skipped on every rank
  // (logged) and the loss scale backs off. Returns false when skipped.
  virtual bool step();
  virtual void zero_grad(bool set_to_none = true);

  // overlap_step (step_overlap.h): step() plans the update and leaves it to run beside the next
  // forward, each layer's bucket waited for by its forward pre hook over `root` (the model).
  // Stream needs CUDA parameters; Deferred runs each bucket in its hook (the CPU's way, and a
  // test of the hooks' coverage on any device).
  void enable_step_overlap(torch::nn::Module& root, bool deferred);
  const std::shared_ptr<StepOverlap>& step_overlap() const { return overlap_; }
  // Every update step() left pending lands before anything the current stream runs next (the
  // state exports, loads, backward and in-place zero_grad below call it themselves).
  void finish_update();

  double loss_scale() const;
  double last_grad_norm() const { return last_norm_; }
  bool last_step_skipped() const { return last_skipped_; }
  Precision precision() const { return precision_; }
  amp::DynamicGradScaler* scaler() { return scaler_.get(); }

  // The optimizer state as full-shape tensors in optim::Optimizer::state_dict()'s format.
  // Collective for sharded strategies: every rank calls it (Booster::save_optimizer does).
  virtual optim::StateDict full_state_dict();
  virtual void load_full_state_dict(const optim::StateDict& state);
  // The same state streamed, which is what checkpoint IO uses (bounded memory: a save holds
  // one full tensor beyond training memory, a load one rank's slice of one tensor).
  // full_state_plan(): full_state_dict()'s scalars and the declaration (name, dtype, full shape)
  // of each of its tensors, in its order, without gathering anything. full_state_tensor(plan, i):
  // tensor i, full, on the writer (rank 0 of the sharding group: global rank 0 under the
  // data-parallel plugins; undefined on the others, except unsharded strategies, which return
  // it everywhere); collective for sharded strategies (every rank calls it with the same i, in
  // the same order). The tensor may view live state: write it before the next step.
  struct FullStatePlan {
    json::Value scalars;
    std::vector<checkpoint::TensorDecl> tensors;
    std::vector<at::Tensor> held;  // the unsharded default's tensors (views, no copies)
  };
  virtual FullStatePlan full_state_plan();
  virtual at::Tensor full_state_tensor(const FullStatePlan& plan, size_t i);
  // load_full_state_dict read tensor by tensor from `source` (a memory-mapped file): each rank
  // reads only the slices it keeps, into the state tensors it already has.
  virtual void load_full_state(const optim::StateSource& source);
  // fp32 masters re-taken from the working parameters (after a model checkpoint load).
  virtual void sync_masters_from_params();

  // The loss-scaler state (fp16), for training checkpoints.
  json::Value state() const;
  void load_state(const json::Value& state);

 protected:
  double compute_grad_norm();  // global, unscaled, fp64
  // The parts of clip_grad_by_norm/step that depend on where gradients and states live; the
  // skip-on-overflow, clipping-divisor and loss-scaler sequence around them is this class's.
  // Defaults: the wrapped optimizer over full gradients on .grad.
  virtual double grad_norm_now() { return compute_grad_norm(); }
  virtual void apply_update(double divisor);
  virtual void drop_grads();

  std::shared_ptr<optim::Optimizer> optimizer_;
  Precision precision_;
  std::unique_ptr<amp::DynamicGradScaler> scaler_;
  // Empty when every rank holds full, identical gradients (ddp after its all-reduce); sharded
  // strategies wire it to their group so norms and overflow are global.
  amp::GradReducer reducer_;
  double max_norm_ = 0.0;
  double default_max_norm_ = 0.0;  // clipping when the step was not preceded by clip_grad_by_norm
  bool norm_valid_ = false;
  double last_norm_ = 0.0;
  bool last_skipped_ = false;
  std::shared_ptr<StepOverlap> overlap_;
};

}  // namespace colossal::booster
