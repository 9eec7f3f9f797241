// Token embedding. Vocab-sharded with a group (ShardSpec::Kind::Vocab), each rank looks up its
// rows and the partial embeddings are all-reduced (reduce-scattered over the sequence under
// split_gather), so the sharded layer returns what the whole one does.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "colossal/nn/module.h"

namespace colossal::nn {

// EmbeddingOptions(num, dim).padding_idx(0).tensor_options(opts).
struct EmbeddingOptions {
  EmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  TORCH_ARG(std::optional<int64_t>, padding_idx) = std::nullopt;
  TORCH_ARG(at::TensorOptions, tensor_options) = {};
};

// weight [vocab, hidden]. Vocab sharding keeps rows [rank*V/w, (rank+1)*V/w); ids outside the
// local range look up zeros, so the ranks' lookups sum to the whole one.
class Embedding : public Module {
 public:
  explicit Embedding(const EmbeddingOptions& options);
  virtual at::Tensor forward(const at::Tensor& ids);
  const at::Tensor& weight() const { return param("weight"); }
  std::optional<int64_t> padding_idx() const { return padding_idx_; }
  void shard(const ShardSpec& spec) override;
  at::Tensor shard_slice(const std::string& name, const at::Tensor& full) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t num_embeddings() const { return num_; }  // local rows

 protected:
  // This rank's lookup (zeros for ids of other ranks), before any reduction.
  at::Tensor local_lookup(const at::Tensor& ids) const;

 private:
  int64_t num_, dim_, full_num_, vocab_begin_ = 0;
  std::optional<int64_t> padding_idx_;
};

}  // namespace colossal::nn
