// Linear: local GEMM, the region operations of a sharded linear, and the fusion of sibling
// projections into one GEMM when (and only when) they are plain.
#include "colossal/nn/linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <map>
#include <memory>
#include <mutex>
#include <typeinfo>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/fp8_linear.h"
#include "colossal/nn/parallel_ops.h"
#include "colossal/nn/ring_ops.h"
#include "colossal/pipeline/weight_grad_store.h"
#include "nn/shard_util.h"
#include "nn/vocab_head.h"

namespace colossal::nn {

namespace {

// The ranks of `tp` that hold this rank's replicated head: its block of `replicas` consecutive
// group ranks (the whole group when replicas == its size). One communicator per (group, block)
// serves every layer with replicated heads (a group per layer would open an engine per k/v
// projection); the cache holds it weakly, so it lives as long as some layer uses it.
dist::Communicator replica_group(const dist::Communicator& tp, int64_t replicas) {
  if (replicas == tp.size()) return tp;
  const int64_t first = tp.rank() / replicas * replicas;
  std::vector<int> members;
  std::string key;
  for (int64_t i = 0; i < replicas; ++i) {
    members.push_back(tp.global_rank(static_cast<int>(first + i)));
    key += str(i ? "," : "", members.back());
  }
  const std::string name = str(tp.name(), ".replicas", first / replicas);
  key = name + "[" + key + "]";
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<dist::Communicator::Impl>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto impl = cache[key].lock()) return dist::Communicator(impl);
  dist::Communicator g = tp.new_group(members, name);
  cache[key] = g.impl();
  return g;
}

}  // namespace

bool use_fused_kernels(const at::Tensor& x) {
  return x.is_cuda() && kernels::enabled() && kernels::has_fused_kernels(x);
}

Linear::Linear(const LinearOptions& o)
    : options_(o),
      in_(o.in_features()),
      out_(o.out_features()),
      full_in_(o.in_features()),
      full_out_(o.out_features()),
      padded_out_(o.out_features()),
      has_bias_(o.bias()) {
  COLOSSAL_CHECK_INPUT(in_ > 0 && out_ > 0,
                       "Linear: in_features and out_features must be > 0, got ", in_, " and ",
                       out_);
  COLOSSAL_CHECK_INPUT(o.heads() >= 0 && (o.heads() == 0 || out_ % o.heads() == 0),
                       "Linear: heads = ", o.heads(), " does not divide out_features = ", out_);
  register_parameter("weight", at::empty({out_, in_}, o.tensor_options()));
  if (has_bias_) register_parameter("bias", at::empty({out_}, o.tensor_options()));
}

namespace {

// y = x W^T + b whose backward leaves dW to an open pipeline::WeightGradStore (see
// set_defer_weight_grad); without an open store it is at::linear's backward.
class DeferrableLinear : public torch::autograd::Function<DeferrableLinear> {
 public:
  // (The bias is added outside: a custom function takes no undefined tensor argument.)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor x = saved[0], w = saved[1];
    const at::Tensor dy = grad_out[0];
    const int64_t out = w.size(0), in = w.size(1);
    at::Tensor dx = at::matmul(dy, w);
    auto weight_grad = [dy, x, out, in] {
      return dy.reshape({-1, out}).t().mm(x.reshape({-1, in}));
    };
    at::Tensor dw;
    if (pipeline::WeightGradStore* store = pipeline::WeightGradStore::active()) {
      // Accumulated as autograd's AccumulateGrad would: the first gradient is stored, later ones
      // added. `w` is the leaf parameter itself (Linear defers only then).
      at::Tensor leaf = w;
      store->push([leaf, weight_grad]() mutable {
        at::NoGradGuard ng;
        at::Tensor g = weight_grad();
        if (leaf.grad().defined()) {
          leaf.mutable_grad().add_(g);
        } else {
          leaf.mutable_grad() = g;
        }
      });
    } else {
      dw = weight_grad();
    }
    return {dx, dw};
  }
};

}  // namespace

at::Tensor Linear::local_linear(const at::Tensor& x, bool with_bias) const {
  return with_bias && has_bias_ ? at::linear(x, weight(), param("bias")) : at::linear(x, weight());
}

