// The project's module base: a torch::nn::Module with what the parallel plugins need and LibTorch
// lacks — forward pre/post hooks on every module, in-place sharding specs, and the rule that
// layers read their parameters at every call (so param.set_data(view) re-points storage safely).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace colossal::nn {

class Module;

// A hook sees the module it is attached to (Gemini fetches its chunks, ZeRO-3 prefetches the
// next block, a profiler times it). Hooks never see the forward's arguments, so one hook type
// serves every forward signature.
using ForwardHook = std::function<void(Module&)>;

// Removes its hook when remove() is called (or never, if dropped: handles do not own hooks).
// Safe to call after the module is gone.
class HookHandle {
 public:
  HookHandle() = default;
  void remove();
  bool active() const;

 private:
  friend class Module;
  using Table = std::map<uint64_t, ForwardHook>;
  HookHandle(std::weak_ptr<Table> table, uint64_t id) : table_(std::move(table)), id_(id) {}
  std::weak_ptr<Table> table_;
  uint64_t id_ = 0;
};

// How a layer's storage is split over a tensor-parallel group. The communication belongs to a
// later layer (shardformer); here a spec only re-shapes storage in place.
struct ShardSpec {
  enum class Kind {
    Column,  // Linear: output features split (weight dim 0, bias dim 0)
    Row,     // Linear: input features split (weight dim 1; bias kept whole)
    Vocab,   // Embedding: rows of the vocabulary split (weight dim 0)
  };
  Kind kind = Kind::Column;
  int64_t rank = 0;
  int64_t world = 1;
};
const char* to_string(ShardSpec::Kind kind);

class Module : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;

  // Hooks run in the order they were added; pre hooks before the module's forward body, post
  // hooks after it returns (not when it throws).
  HookHandle add_forward_pre_hook(ForwardHook fn);
  HookHandle add_forward_post_hook(ForwardHook fn);
  size_t num_forward_hooks() const;

  // Splits this layer's parameters in place (narrow + clone + set_data) and records the spec.
  // The default throws: a layer must say how it shards.
  virtual void shard(const ShardSpec& spec);
  const std::optional<ShardSpec>& shard_spec() const { return shard_spec_; }
  // For a sharded layer: this rank's part of a full-shape tensor of parameter `name` (used by
  // name-keyed initialization so a shard gets the same values as the unsharded model).
  virtual at::Tensor shard_slice(const std::string& name, const at::Tensor& full) const {
    return full;
  }
  // The unsharded shape of parameter `name`.
  virtual std::vector<int64_t> full_shape(const std::string& name) const;

  // The parameter registered under `name` (this module's own, not a child's). Layers read their
  // parameters through this at every forward and never keep a copy of the handle, so both
  // param.set_data(view) and replace_parameter() take effect at the next call.
  const at::Tensor& param(const std::string& name) const;
  bool has_param(const std::string& name) const;
  // Swaps the registered tensor (keeps requires_grad), e.g. a meta placeholder for real storage,
  // where set_data cannot change the device type. Throws if `name` is not registered.
  void replace_parameter(const std::string& name, const at::Tensor& tensor);

 protected:
  // Every layer's forward starts with `ForwardScope scope(*this);` so the hooks fire whatever
  // the forward's signature.
  class ForwardScope {
   public:
    explicit ForwardScope(Module& m);
    ~ForwardScope() noexcept(false);
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;

   private:
    Module& m_;
    int uncaught_;
  };
  std::optional<ShardSpec> shard_spec_;

 private:
  static void run(const std::shared_ptr<HookHandle::Table>& t, Module& m);
  std::shared_ptr<HookHandle::Table> pre_ = std::make_shared<HookHandle::Table>();
  std::shared_ptr<HookHandle::Table> post_ = std::make_shared<HookHandle::Table>();
  uint64_t next_id_ = 1;
};

// Every parameter, including those of modules that are not colossal::nn::Module.
int64_t count_parameters(const torch::nn::Module& m);

}  // namespace colossal::nn
