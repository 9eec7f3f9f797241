// Token embedding. Vocab-sharded with a group (ShardSpec::Kind::Vocab), each rank looks up its
// rows and the partial embeddings are all-reduced (reduce-scattered over the sequence under
// split_gather and ring), so the sharded layer returns what the whole one does. The vocabulary
// may be padded (ShardSpec::pad_multiple) so that it splits evenly; a tied output head reads
// the same shard through project() / vocab_parallel_loss().
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "colossal/nn/fused_ce.h"
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

// weight [vocab, hidden]. Vocab sharding keeps rows [rank*P/w, (rank+1)*P/w) of the vocabulary
// padded to P rows (P = V unless the spec pads; the rows past V are zeros, never looked up);
// ids outside the local range look up zeros, so the ranks' lookups sum to the whole one.
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
  int64_t num_embeddings() const { return num_; }   // local rows (padding included)
  int64_t vocab_size() const { return full_num_; }  // the whole, unpadded vocabulary
  int64_t padded_vocab_size() const { return padded_num_; }
  // Local rows that are real vocabulary (the others are padding): the first valid_rows().
  int64_t valid_rows() const;

  // The tied output head over this layer's weight: logits = hidden · Wᵀ. Unsharded: [.., V].
  // Vocab-sharded with a group: the hidden state enters the region (copy_to_region; under
  // split_gather / ring the sequence is gathered) and the logits are this rank's columns of the
  // padded vocabulary [.., num_embeddings()], or the whole [.., V] when the spec gathers output.
  at::Tensor project(const at::Tensor& hidden);
  // Whether project() returns vocab-sharded logits (a sharded head whose loss must be
  // vocab_parallel_loss).
  bool vocab_parallel_head() const;
  // The tied head's mean cross-entropy of targets (hidden's leading shape; ignore_index as in
  // opts) over the whole vocabulary, computed from this rank's rows by the vocab-parallel fused
  // cross-entropy (fused_ce.h) without gathering any logits; under split_gather / ring the
  // hidden states and targets are gathered along dim 1 first. Needs a vocab-sharded layer.
  at::Tensor vocab_parallel_loss(const at::Tensor& hidden, const at::Tensor& targets,
                                 const FusedCEOptions& opts);

 protected:
  // This rank's lookup (zeros for ids of other ranks), before any reduction.
  at::Tensor local_lookup(const at::Tensor& ids) const;

 private:
  int64_t num_, dim_, full_num_, padded_num_, vocab_begin_ = 0;
  std::optional<int64_t> padding_idx_;
};

}  // namespace colossal::nn
