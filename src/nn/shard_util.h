// Checks and in-place slicing shared by the shardable layers (Linear, Embedding).
#pragma once

#include <ATen/ATen.h>

#include <string>

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

// narrow + clone + set_data: the parameter keeps its identity (optimizer/hooks stay valid).
// Slice rank / replicas of world / replicas.
inline void shard_in_place(const at::Tensor& p, int64_t dim, const ShardSpec& s) {
  at::NoGradGuard ng;
  int64_t chunk = p.size(dim) / (s.world / s.replicas);
  const_cast<at::Tensor&>(p).set_data(p.narrow(dim, s.rank / s.replicas * chunk, chunk).clone());
}

}  // namespace colossal::nn
