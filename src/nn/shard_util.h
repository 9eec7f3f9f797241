// Checks and in-place slicing shared by the shardable layers (Linear, Embedding).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "colossal/core/error.h"
#include "colossal/nn/module.h"

namespace colossal::nn {

inline void check_shard(const ShardSpec& s, int64_t size, const std::string& what) {
  COLOSSAL_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "shard spec of ", what, ": rank ",
                 s.rank, " / world ", s.world, " is invalid");
  COLOSSAL_CHECK(!s.group.valid() || (s.group.rank() == s.rank && s.group.size() == s.world),
                 "shard spec of ", what, ": rank ", s.rank, " / world ", s.world,
                 " contradicts its group ", s.group.name(), " (rank ", s.group.rank(), " of ",
                 s.group.size(), ")");
  COLOSSAL_CHECK_INPUT(size % s.world == 0, "cannot shard ", what, ": size ", size,
                       " is not divisible by ", s.world);
}

// The sequence-parallel modes a sharded layer implements itself: none and split_gather (the
// others change attention, not the linear layers, and come with their core attention).
inline void check_sequence_mode(const ShardSpec& s, const std::string& layer) {
  COLOSSAL_CHECK_INPUT(s.sequence_parallel == SequenceParallelMode::Off ||
                           s.sequence_parallel == SequenceParallelMode::SplitGather,
                       layer, " sharding: sequence parallelism mode '",
                       dist::to_string(s.sequence_parallel),
                       "' is not implemented by this layer (off and split_gather are)");
}

// narrow + clone + set_data: the parameter keeps its identity (optimizer/hooks stay valid).
inline void shard_in_place(const at::Tensor& p, int64_t dim, const ShardSpec& s) {
  at::NoGradGuard ng;
  int64_t chunk = p.size(dim) / s.world;
  const_cast<at::Tensor&>(p).set_data(p.narrow(dim, s.rank * chunk, chunk).clone());
}

}  // namespace colossal::nn
