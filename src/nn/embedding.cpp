// Embedding: plain and vocab-sharded lookups; a sharded embedding with a group reduces its
// partial sums itself.
#include "colossal/nn/embedding.h"

#include <ATen/ATen.h>

#include "colossal/core/error.h"
#include "colossal/nn/parallel_ops.h"
#include "nn/shard_util.h"

namespace colossal::nn {

Embedding::Embedding(const EmbeddingOptions& o)
    : num_(o.num_embeddings()),
      dim_(o.embedding_dim()),
      full_num_(o.num_embeddings()),
      padding_idx_(o.padding_idx()) {
  COLOSSAL_CHECK_INPUT(num_ > 0 && dim_ > 0,
                       "Embedding: num_embeddings and embedding_dim must be "
                       "> 0, got ",
                       num_, " and ", dim_);
  COLOSSAL_CHECK_INPUT(!padding_idx_ || (*padding_idx_ >= 0 && *padding_idx_ < num_),
                       "pad_token_id ", padding_idx_.value_or(0), " is outside the vocabulary of ",
                       num_);
  register_parameter("weight", at::empty({num_, dim_}, o.tensor_options()));
}

at::Tensor Embedding::local_lookup(const at::Tensor& ids) const {
  if (!shard_spec_) return at::embedding(weight(), ids, padding_idx_.value_or(-1));
  at::Tensor in_range = (ids >= vocab_begin_) & (ids < vocab_begin_ + num_);
  at::Tensor local = at::where(in_range, ids - vocab_begin_, at::zeros_like(ids));
  int64_t pad = -1;
  if (padding_idx_ && *padding_idx_ >= vocab_begin_ && *padding_idx_ < vocab_begin_ + num_) {
    pad = *padding_idx_ - vocab_begin_;
  }
  return at::embedding(weight(), local, pad) * in_range.unsqueeze(-1).to(weight().scalar_type());
}

at::Tensor Embedding::forward(const at::Tensor& ids) {
  ForwardScope scope(*this);
  at::Tensor y = local_lookup(ids);
  if (!shard_spec_ || !shard_spec_->communicates()) return y;
  const ShardSpec& s = *shard_spec_;
  // Under ring as under split_gather: a lookup has no GEMM to overlap with.
  return sequence_sharded(s) ? reduce_scatter_sequence(y, s.group, 1)
                             : reduce_from_region(y, s.group);
}

void Embedding::shard(const ShardSpec& spec) {
  COLOSSAL_CHECK(!shard_spec_, "Embedding ", name(), " is already sharded");
  COLOSSAL_CHECK(spec.kind == ShardSpec::Kind::Vocab, "Embedding supports vocab sharding, not ",
                 to_string(spec.kind));
  check_sequence_mode(spec, "Embedding");
  check_shard(spec, num_, "Embedding vocabulary");
  shard_in_place(weight(), 0, spec);
  num_ /= spec.world;
  vocab_begin_ = spec.rank * num_;
  shard_spec_ = spec;
}

at::Tensor Embedding::shard_slice(const std::string&, const at::Tensor& full) const {
  return shard_spec_ ? full.narrow(0, vocab_begin_, num_) : full;
}

std::vector<int64_t> Embedding::full_shape(const std::string&) const {
  return {full_num_, dim_};
}

}  // namespace colossal::nn
