// Module base: forward hooks and the sharding contract.
#include "colossal/nn/module.h"

#include <exception>
#include <vector>

#include "colossal/core/error.h"

namespace colossal::nn {

void HookHandle::remove() {
  if (auto t = table_.lock()) t->erase(id_);
  table_.reset();
}

bool HookHandle::active() const {
  auto t = table_.lock();
  return t && t->count(id_) > 0;
}

const char* to_string(ShardSpec::Kind kind) {
  switch (kind) {
    case ShardSpec::Kind::Column:
      return "column";
    case ShardSpec::Kind::Row:
      return "row";
    case ShardSpec::Kind::Vocab:
      return "vocab";
  }
  return "?";
}

HookHandle Module::add_forward_pre_hook(ForwardHook fn) {
  COLOSSAL_CHECK(fn, "add_forward_pre_hook: empty hook on module ", name());
  uint64_t id = next_id_++;
  (*pre_)[id] = std::move(fn);
  return HookHandle(pre_, id);
}

HookHandle Module::add_forward_post_hook(ForwardHook fn) {
  COLOSSAL_CHECK(fn, "add_forward_post_hook: empty hook on module ", name());
  uint64_t id = next_id_++;
  (*post_)[id] = std::move(fn);
  return HookHandle(post_, id);
}

size_t Module::num_forward_hooks() const {
  return pre_->size() + post_->size();
}

void Module::shard(const ShardSpec& spec) {
  throw Error(str("module ", name(), " does not support ", to_string(spec.kind),
                  " sharding; shard its Linear/Embedding children instead"));
}

std::vector<int64_t> Module::full_shape(const std::string& name) const {
  return param(name).sizes().vec();
}

const at::Tensor& Module::param(const std::string& name) const {
  const at::Tensor* t = parameters_.find(name);
  COLOSSAL_CHECK(t, "module ", this->name(), " has no parameter '", name, "'");
  return *t;
}

bool Module::has_param(const std::string& name) const {
  return parameters_.contains(name);
}

void Module::replace_parameter(const std::string& name, const at::Tensor& tensor) {
  at::Tensor* t = parameters_.find(name);
  COLOSSAL_CHECK(t, "replace_parameter: module ", this->name(), " has no parameter '", name, "'");
  bool rg = t->requires_grad();
  *t = tensor.detach();
  t->set_requires_grad(rg);
}

void Module::run(const std::shared_ptr<HookHandle::Table>& t, Module& m) {
  if (t->empty()) return;
  // Copy first: a hook may remove itself (or add others) while running.
  std::vector<ForwardHook> fns;
  fns.reserve(t->size());
  for (auto& [id, fn] : *t) fns.push_back(fn);
  for (auto& fn : fns) fn(m);
}

Module::ForwardScope::ForwardScope(Module& m) : m_(m), uncaught_(std::uncaught_exceptions()) {
  run(m_.pre_, m_);
}

Module::ForwardScope::~ForwardScope() noexcept(false) {
  if (std::uncaught_exceptions() > uncaught_) return;  // the forward threw: no post hooks
  run(m_.post_, m_);
}

int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace colossal::nn