at::Tensor Linear::matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const {
  if (defer_weight_grad_ && w.is_leaf() && w.requires_grad() && at::GradMode::is_enabled())
    return b.defined() ? DeferrableLinear::apply(x, w) + b : DeferrableLinear::apply(x, w);
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

at::Tensor Linear::local_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return matmul(x, w, b);
}

at::Tensor Linear::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (!shard_spec_ || !shard_spec_->communicates())
    return defer_weight_grad_ ? matmul(x, weight(), has_bias_ ? param("bias") : at::Tensor())
                              : local_linear(x, true);
  const ShardSpec& s = *shard_spec_;
  const auto mode = s.sequence_parallel;
  at::Tensor w = weight(), b = has_bias_ ? param("bias") : at::Tensor();
  if (s.kind == ShardSpec::Kind::Column) {
    w = region_param("weight");
    if (b.defined()) b = region_param("bias");
    at::Tensor y;
    if (mode == SequenceParallelMode::Ring) {
      y = ring_gather_linear(x, w, s.group, 1);
      if (b.defined()) y = y + b;
    } else {
      at::Tensor in = mode == SequenceParallelMode::SplitGather
                          ? gather_from_sequence(x, s.group, 1)
                          : copy_to_region(x, s.group);
      y = local_gemm(in, w, b);
    }
    // A vocabulary head with parallel_output=false: the whole output, padding cut.
    return s.gather_output ? gather_vocab(y, s, full_out_) : y;
  }
  at::Tensor y;
  if (mode == SequenceParallelMode::Ring) {
    y = ring_linear_reduce_scatter(x, w, s.group, 1);
  } else {
    y = local_gemm(x, w, at::Tensor());
    y = mode == SequenceParallelMode::SplitGather ? reduce_scatter_sequence(y, s.group, 1)
                                                  : reduce_from_region(y, s.group);
  }
  return b.defined() ? y + b : y;
}

void Linear::set_heads(int64_t heads) {
  COLOSSAL_CHECK_INPUT(!shard_spec_, "Linear ", name(), ": set_heads(", heads,
                       ") after the layer was sharded");
  COLOSSAL_CHECK_INPUT(heads >= 0 && (heads == 0 || out_ % heads == 0), "Linear: heads = ", heads,
                       " does not divide out_features = ", out_);
  options_.heads(heads);
}

at::Tensor Linear::region_param(const std::string& name) const {
  // A replicated head: the gradient summed over its sharers.
  return replica_group_.valid() ? copy_to_region(param(name), replica_group_) : param(name);
}

bool Linear::vocab_parallel_head() const {
  return typeid(*this) == typeid(Linear) && shard_spec_ &&
         shard_spec_->kind == ShardSpec::Kind::Column && shard_spec_->communicates() &&
         shard_spec_->replicas == 1;
}

at::Tensor Linear::vocab_parallel_loss(const at::Tensor& hidden, const at::Tensor& targets,
                                       const FusedCEOptions& opts) {
  ForwardScope scope(*this);
  COLOSSAL_CHECK(vocab_parallel_head(), "Linear::vocab_parallel_loss: ", name(),
                 " is not a plain linear column-sharded over a group");
  COLOSSAL_CHECK(!has_bias_, "Linear::vocab_parallel_loss: ", name(),
                 " has a bias; the vocab-parallel loss takes a head without one");
  const ShardSpec& s = *shard_spec_;
  return vocab_head_loss(hidden, weight(), targets, s, s.rank * out_, full_out_, opts);
}

bool Linear::fusable() const {
  return typeid(*this) == typeid(Linear) && plain_storage();
}

bool Linear::plain_storage() const {
  return !defer_weight_grad_ && !(shard_spec_ && shard_spec_->communicates());
}

