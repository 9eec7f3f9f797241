// The sharded AdamW step and gradient norm that ZeRO-1/2 (LowLevelZeroOptimizer: one shard per
// parameter) and Gemini (ChunkManager: one shard per chunk) share; they differ in how shards are
// cut and where gradients come from, not in how a shard is updated or measured:
// - a gradient copied from the device to a host shard has its fp64 sum of squares taken on the
//   device first (copy_grad_to_host), so the norm never reads host memory (seconds at 13b);
// - the norm is the fp64 sum of squares of the shards (or those device sums), all-reduced by the
//   injected reducer (amp/grad_reducer.h: dp by default, composable over tp / pp), with shards
//   replicated over an axis counted on one of its ranks (ShardedNorm);
// - the update is grouped by (parameter group, step count) and dispatched by where the shard
//   lives (AdamWBatch::run): the fused multi-tensor AdamW writing the working-dtype shard in the
//   same pass on the device, the SIMD CPU Adam (also writing the cast) on the host, or
//   optim::adamw_update when no working copy is written.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "colossal/amp/grad_reducer.h"
#include "colossal/optim/adamw.h"

namespace colossal::zero {

// Copies `src` (a device gradient part) into the host shard `dst` (converting dtype in the
// copy) and returns its fp64 sum of squares taken on the device before the copy; undefined when
// `src` is not on a CUDA device (then the norm reads the shard itself). `copy` performs the
// transfer (default: a blocking dst.copy_(src)); Gemini passes its side-stream mover.
at::Tensor copy_grad_to_host(at::Tensor dst, const at::Tensor& src,
                             const std::function<void(at::Tensor&, const at::Tensor&)>& copy = {});

// The global gradient norm over shards: each shard adds either its device sum of squares or
// itself, then one fp64 all-reduce through the reducer. Not finite when some gradient on some
// rank is not: that is how overflow is agreed.
class ShardedNorm {
 public:
  explicit ShardedNorm(const amp::GradReducer& reducer) : reducer_(reducer) {}
  // `grad_sq` defined: it stands for `grad` (taken before a host copy). `replicated_over`: the
  // reducer axes over which this shard is the same on every rank (counted on rank 0 of each).
  void add(const at::Tensor& grad, const at::Tensor& grad_sq = {},
           const std::vector<std::string>& replicated_over = {});
  double global(double scale) const;  // sqrt(sum) / scale

 private:
  const amp::GradReducer& reducer_;
  std::vector<at::Tensor> grads_, sums_;
};

// Which AdamW runs a batch of shards.
enum class AdamWPath {
  Fused,  // device: kernels::fused_adamw, master update and working-dtype cast in one pass
  Host,   // host: optim::cpu_adam_update (SIMD, threaded), writing the cast in the same pass
  Plain   // optim::adamw_update (ATen fused / foreach), masters only, no working copy
};

// The shards of one (group, step count): one AdamW call.
struct AdamWKey {
  size_t group;
  int64_t step;
  bool operator<(const AdamWKey& o) const {
    return std::tie(group, step) < std::tie(o.group, o.step);
  }
};
struct AdamWBatch {
  std::vector<at::Tensor> P, G, M, V, W;  // masters, gradients, moments, working (cast) out
  void add(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const at::Tensor& working = {});
  bool empty() const { return P.empty(); }
  // One update of every shard with gradients divided by `divisor` (unscale and clip folded in).
  void run(AdamWPath path, const optim::AdamWHyper& hyper, int64_t step, double divisor) const;
};

optim::AdamWHyper hyper_of(const optim::GroupOptions& group);

}  // namespace colossal::zero
