// FP8 training's linear layer kind (ColossalAI's use_fp8): Fp8Linear takes a projection's place
// (replace_module; convert_to_fp8) and runs its three GEMMs in FP8 with fp32 accumulation, the
// weight and bias staying the ordinary (bf16 working / fp32 master) parameters the plugins and
// optimizers see, so checkpoints never hold FP8. Recipes (current scaling, kernels/fp8.h):
//   tensorwise  one scale per tensor: x and W in e4m3, the output gradient in e5m2; all three
//               GEMMs (y, dx, dW) in FP8; x is kept for backward as its fp8 transpose (half the
//               memory of bf16).
//   rowwise     one scale per row: x, W and dy in e4m3 for y and dx (W cast again along its other
//               dimension for dx); dW in the input's precision (the per-row scales of x and dy run
//               along the wrong dimension for it), x kept as is.
// The weight's casts are cached per weight version (bumped by every optimizer step), so a step
// of several micro-batches casts each weight once, not once per micro-batch
// (Fp8Config::keep_weight_casts; off, they live only as long as the step's graph). On CUDA the
// GEMMs are at::_scaled_mm (compute capability 8.9+), the casts our kernels; elsewhere (the CPU:
// make test) an emulation runs the same casts, then dequantizes and multiplies in fp32, so the
// scaling logic is the one the GPU runs. Being a derived Linear it is never fused with plain
// siblings: FP8 projections of one input fuse among themselves (fp8_fused_projections).
//
// Tensor parallel (the hybrid plugin, tensorwise recipe): the layer shards like a Linear and
// keeps Linear's region operations (the input's entry into the region, the row output's
// reduction, split_gather's gather / reduce-scatter), running only the local GEMM in FP8. The
// operands split over the group (column: the weight's rows and the output gradient's columns;
// row: the input's and the weight's columns) are cast with their amax all-reduced over the
// group: one fp32 max per cast, and every element quantizes as in the unsplit tensor, so a tp
// run follows the one-process FP8 curve up to the GEMMs' fp32 rounding. Not with the ring
// sequence mode (its GEMMs run inside the ring) or the rowwise recipe (per-row scales along the
// split dimension): InputError at shard(). A replicated key/value head (tp beyond the kv heads)
// back-propagates each rank's share of the head's output gradient, so that cast's scale is the
// largest share's, not the sum's: still FP8 training, not the one-process scale.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "colossal/kernels/fp8.h"
#include "colossal/nn/linear.h"

namespace colossal::nn {

struct Fp8Config {
  std::string recipe = "tensorwise";  // tensorwise | rowwise
  // Linear layers left in the working precision: those whose module path contains one of these
  // (default: the LM head, whose logits feed the loss).
  std::vector<std::string> exclude{"lm_head"};
  // Keep each weight's casts (1 byte per weight, 2 with tensorwise's transpose) between forwards
  // so that the micro-batches of one optimizer step cast it once. Without gradient accumulation
  // every step casts each weight once anyway: false then frees them with the step's graph.
  bool keep_weight_casts = true;
  // InputError naming the recipe when it is not one of the above.
  void validate() const;
};

struct Fp8TpScales;  // fp8_linear.cpp: which operands of a sharded GEMM are split

class Fp8Linear : public Linear {
 public:
  // Wraps a plain, unsharded Linear: shares its weight and bias (re-pointed, not copied).
  // InputError for in/out features that are not multiples of 16 (the FP8 GEMMs' rule).
  Fp8Linear(const Linear& base, const Fp8Config& cfg);
  at::Tensor forward(const at::Tensor& x) override;
  // Linear::shard, after refusing (InputError) what tensor-parallel FP8 does not cover: the
  // rowwise recipe, the ring sequence mode, and local sizes not divisible by 16.
  void shard(const ShardSpec& spec) override;
  const std::string& recipe() const { return cfg_.recipe; }
  // How many times the weight has been cast to FP8 (tests: once per optimizer step).
  int64_t weight_casts() const { return weight_casts_; }
  // How many activation casts this thread has made (tests: layers reading one input, q/k/v or
  // gate/up, share one cast while its saved tensors live).
  static int64_t activation_casts();

  // The sharded forward's local GEMM, in FP8 with the group's scales for the split operands.
  at::Tensor local_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) override;

  // The weight's casts for this forward: from the cache while the weight is unchanged.
  struct WeightCasts {
    kernels::Fp8Tensor w;    // [out, in] (tensorwise: with its transpose)
    kernels::Fp8Tensor w_t;  // rowwise: [in, out] cast along the other dimension
  };
  // The tensorwise cast of the weights of `group` (this layer first) concatenated along the
  // output dimension, [sum out, in] with its transpose and one scale (fp8_fused_projections),
  // cached in this layer as weight_casts_for caches one weight (only with keep_weight_casts:
  // otherwise nothing of it stays in the layer); counts a cast in each member.
  kernels::Fp8Tensor group_weight_cast(const std::vector<Fp8Linear*>& group);

 private:
  // x w^T + b in FP8 (tp: null, or the split operands of a sharded GEMM).
  at::Tensor fp8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                      const c10::intrusive_ptr<Fp8TpScales>& tp);
  // The cache's casts, made again when the weight changed (keep_weight_casts).
  const WeightCasts& weight_casts_for(const at::Tensor& w);
  WeightCasts cast_weight(const at::Tensor& w);  // counts in weight_casts_
  Fp8Config cfg_;
  WeightCasts cache_;
  const void* cache_impl_ = nullptr;
  const void* cache_data_ = nullptr;
  int64_t cache_version_ = -1;
  int64_t cache_epoch_ = -1;
  at::ScalarType cache_dtype_ = at::kFloat;
  int64_t weight_casts_ = 0;
  // group_weight_cast's cache: each member weight's identity, data pointer and version, the epoch.
  std::vector<std::tuple<const void*, const void*, int64_t>> group_key_;
  int64_t group_epoch_ = -1;
  kernels::Fp8Tensor group_cache_;
};

// FP8 projections that read one input (q/k/v, gate/up), fused among themselves and never with
// another kind: one cast of their concatenated weights (one scale for the group, as a fused qkv
// weight has), one FP8 GEMM into the packed [.., sum out] output that fused_projections returns,
// and in backward one cast of the packed output gradient, one GEMM for dx (no sum of the
// projections' input gradients) and one for the concatenated dW. The projections' hooks fire as
// if each forward had run. nullopt (they run one by one) unless there are two or more, all
// Fp8Linear with the tensorwise recipe, the same bias presence, input size, dtype and device.
std::optional<at::Tensor> fp8_fused_projections(const at::Tensor& x,
                                                const std::vector<Linear*>& projections);

// Replaces every plain nn::Linear under `root` whose path contains none of cfg.exclude with an
// Fp8Linear; returns the paths. InputError for an invalid config, a sharded layer (convert
// before the plugin shards: the FP8 layers shard themselves), a layer whose sizes are not
// multiples of 16, and on a CUDA device below compute capability 8.9 (named).
std::vector<std::string> convert_to_fp8(torch::nn::Module& root, const Fp8Config& cfg,
                                        const at::Device& device);

}  // namespace colossal::nn