void Linear::shard(const ShardSpec& spec) {
  COLOSSAL_CHECK(!shard_spec_, "Linear ", name(), " is already sharded");
  check_sequence_mode(spec, "Linear");
  ShardSpec s = spec;
  s.replicas = 1;
  if (s.kind == ShardSpec::Kind::Column) {
    const int64_t heads = options_.heads();
    if (heads > 0) {
      COLOSSAL_CHECK_INPUT(heads % s.world == 0 || s.world % heads == 0, "cannot shard Linear ",
                           name(), ": its ", heads, " heads over ", s.world,
                           " ranks (the heads must divide the ranks or the ranks the heads)");
      if (heads < s.world) s.replicas = s.world / heads;
    }
    COLOSSAL_CHECK_INPUT(!s.gather_output || s.communicates(), "Linear ", name(),
                         ": gather_output needs a group to gather over");
    COLOSSAL_CHECK_INPUT(s.pad_multiple == 1 || s.replicas == 1, "Linear ", name(),
                         ": padding (pad_multiple ", s.pad_multiple,
                         ") does not apply to replicated heads");
    const int64_t padded = padded_size(s, full_out_, "Linear out_features");
    check_shard(s, padded, "Linear out_features");
    shard_in_place(weight(), 0, s, padded);
    if (has_bias_) shard_in_place(param("bias"), 0, s, padded);
    padded_out_ = padded;
    out_ = padded / (s.world / s.replicas);
    if (s.replicas > 1 && s.communicates()) replica_group_ = replica_group(s.group, s.replicas);
  } else if (s.kind == ShardSpec::Kind::Row) {
    COLOSSAL_CHECK_INPUT(s.pad_multiple == 1 && !s.gather_output, "Linear ", name(),
                         ": row sharding takes no padding (pad_multiple ", s.pad_multiple,
                         ") and no gather_output");
    check_shard(s, in_, "Linear in_features");
    shard_in_place(weight(), 1, s);
    in_ /= s.world;
  } else {
    throw Error(str("Linear supports column and row sharding, not ", to_string(s.kind)));
  }
  shard_spec_ = s;
}

at::Tensor Linear::shard_slice(const std::string& name, const at::Tensor& full) const {
  if (!shard_spec_) return full;
  const ShardSpec& s = *shard_spec_;
  if (s.kind == ShardSpec::Kind::Column)
    return pad_rows(full, padded_out_).narrow(0, s.rank / s.replicas * out_, out_);
  if (name == "weight") return full.narrow(1, s.rank * in_, in_);
  return full;  // row-parallel bias stays whole
}

std::vector<int64_t> Linear::full_shape(const std::string& name) const {
  if (name == "weight") return {full_out_, full_in_};
  return {full_out_};
}

int64_t Linear::replication(const std::string& name) const {
  if (!shard_spec_) return 1;
  if (shard_spec_->kind == ShardSpec::Kind::Column) return shard_spec_->replicas;
  return name == "weight" ? 1 : shard_spec_->world;
}

bool Linear::fusable_column_shard() const {
  if (typeid(*this) != typeid(Linear) || defer_weight_grad_ || !shard_spec_ ||
      !shard_spec_->communicates())
    return false;
  const ShardSpec& s = *shard_spec_;
  return s.kind == ShardSpec::Kind::Column && !s.gather_output && s.pad_multiple == 1 &&
         s.replicas == 1 && !replica_group_.valid() &&
         (s.sequence_parallel == SequenceParallelMode::Off ||
          s.sequence_parallel == SequenceParallelMode::SplitGather);
}

