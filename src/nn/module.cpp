// Module base: forward hooks, the sharding contract and replaceable children.
#include "colossal/nn/module.h"

#include <c10/util/Type.h>

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

ShardSpec ShardSpec::over(Kind kind, const dist::Communicator& group, SequenceParallelMode sp) {
  COLOSSAL_CHECK(group.valid(), "ShardSpec::over: the ", to_string(kind),
                 " group is not valid on this rank");
  ShardSpec s;
  s.kind = kind;
  s.rank = group.rank();
  s.world = group.size();
  s.group = group;
  s.sequence_parallel = sp;
  return s;
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

void Module::register_setter(const std::string& name, const char* type, SlotSetter set) {
  slots_[name] = Slot{type, std::move(set)};
}

void Module::replace_child(const std::string& name, std::shared_ptr<torch::nn::Module> module) {
  COLOSSAL_CHECK_INPUT(module != nullptr, "replace_child: null module for '", name, "' of ",
                       this->name());
  auto it = slots_.find(name);
  COLOSSAL_CHECK_INPUT(it != slots_.end() && named_children().contains(name), "module ",
                       this->name(), " has no replaceable child '", name, "'");
  COLOSSAL_CHECK_INPUT(it->second.set(module), "cannot replace ", this->name(), ".", name, ": a ",
                       module->name(), " is not a ", c10::demangle(it->second.type));
  replace_module(name, std::move(module));
}

void Module::drop_child(const std::string& name) {
  auto it = slots_.find(name);
  COLOSSAL_CHECK(it != slots_.end(), "module ", this->name(), " has no child '", name, "'");
  unregister_module(name);
  it->second.set(nullptr);  // a null pointer casts to any type: the member becomes null
  slots_.erase(it);
}

namespace {

// The module at `path` under root (root itself for ""), without needing root to be owned by a
// shared_ptr.
torch::nn::Module* resolve(torch::nn::Module& root, const std::string& path,
                           std::shared_ptr<torch::nn::Module>* holder) {
  if (path.empty()) return &root;
  torch::nn::Module* at = &root;
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('.', begin);
    if (end == std::string::npos) end = path.size();
    const std::string part = path.substr(begin, end - begin);
    auto children = at->named_children();
    const auto* child = children.find(part);
    COLOSSAL_CHECK_INPUT(child != nullptr, "no module '", path, "': '", part,
                         "' is not a child of '", begin == 0 ? "" : path.substr(0, begin - 1), "'");
    *holder = *child;
    at = holder->get();
    begin = end + 1;
  }
  return at;
}

}  // namespace

std::shared_ptr<torch::nn::Module> find_module(torch::nn::Module& root, const std::string& path) {
  if (path.empty()) return root.shared_from_this();
  std::shared_ptr<torch::nn::Module> holder;
  resolve(root, path, &holder);
  return holder;
}

void replace_module(torch::nn::Module& root, const std::string& path,
                    std::shared_ptr<torch::nn::Module> module) {
  COLOSSAL_CHECK_INPUT(!path.empty(), "replace_module: empty path");
  const size_t dot = path.rfind('.');
  std::shared_ptr<torch::nn::Module> holder;
  auto* parent = dynamic_cast<Module*>(
      resolve(root, dot == std::string::npos ? "" : path.substr(0, dot), &holder));
  COLOSSAL_CHECK_INPUT(parent != nullptr, "replace_module: the parent of '", path,
                       "' is not a colossal::nn::Module (its children cannot be re-pointed)");
  parent->replace_child(dot == std::string::npos ? path : path.substr(dot + 1), std::move(module));
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
