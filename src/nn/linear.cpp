// Linear: local GEMM, the region operations of a sharded linear, and the fusion of sibling
// projections into one GEMM when (and only when) they are plain.
#include "colossal/nn/linear.h"

#include <ATen/ATen.h>

#include <memory>
#include <typeinfo>

#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/parallel_ops.h"
#include "nn/shard_util.h"
#include "nn/vocab_head.h"

namespace colossal::nn {

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
  register_parameter("weight", at::empty({out_, in_}, o.tensor_options()));
  if (has_bias_) register_parameter("bias", at::empty({out_}, o.tensor_options()));
}

at::Tensor Linear::local_linear(const at::Tensor& x, bool with_bias) const {
  return with_bias && has_bias_ ? at::linear(x, weight(), param("bias")) : at::linear(x, weight());
}

at::Tensor Linear::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (!shard_spec_ || !shard_spec_->communicates()) return local_linear(x, true);
  const ShardSpec& s = *shard_spec_;
  const bool seq = s.sequence_parallel == SequenceParallelMode::SplitGather;
  if (s.kind == ShardSpec::Kind::Column) {
    at::Tensor y =
        local_linear(seq ? gather_from_sequence(x, s.group, 1) : copy_to_region(x, s.group), true);
    return s.gather_output ? gather_vocab(y, s, full_out_) : y;
  }
  at::Tensor y = local_linear(x, false);
  y = seq ? reduce_scatter_sequence(y, s.group, 1) : reduce_from_region(y, s.group);
  return has_bias_ ? y + param("bias") : y;
}

bool Linear::vocab_parallel_head() const {
  return typeid(*this) == typeid(Linear) && shard_spec_ &&
         shard_spec_->kind == ShardSpec::Kind::Column && shard_spec_->communicates();
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
  return typeid(*this) == typeid(Linear) && !(shard_spec_ && shard_spec_->communicates());
}

void Linear::shard(const ShardSpec& spec) {
  COLOSSAL_CHECK(!shard_spec_, "Linear ", name(), " is already sharded");
  check_sequence_mode(spec, "Linear");
  if (spec.kind == ShardSpec::Kind::Column) {
    COLOSSAL_CHECK_INPUT(!spec.gather_output || spec.communicates(), "Linear ", name(),
                         ": gather_output needs a group to gather over");
    const int64_t padded = padded_size(spec, full_out_, "Linear out_features");
    check_shard(spec, padded, "Linear out_features");
    shard_in_place(weight(), 0, spec, padded);
    if (has_bias_) shard_in_place(param("bias"), 0, spec, padded);
    padded_out_ = padded;
    out_ = padded / spec.world;
  } else if (spec.kind == ShardSpec::Kind::Row) {
    COLOSSAL_CHECK_INPUT(spec.pad_multiple == 1 && !spec.gather_output, "Linear ", name(),
                         ": row sharding takes no padding (pad_multiple ", spec.pad_multiple,
                         ") and no gather_output");
    check_shard(spec, in_, "Linear in_features");
    shard_in_place(weight(), 1, spec);
    in_ /= spec.world;
  } else {
    throw Error(str("Linear supports column and row sharding, not ", to_string(spec.kind)));
  }
  shard_spec_ = spec;
}

at::Tensor Linear::shard_slice(const std::string& name, const at::Tensor& full) const {
  if (!shard_spec_) return full;
  const ShardSpec& s = *shard_spec_;
  if (s.kind == ShardSpec::Kind::Column)
    return pad_rows(full, padded_out_).narrow(0, s.rank * out_, out_);
  if (name == "weight") return full.narrow(1, s.rank * in_, in_);
  return full;  // row-parallel bias stays whole
}

std::vector<int64_t> Linear::full_shape(const std::string& name) const {
  if (name == "weight") return {full_out_, full_in_};
  return {full_out_};
}

std::optional<at::Tensor> fused_projections(const at::Tensor& x,
                                            const std::vector<Linear*>& projections) {
  if (projections.empty() || !use_fused_kernels(x)) return std::nullopt;
  const Linear& first = *projections.front();
  for (const Linear* p : projections) {
    if (!p->fusable() || p->has_bias() != first.has_bias() ||
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
  at::Tensor y = kernels::linear_concat(x, w, bias);
  while (!scopes.empty()) scopes.pop_back();
  return y;
}

}  // namespace colossal::nn
