// overlap_step: the optimizer update of one step hidden under the next step's forward.
//
// A step's update (AdamW over every parameter: memory-bound, 50 ms of a 7b step on an H200)
// normally runs between the backward and the next forward, with the GPU's matrix units idle.
// With overlap_step the update is cut into buckets, one per colossal::nn::Module (the nearest
// at or above the module registering the parameter), in the order the model registers them,
// which is the order its forward reads them. step() plans the whole update on the host (step
// counts, states, the clipping divisor and the group's hyper-parameters of this step) and then:
//   Stream (CUDA): launches every bucket's update on a side stream, an event after each, and
//     returns; each layer's forward pre hook makes the current stream wait for its bucket's
//     event, so the update of later layers runs beside the forward of earlier ones.
//   Deferred (any device; the default on the CPU, which has one stream): runs a bucket's update
//     in its layer's forward pre hook, just before the layer reads the weights.
// Either way a parameter's update reads only its own tensors, so the result equals step()'s
// bit for bit; only the time it runs moves. Parameters with no colossal::nn::Module above them
// are updated before step() returns. Everything still pending is finished (finish()) before the
// next step, backward, in-place zero_grad, optimizer state export or load, master re-sync, and
// Booster's model saves and loads (ModelWrapper::wait_weights). Reading a parameter's tensor
// directly between step() and the next forward needs ModelWrapper::wait_weights() first.
// A CUDA graph's replay runs no hooks: call finish() before capturing or replaying one.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "colossal/nn/module.h"
#include "colossal/optim/optimizer.h"

namespace torch::nn {
class Module;
}

namespace colossal {
class Event;
}

namespace colossal::booster {

class StepOverlap : public std::enable_shared_from_this<StepOverlap> {
 public:
  enum class Mode { Stream, Deferred };
  // Buckets and hooks over `root`'s parameters held by `optimizer` (which must outlive this).
  // Stream needs CUDA parameters (InputError naming the first other one).
  static std::shared_ptr<StepOverlap> create(torch::nn::Module& root, optim::Optimizer& optimizer,
                                             Mode mode);
  ~StepOverlap();
  StepOverlap(const StepOverlap&) = delete;
  StepOverlap& operator=(const StepOverlap&) = delete;

  Mode mode() const { return mode_; }
  // One update with every gradient divided by `grad_divisor` (optim::Optimizer::step's meaning).
  void step(double grad_divisor);
  // Bucket `b`'s update lands before anything the current stream runs next.
  void wait_bucket(size_t b);
  // Every pending update lands before anything the current stream runs next.
  void finish();
  bool pending() const;
  // Buckets a forward waits for (layers with parameters), and the parameters updated at step()
  // because no layer's hook covers them.
  size_t num_buckets() const { return buckets_ - 1; }
  size_t num_unhooked() const { return unhooked_; }

 private:
  StepOverlap(optim::Optimizer& optimizer, Mode mode);
  void hook(torch::nn::Module& root);

  optim::Optimizer& opt_;
  Mode mode_;
  size_t buckets_ = 1;  // bucket 0: parameters no hook covers (updated at step())
  size_t unhooked_ = 0;
  std::unordered_map<const void*, size_t> bucket_of_;  // TensorImpl* -> bucket
  std::vector<nn::HookHandle> hooks_;
  // Per bucket: the plan of its pending update (empty once waited for; Deferred runs it then,
  // Stream keeps its gradients alive until then), and, Stream, the event after its launch.
  std::vector<optim::Optimizer::UpdatePlan> plans_;
  std::vector<std::unique_ptr<Event>> events_;
  std::unique_ptr<Event> ready_;
  std::optional<c10::Stream> side_;
};

}  // namespace colossal::booster
