// Checks and in-place slicing shared by the shardable layers (Linear, Embedding).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/nn/module.h"

namespace colossal::nn {

// `size` is cut into world / replicas equal slices (ShardSpec::replicas).
inline void check_shard(const ShardSpec& s, int64_t size, const std::string& what) {
  COLOSSAL_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "shard spec of ", what, ": rank ",
                 s.rank, " / world ", s.world, " is invalid");
  COLOSSAL_CHECK(!s.group.valid() || (s.group.rank() == s.rank && s.group.size() == s.world),
                 "shard spec of ", what, ": rank ", s.rank, " / world ", s.world,
                 " contradicts its group ", s.group.name(), " (rank ", s.group.rank(), " of ",
                 s.group.size(), ")");
  COLOSSAL_CHECK(s.replicas >= 1 && s.world % s.replicas == 0, "shard spec of ", what,
                 ": replicas ", s.replicas, " does not divide world ", s.world);
  const int64_t parts = s.world / s.replicas;
  COLOSSAL_CHECK_INPUT(size % parts == 0, "cannot shard ", what, ": size ", size,
                       " is not divisible by ", parts);
}

// The sequence-parallel modes a sharded layer implements itself: none, split_gather and ring
// (ring is split_gather with the linear layers' collectives chunked and overlapped; other
// layers treat it as split_gather). all_to_all and ring_attn change attention, not the linear
// layers, and come with their core attention.
inline void check_sequence_mode(const ShardSpec& s, const std::string& layer) {
  COLOSSAL_CHECK_INPUT(s.sequence_parallel == SequenceParallelMode::Off ||
                           s.sequence_parallel == SequenceParallelMode::SplitGather ||
                           s.sequence_parallel == SequenceParallelMode::Ring,
                       layer, " sharding: sequence parallelism mode '",
                       dist::to_string(s.sequence_parallel),
                       "' is not implemented by this layer (off, split_gather and ring are)");
}

// Whether activations between the sharded layers are split over the sequence.
inline bool sequence_sharded(const ShardSpec& s) {
  return s.sequence_parallel == SequenceParallelMode::SplitGather ||
         s.sequence_parallel == SequenceParallelMode::Ring;
}

// The size of a split dimension of `size` after the spec's padding: the next multiple of
// pad_multiple * world (size itself when pad_multiple is 1).
inline int64_t padded_size(const ShardSpec& s, int64_t size, const std::string& what) {
  COLOSSAL_CHECK_INPUT(s.pad_multiple >= 1, "shard spec of ", what,
                       ": pad_multiple must be >= 1, got ", s.pad_multiple);
  const int64_t m = s.pad_multiple * s.world;
  return s.pad_multiple == 1 ? size : (size + m - 1) / m * m;
}

// t with zero rows appended along dim 0 up to `rows` (t itself when it has them already).
inline at::Tensor pad_rows(const at::Tensor& t, int64_t rows) {
  if (t.size(0) == rows) return t;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = rows - t.size(0);
  return at::cat({t, at::zeros(shape, t.options())}, 0);
}

// narrow + clone + set_data: the parameter keeps its identity (optimizer/hooks stay valid).
// Slice rank / replicas of world / replicas. `padded` (dim 0 only): the rows the dimension is
// padded to with zeros before it is split.
inline void shard_in_place(const at::Tensor& p, int64_t dim, const ShardSpec& s,
                           int64_t padded = 0) {
  at::NoGradGuard ng;
  const at::Tensor whole = dim == 0 && padded > 0 ? pad_rows(p, padded) : p;
  int64_t chunk = whole.size(dim) / (s.world / s.replicas);
  const_cast<at::Tensor&>(p).set_data(
      whole.narrow(dim, s.rank / s.replicas * chunk, chunk).clone());
}

}  // namespace colossal::nn
