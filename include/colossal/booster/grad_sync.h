// Bucketed gradient all-reduce overlapped with backward: the engine of the `ddp` plugin.
//
// Each trainable parameter gets a post-accumulate-grad hook. Parameters are packed, in reverse
// registration order (roughly the order backward produces their gradients), into buckets of at
// most `bucket_cap_mb`, one dtype and device per bucket. When every gradient of a bucket has been
// accumulated the bucket is flattened and all-reduced (average) asynchronously while backward
// goes on; finish() waits for all of them and writes the averaged values back into `.grad`.
// Buckets are launched strictly in index order on every rank, so ranks always issue the same
// collective sequence even when their gradients become ready in a different order. A parameter
// with no gradient on this rank contributes zeros; one with no gradient on any rank keeps no
// gradient (so the optimizer skips it, as it would in one process).
//
// In reduce-scatter mode (Options::on_shard, the engine of ZeRO-2) the same hooks and buckets
// reduce-scatter instead, and each rank keeps only its slice of every gradient.
//
// With Options::fp8 the buckets travel in FP8 with scales (dist/fp8_collectives.h).
//
// Why not c10d::Reducer: it needs a c10d::ProcessGroup (we hold Backends through our
// Communicator), its no_sync and unused-parameter handling are driven from Python, and ZeRO-2
// needs the same hook + bucket machinery with reduce-scatter instead of all-reduce.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "colossal/dist/communicator.h"

namespace colossal::booster {

class GradSync {
 public:
  struct Options {
    double bucket_cap_mb = 25.0;
    // Gradients are reduced in this dtype (undefined = their own dtype), e.g. fp32 for bf16 grads.
    c10::optional<at::ScalarType> communication_dtype;
    // FP8 communication (the plugins' fp8_communication): buckets are all-reduced /
    // reduce-scattered with dist::all_reduce_fp8 / reduce_scatter_fp8 in this format (each rank's
    // slices cast with their own scales, summed in fp32 in rank order), instead of in
    // communication_dtype. One rank: nothing is communicated and nothing is cast.
    c10::optional<at::ScalarType> fp8;
    // Launch each bucket from the hooks as soon as it is full (overlapping backward); false:
    // every bucket is launched by finish().
    bool overlap = true;
    // Reduce-scatter mode (ZeRO-2). Each parameter counts as padded to a multiple of the group
    // size and split into size() equal slices; a bucket is reduce-scattered (average) so this
    // rank receives only its slice of every parameter, and the parameters' .grad are dropped as
    // soon as they are packed. finish() calls on_shard(param index, averaged slice of
    // ceil(numel / size) elements) for every parameter that had a gradient on some rank (the
    // slice is only valid during the call). Empty: all-reduce mode (ddp, ZeRO-1).
    std::function<void(size_t, const at::Tensor&)> on_shard;
  };

  GradSync(std::vector<std::pair<std::string, at::Tensor>> params, dist::Communicator comm,
           Options options);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // While false (inside no_sync), hooks do nothing and gradients accumulate locally.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

  // Runs at the end of every backward that produced gradients (queued on the autograd engine by
  // the first hook): launches buckets not launched yet (in order), waits for every all-reduce
  // and writes averaged gradients back. A no-op when disabled or when nothing is pending.
  void finish();
  // Reduces every gradient accumulated so far in one go (all buckets, no overlap), as if the last
  // backward had just finished, whatever enabled() says: the pipeline schedule runs its backward
  // passes with sync off and reduces once afterwards.
  void reduce_now();

  size_t num_buckets() const { return buckets_.size(); }
  // Parameter names of bucket i, in packing order (for tests and logs).
  std::vector<std::string> bucket_names(size_t i) const;

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;
    at::ScalarType dtype;
    int pending = 0;
    bool launched = false;
    at::Tensor flat;
    at::Tensor out;  // reduce-scatter mode: this rank's slices
    dist::Work work;
  };
  void on_grad_ready(size_t param_index);
  void launch(size_t bucket_index);
  void launch_reduce_scatter(size_t bucket_index);
  int64_t shard_numel(const at::Tensor& p) const;
  void launch_ready_prefix();
  void reset_iteration();

  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<size_t> bucket_of_;  // param index -> bucket index
  std::vector<char> ready_;
  std::vector<char> had_grad_;  // this rank had a gradient when its bucket was packed
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;
  dist::Communicator comm_;
  Options options_;
  bool enabled_ = true;
  bool armed_ = false;  // a hook fired since the last finish()
  std::shared_ptr<bool> alive_;
};

}  // namespace colossal::booster
