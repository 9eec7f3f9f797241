// Internal to src/nn/: what the two vocabulary-sharded heads (a Column lm_head and a tied Vocab
// embedding) share: entering the region, gathering the logits, and the vocab-parallel loss.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "colossal/core/error.h"
#include "colossal/nn/fused_ce.h"
#include "colossal/nn/module.h"
#include "colossal/nn/parallel_ops.h"
#include "nn/shard_util.h"

namespace colossal::nn {

// A column-style layer's input enters the region: identity forward with the gradient summed
// over the group, or under split_gather / ring the sequence (dim 1) gathered.
inline at::Tensor enter_column_region(const at::Tensor& x, const ShardSpec& s) {
  return sequence_sharded(s) ? gather_from_sequence(x, s.group, 1) : copy_to_region(x, s.group);
}

// Vocab-sharded logits [.., P/w] -> the whole vocabulary [.., vocab] (the padding cut).
inline at::Tensor gather_vocab(const at::Tensor& logits, const ShardSpec& s, int64_t vocab) {
  return gather_from_region(logits, s.group, -1).narrow(-1, 0, vocab);
}

// The loss of a head holding rows [vocab_begin, vocab_begin + weight.size(0)) of the padded
// vocabulary (the real vocabulary has `vocab` rows). Under split_gather / ring the hidden states
// are gathered along the sequence first and the loss is over the whole step: the targets are
// those of the whole step (like the ids the embedding took) or of this rank's part of it (then
// gathered too).
inline at::Tensor vocab_head_loss(const at::Tensor& hidden, const at::Tensor& weight,
                                  const at::Tensor& targets, const ShardSpec& s,
                                  int64_t vocab_begin, int64_t vocab, const FusedCEOptions& opts) {
  COLOSSAL_CHECK(s.communicates(), "vocab_parallel_loss: the head is not sharded over a group");
  COLOSSAL_CHECK(targets.dim() + 1 == hidden.dim(),
                 "vocab_parallel_loss: targets must have hidden's leading shape, got ",
                 targets.sizes(), " for hidden ", hidden.sizes());
  at::Tensor t = targets.to(hidden.device());
  if (sequence_sharded(s) && hidden.dim() >= 3) {
    COLOSSAL_CHECK(t.size(1) == hidden.size(1) || t.size(1) == hidden.size(1) * s.world,
                   "vocab_parallel_loss: targets of ", t.size(1),
                   " tokens for a sequence shard of ", hidden.size(1), " over ", s.world, " ranks");
    if (t.size(1) == hidden.size(1)) {
      at::NoGradGuard ng;
      t = gather_from_sequence(t, s.group, 1);
    }
  }
  VocabParallel vp;
  vp.group = s.group;
  vp.vocab_begin = vocab_begin;
  vp.vocab_size = vocab;
  return vocab_parallel_linear_cross_entropy(enter_column_region(hidden, s), weight, t, vp, opts);
}

}  // namespace colossal::nn
