// The project's module base: a torch::nn::Module with what the parallel plugins need and LibTorch
// lacks — forward pre/post hooks on every module, in-place sharding specs that carry the group a
// sharded layer communicates over, children that can be replaced by name (the parent's typed
// member follows), and the rule that layers read their parameters at every call (so
// param.set_data(view) re-points storage safely).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "colossal/dist/communicator.h"
#include "colossal/dist/parallel_dims.h"

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

// How activations are laid out along the sequence between the tensor-parallel layers
// (ColossalAI's sequence_parallelism_mode): dist::SequenceParallel, shared with ParallelDims.
using SequenceParallelMode = dist::SequenceParallel;

// How a layer's storage is split over a tensor-parallel group, and the group its forward talks
// to. The communication belongs to the sharded layer itself (Megatron's rule), so the model's
// code stays free of collectives:
//   Column  y_local = x W_local^T + b_local: the input enters the region (identity forward,
//           all-reduce of its gradient in backward; under split_gather an all-gather of the
//           sequence instead), the output stays split over features.
//   Row     y = sum_r x_r W_r^T, then + b: the partial products are all-reduced (reduce-scattered
//           over the sequence under split_gather), the bias is added once after the reduction.
//   Vocab   each rank looks up its rows of the vocabulary (zeros elsewhere); the partial
//           embeddings are all-reduced (reduce-scattered over the sequence under split_gather).
// Without a group (group.valid() == false) a spec only cuts storage: rank and world say which
// slice, and the caller owns any communication (name-keyed init tests, checkpoint reshaping).
//
// Replicated slices: a Column linear made of `heads` heads (LinearOptions::heads) sharded over
// more ranks than it has heads (world % heads == 0, e.g. GQA key/value projections with fewer
// kv heads than tp) never splits a head: rank r holds head r / replicas, replicated on the
// `replicas` = world / heads consecutive ranks that read it; the layer sets `replicas` in the
// spec it records and sums the weight's gradient over those ranks itself (linear.h). Module::
// replication(name) tells the grad-norm and checkpoint code how many ranks hold the same values.
struct ShardSpec {
  enum class Kind {
    Column,  // Linear: output features split (weight dim 0, bias dim 0)
    Row,     // Linear: input features split (weight dim 1; bias kept whole)
    Vocab,   // Embedding: rows of the vocabulary split (weight dim 0)
  };
  ShardSpec() = default;
  // Storage only: this rank's slice of `world`.
  ShardSpec(Kind kind, int64_t rank, int64_t world) : kind(kind), rank(rank), world(world) {}

  Kind kind = Kind::Column;
  int64_t rank = 0;
  int64_t world = 1;
  dist::Communicator group;  // the tensor-parallel group; invalid: storage only
  SequenceParallelMode sequence_parallel = SequenceParallelMode::Off;
  // Ranks holding the same slice (set by the layer at shard(), 1 unless heads are replicated):
  // rank r holds slice r / replicas of world / replicas.
  int64_t replicas = 1;

  // A spec over `group` (rank and world taken from it).
  static ShardSpec over(Kind kind, const dist::Communicator& group,
                        SequenceParallelMode sp = SequenceParallelMode::Off);
  bool communicates() const { return group.valid() && world > 1; }
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
  // How many ranks of shard_spec()->group hold the same values of parameter `name` (their
  // consecutive block of the group, each with the same gradient): 1 for a proper slice,
  // ShardSpec::replicas for replicated heads, world for what a sharded layer keeps whole (a
  // row-parallel bias); 1 for a module that is not sharded. A gradient norm over the group
  // counts such a parameter once: sum over ranks of |g|^2 / replication(name). (Parameters of
  // modules without a spec are whole on every tensor-parallel rank; under split_gather / ring
  // those that read sequence-sharded activations, i.e. norms, a replicated head and a row
  // bias, get per-shard partial gradients that the plugin sums over the group.)
  virtual int64_t replication(const std::string& name) const {
    (void)name;
    return 1;
  }

  // The parameter registered under `name` (this module's own, not a child's). Layers read their
  // parameters through this at every forward and never keep a copy of the handle, so both
  // param.set_data(view) and replace_parameter() take effect at the next call.
  const at::Tensor& param(const std::string& name) const;
  bool has_param(const std::string& name) const;
  // Swaps the registered tensor (keeps requires_grad), e.g. a meta placeholder for real storage,
  // where set_data cannot change the device type. Throws if `name` is not registered.
  void replace_parameter(const std::string& name, const at::Tensor& tensor);

  // Swaps child `name` for `module` (the same role computed another way: a LoRA, FP8 or
  // parallel linear, another core attention, an expert FFN) and re-points the typed member the
  // parent's forward calls, so the next forward runs the new module. The module must be of the
  // member's declared type (or derive from it): InputError naming both types otherwise, and
  // for a name that is not a replaceable child. Hooks of the old module stay with it.
  void replace_child(const std::string& name, std::shared_ptr<torch::nn::Module> module);
  // Unregisters child `name` and sets its typed member to null (a pipeline stage dropping the
  // blocks it does not own).
  void drop_child(const std::string& name);
  // Whether child `name` can be replaced (it was registered through register_slot).
  bool has_slot(const std::string& name) const { return slots_.count(name) > 0; }

 protected:
  // Registers `module` as child `name` held by the typed member `member` (which must live as
  // long as this module, i.e. be a field of it), so replace_child can re-point the member.
  template <class T>
  std::shared_ptr<T> register_slot(const std::string& name, std::shared_ptr<T>& member,
                                   std::shared_ptr<T> module) {
    member = register_module(name, std::move(module));
    register_setter(name, typeid(T).name(), [&member](const std::shared_ptr<torch::nn::Module>& m) {
      auto typed = std::dynamic_pointer_cast<T>(m);
      if (!typed && m) return false;
      member = std::move(typed);
      return true;
    });
    return member;
  }
  // The same for children held elsewhere (an element of a vector): `set` re-points the holder
  // (null: clears it) and returns false when the module is not of its type; `type` is
  // typeid(T).name().
  using SlotSetter = std::function<bool(const std::shared_ptr<torch::nn::Module>&)>;
  void register_setter(const std::string& name, const char* type, SlotSetter set);

  std::optional<ShardSpec> shard_spec_;

 public:
  // Every layer's forward starts with `ForwardScope scope(*this);` so the hooks fire whatever
  // the forward's signature. (Public so that a parent computing several children in one kernel
  // can fire their hooks around it: fused_projections.)
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

 private:
  static void run(const std::shared_ptr<HookHandle::Table>& t, Module& m);
  std::shared_ptr<HookHandle::Table> pre_ = std::make_shared<HookHandle::Table>();
  std::shared_ptr<HookHandle::Table> post_ = std::make_shared<HookHandle::Table>();
  uint64_t next_id_ = 1;
  struct Slot {
    const char* type;
    SlotSetter set;
  };
  std::map<std::string, Slot> slots_;
};

// replace_child at a dotted path under `root` ("model.layers.3.self_attn.q_proj"): the parent of
// the last component must be a colossal::nn::Module. InputError naming the path when it does
// not resolve.
void replace_module(torch::nn::Module& root, const std::string& path,
                    std::shared_ptr<torch::nn::Module> module);
// The module at a dotted path under root (root itself for ""); InputError when it does not exist.
std::shared_ptr<torch::nn::Module> find_module(torch::nn::Module& root, const std::string& path);

// Every parameter, including those of modules that are not colossal::nn::Module.
int64_t count_parameters(const torch::nn::Module& m);

}  // namespace colossal::nn