std::optional<at::Tensor> fused_projections(const at::Tensor& x,
                                            const std::vector<Linear*>& projections,
                                            bool any_device) {
  if (projections.empty()) return std::nullopt;
  if (any_device ? !(kernels::enabled() && kernels::has_fused_kernels(x)) : !use_fused_kernels(x))
    return std::nullopt;
  // FP8 projections fuse among themselves, never with another kind (nn/fp8_linear.h).
  if (auto y = fp8_fused_projections(x, projections)) return y;
  const Linear& first = *projections.front();
  // Plain projections, or column shards of one group and mode (their region entered once).
  // Among plain projections, a layer offering a low-rank addition on a plain base (LoRA) joins
  // with its base, and its addition follows the GEMM.
  const bool column = first.fusable_column_shard();
  std::vector<std::optional<Linear::LowRankAddition>> adds(projections.size());
  bool any_add = false;
  for (size_t i = 0; i < projections.size(); ++i) {
    Linear* p = projections[i];
    if (!column && !p->fusable()) {
      adds[i] = p->low_rank_addition();
      if (!adds[i] || !p->plain_storage() || !adds[i]->a->fusable() || !adds[i]->b->fusable() ||
          adds[i]->a->weight().scalar_type() != p->weight().scalar_type() ||
          adds[i]->b->weight().scalar_type() != p->weight().scalar_type())
        return std::nullopt;
      any_add = true;
    }
  }
  for (size_t i = 0; i < projections.size(); ++i) {
    const Linear* p = projections[i];
    const bool kind_ok =
        column ? p->fusable_column_shard() &&
                     p->shard_spec()->group.impl() == first.shard_spec()->group.impl() &&
                     p->shard_spec()->sequence_parallel == first.shard_spec()->sequence_parallel
               : p->fusable() || adds[i].has_value();
    if (!kind_ok || p->has_bias() != first.has_bias() ||
        p->weight().scalar_type() != first.weight().scalar_type() ||
        p->weight().device() != first.weight().device())
      return std::nullopt;
  }
  // The projections' own hooks fire around the read of their weights (pre in order, post in
  // reverse), as if each forward had run.
  std::vector<std::unique_ptr<Module::ForwardScope>> scopes;
  scopes.reserve(projections.size());
  for (Linear* p : projections) scopes.push_back(std::make_unique<Module::ForwardScope>(*p));
  std::vector<at::Tensor> w, bias;
  for (Linear* p : projections) {
    w.push_back(p->weight());
    if (p->has_bias()) bias.push_back(p->param("bias"));
  }
  at::Tensor in = x;
  if (column) {
    const ShardSpec& s = *first.shard_spec();
    in = s.sequence_parallel == SequenceParallelMode::SplitGather
             ? gather_from_sequence(x, s.group, 1)
             : copy_to_region(x, s.group);
  }
  at::Tensor y = kernels::linear_concat(in, w, bias);
  if (any_add) {
    // The additions of every adapted projection at once: H = x [A_1; A_2; ..]^T (one GEMM,
    // [tokens, sum r]), then y += H D^T with D the block-diagonal [sum out, sum r] of the scaled
    // B_i (zero rows for plain projections), accumulated in place into the GEMM's output (which
    // its backward does not read). A's and B's hooks fire as if their forwards ran.
    std::vector<at::Tensor> as;
    std::vector<std::unique_ptr<Module::ForwardScope>> ab_scopes;
    int64_t rank_sum = 0;
    for (auto& a : adds) {
      if (!a) continue;
      ab_scopes.push_back(std::make_unique<Module::ForwardScope>(*a->a));
      ab_scopes.push_back(std::make_unique<Module::ForwardScope>(*a->b));
      as.push_back(a->a->weight());
      rank_sum += a->a->weight().size(0);
    }
    at::Tensor h = at::linear(x, at::cat(as, 0));  // [.., sum r]
    std::vector<at::Tensor> rows;
    int64_t r0 = 0;
    for (size_t i = 0; i < projections.size(); ++i) {
      const int64_t out = projections[i]->weight().size(0);
      if (!adds[i]) {
        rows.push_back(at::zeros({out, rank_sum}, h.options()));
        continue;
      }
      const at::Tensor& b = adds[i]->b->weight();  // [out, r]
      const int64_t r = b.size(1);
      rows.push_back(at::constant_pad_nd(b * adds[i]->scaling, {r0, rank_sum - r0 - r}, 0));
      r0 += r;
    }
    at::Tensor d = at::cat(rows, 0);  // [sum out, sum r]
    const int64_t n = y.size(-1);
    y = at::addmm(y.reshape({-1, n}), h.reshape({-1, rank_sum}), d.t()).view(y.sizes());
    while (!ab_scopes.empty()) ab_scopes.pop_back();
  }
  while (!scopes.empty()) scopes.pop_back();
  return y;
}

}  // namespace colossal::nn
