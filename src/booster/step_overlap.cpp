#include "colossal/booster/step_overlap.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"

namespace colossal::booster {

std::shared_ptr<StepOverlap> StepOverlap::create(torch::nn::Module& root,
                                                 optim::Optimizer& optimizer, Mode mode) {
  if (mode == Mode::Stream)
    for (const auto& g : optimizer.param_groups())
      for (size_t i = 0; i < g.params.size(); ++i)
        COLOSSAL_CHECK_INPUT(g.params[i].is_cuda(), "overlap_step: parameter '", g.names[i],
                             "' is on ", g.params[i].device(),
                             "; the side-stream update needs CUDA parameters");
  std::shared_ptr<StepOverlap> s(new StepOverlap(optimizer, mode));
  s->hook(root);
  return s;
}

StepOverlap::StepOverlap(optim::Optimizer& optimizer, Mode mode) : opt_(optimizer), mode_(mode) {}

StepOverlap::~StepOverlap() {
  for (auto& h : hooks_) h.remove();
  // Nothing may be left writing weights the caller is about to free or read.
  try {
    finish();
  } catch (...) {  // a destructor does not throw; the error was reported where it happened
  }
}

// Buckets: one per colossal::nn::Module that is the nearest such module at or above a module
// registering an optimizer parameter, numbered in the order of the model's parameters (its
// registration order, which is the forward's order). A parameter registered by several modules
// (tied weights) is in the bucket of its first, and every such module's hook waits for it.
void StepOverlap::hook(torch::nn::Module& root) {
  std::set<const void*> held;
  for (const auto& g : opt_.param_groups())
    for (const auto& p : g.params) held.insert(p.unsafeGetTensorImpl());
  std::map<const void*, nn::Module*> owner;              // param -> its first hooked module
  std::map<nn::Module*, std::set<const void*>> readers;  // module -> params it registers
  std::function<void(torch::nn::Module&, nn::Module*)> walk = [&](torch::nn::Module& m,
                                                                  nn::Module* nearest) {
    if (auto* cm = dynamic_cast<nn::Module*>(&m)) nearest = cm;
    for (auto& item : m.named_parameters(false)) {
      const void* key = item.value().unsafeGetTensorImpl();
      if (!held.count(key) || !nearest) continue;
      owner.emplace(key, nearest);
      readers[nearest].insert(key);
    }
    for (auto& child : m.children()) walk(*child, nearest);
  };
  walk(root, nullptr);
  std::map<nn::Module*, size_t> bucket;
  for (auto& item : root.named_parameters(true)) {
    const void* key = item.value().unsafeGetTensorImpl();
    auto o = owner.find(key);
    if (o == owner.end()) continue;
    auto [it, added] = bucket.emplace(o->second, buckets_);
    if (added) ++buckets_;
    bucket_of_[key] = it->second;
  }
  for (const void* key : held)
    if (!bucket_of_.count(key)) ++unhooked_;
  plans_.resize(buckets_);
  std::weak_ptr<StepOverlap> weak = shared_from_this();
  for (auto& [module, params] : readers) {
    std::vector<size_t> waits;
    for (const void* key : params) waits.push_back(bucket_of_.at(key));
    std::sort(waits.begin(), waits.end());
    waits.erase(std::unique(waits.begin(), waits.end()), waits.end());
    hooks_.push_back(module->add_forward_pre_hook([weak, waits](nn::Module&) {
      if (auto s = weak.lock())
        for (size_t b : waits) s->wait_bucket(b);
    }));
  }
}

bool StepOverlap::pending() const {
  for (const auto& plan : plans_)
    if (!plan.empty()) return true;
  return false;
}

void StepOverlap::step(double grad_divisor) {
  finish();  // the previous step's updates come first (they own these states)
  auto plans = opt_.plan_step(
      grad_divisor,
      [this](const at::Tensor& p) {
        auto it = bucket_of_.find(p.unsafeGetTensorImpl());
        return it == bucket_of_.end() ? size_t{0} : it->second;
      },
      buckets_);
  opt_.run_update(plans[0]);
  plans[0] = {};
  if (mode_ == Mode::Deferred) {
    plans_ = std::move(plans);
    return;
  }
  Accelerator& acc = Accelerator::cuda();
  const c10::Stream compute = acc.current_stream();
  if (!side_) side_ = acc.new_stream(compute.device_index());
  if (!ready_) ready_ = acc.new_event();
  if (events_.empty())
    for (size_t b = 0; b < buckets_; ++b) events_.push_back(acc.new_event());
  ready_->record(compute);
  ready_->block(*side_);  // the gradients, norm and states the plans read are written
  acc.set_stream(*side_);
  try {
    for (size_t b = 1; b < buckets_; ++b) {
      if (plans[b].empty()) continue;
      opt_.run_update(plans[b]);
      events_[b]->record(*side_);
    }
  } catch (...) {
    acc.set_stream(compute);
    plans_ = std::move(plans);
    finish();
    throw;
  }
  acc.set_stream(compute);
  // The plans keep the gradients they read (allocated on the compute stream) alive until the
  // compute stream has waited for their bucket (wait_bucket): only then may zero_grad's drop
  // let the compute stream reuse that memory. So the gradients of later layers are freed as the
  // forward reaches them, and the step's peak memory does not grow.
  plans_ = std::move(plans);
}

void StepOverlap::wait_bucket(size_t b) {
  COLOSSAL_CHECK(b < buckets_, "overlap_step: bucket ", b, " of ", buckets_);
  if (plans_[b].empty()) return;  // nothing pending
  optim::Optimizer::UpdatePlan plan = std::move(plans_[b]);
  plans_[b] = {};
  if (mode_ == Mode::Deferred)
    opt_.run_update(plan);
  else
    events_[b]->block(Accelerator::cuda().current_stream());
  // `plan` (and the gradients it holds) is released here, after the compute stream's wait.
}

void StepOverlap::finish() {
  for (size_t b = 1; b < plans_.size(); ++b) wait_bucket(b);
}

}  // namespace colossal::booster
