// The linear layer family: nn::Linear with a virtual forward, so a parallel, LoRA or FP8 linear
// can take its place (Module::replace_child) and be called through the parent's typed member;
// and fused_projections(), which lets a parent compute several projections of one input as one
// concatenated GEMM only when every one of them is a plain Linear (or a plain base plus a
// low-rank addition the GEMM is followed by: LoRA), so a projection of another kind is never
// bypassed on any device.
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

// Whether the model runs the fused kernels (kernels/fused.h) for tensors like x: on CUDA, when
// the build has them and they are enabled. On the CPU the ATen composites are vectorised and
// multi-threaded while the fused CPU loops (kept for tests and devices without ATen kernels)
// are scalar, so the composites are faster there (docs/kernels.md).
bool use_fused_kernels(const at::Tensor& x);

// LibTorch-style options: LinearOptions(in, out).bias(false).tensor_options(opts).
struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // The output features are `heads` equal heads (0: not said). Column sharding then never
  // splits a head: over a world that heads divide, each rank holds heads / world of them; over
  // more ranks than heads (world % heads == 0: GQA key/value projections with fewer kv heads
  // than tp) rank r holds head r * heads / world, replicated on the world / heads consecutive
  // ranks whose query heads read it (ShardSpec::replicas). Anything else is an InputError.
  TORCH_ARG(int64_t, heads) = 0;
  TORCH_ARG(at::TensorOptions, tensor_options) = {};
};

// y = x W^T + b. weight [out, in], optional bias [out]. Sharded with a group (ShardSpec), the
// layer does its own region operations (module.h); under sequence parallelism `ring` the
// column's gather and the row's reduce-scatter run chunk by chunk, overlapped with the GEMM
// (ring_ops.h); column-sharded with gather_output it returns the whole [.., out] (padding cut).
//
// Replicated heads (LinearOptions::heads < world): each of the `replicas` ranks sharing a head
// back-propagates only its own query heads' share of the head's gradient, so the layer reads
// its weight and bias through copy_to_region over the sharing ranks (identity forward,
// all-reduce of the gradient): the parameter's gradient is the whole sum, the same on every
// sharing rank, and their optimizer steps keep the copies equal. The sharing ranks get a group
// of their own (one per tensor-parallel group and replica block, shared by all such layers):
// summing over the whole tp group with zeros from the other heads' ranks would move heads
// times more data for the same result. The input gradient needs nothing: each rank's dx =
// dk_r W_head holds its own query heads' share once, and the column region sums the shares.
class Linear : public Module {
 public:
  explicit Linear(const LinearOptions& options);
  virtual at::Tensor forward(const at::Tensor& x);

  // Whether forward(x) is exactly x W^T + b over this rank's storage, with nothing else to do
  // (no communication, no adapter, no cast), so that a parent may compute it inside one GEMM
  // with its siblings (fused_projections). True only for a plain nn::Linear whose spec needs no
  // communication; the check is on the dynamic type, so a derived layer is never fused unless
  // it overrides this to opt in.
  virtual bool fusable() const;
  // A layer whose forward is its plain base x W^T (+ b) over this rank's storage plus a scaled
  // low-rank product scaling * (x A^T) B^T with A and B plain Linears (a LoRA adapter without
  // dropout) says so here: fused_projections then computes the base inside its siblings'
  // concatenated GEMM and adds the product with two more small GEMMs, running A's and B's hooks.
  // None for every other layer (the default).
  struct LowRankAddition {
    Linear* a = nullptr;  // [r, in]
    Linear* b = nullptr;  // [out, r]
    double scaling = 1;
  };
  virtual std::optional<LowRankAddition> low_rank_addition() { return std::nullopt; }
  // Whether this is a plain nn::Linear column shard whose forward is exactly: the input enters
  // the tensor-parallel region (copy_to_region, or gather_from_sequence under split_gather),
  // then x W_local^T + b_local, with nothing after it (no gathered output, no padding, no
  // replicated head, not the ring mode). Sibling projections of this kind over one group may
  // share the region entry and one GEMM (fused_projections). Dynamic type checked as fusable().
  bool fusable_column_shard() const;
  // The conditions of fusable() on the storage and options alone (any dynamic type): no
  // communication, no deferred weight gradient. For derived layers that offer their base.
  bool plain_storage() const;

  const at::Tensor& weight() const { return param("weight"); }
  bool has_bias() const { return has_bias_; }
  // Says the output features are `heads` equal heads (LinearOptions::heads) for a later
  // shard(): a layer that takes its layout from another (a LoRA adapter's B follows its base's
  // heads; one head keeps a matrix whole on every rank, its gradient summed over them).
  // InputError when the layer is sharded already or `heads` does not divide out_features.
  void set_heads(int64_t heads);
  // Parameter `name` ("weight" or "bias") as this rank's sharded forward reads it: through
  // copy_to_region over the ranks sharing a replicated head (identity forward, the gradient
  // summed over them), else the parameter itself. For a layer that computes with this one's
  // storage outside its forward (a LoRA layer's adapter matrices).
  at::Tensor region_param(const std::string& name) const;
  // Column: weight/bias rows split; Row: weight columns split (bias stays whole: the row
  // forward adds it once after the reduction).
  void shard(const ShardSpec& spec) override;
  at::Tensor shard_slice(const std::string& name, const at::Tensor& full) const override;
  std::vector<int64_t> full_shape(const std::string& name) const override;
  // Row: the bias is whole on every rank (world); Column: ShardSpec::replicas; else 1.
  int64_t replication(const std::string& name) const override;
  int64_t in_features() const { return in_; }  // current (local) sizes (padding included)
  int64_t out_features() const { return out_; }
  // Column sharding with padding (ShardSpec::pad_multiple): the output features padded to
  // padded_out_features() before the split; the real ones are full_shape("weight")[0].
  int64_t padded_out_features() const { return padded_out_; }

  // A vocabulary head: whether this is a plain Linear column-sharded over a group, whose
  // output features (this rank's rows of the padded vocabulary) are the classes of
  // vocab_parallel_loss.
  bool vocab_parallel_head() const;
  // The mean cross-entropy of targets (hidden's leading shape; ignore_index as in opts) over
  // the whole vocabulary from this rank's rows, by vocab_parallel_linear_cross_entropy
  // (fused_ce.h): the logits are never gathered, whatever gather_output says. The input enters the
  // region as in forward (under split_gather / ring the hidden states and targets are gathered
  // along dim 1 first). Fires this layer's hooks. Needs vocab_parallel_head() and no bias.
  at::Tensor vocab_parallel_loss(const at::Tensor& hidden, const at::Tensor& targets,
                                 const FusedCEOptions& opts);
  const LinearOptions& options() const { return options_; }

  // Zero-bubble pipelines: while a pipeline::WeightGradStore is open during backward, this
  // layer's dW = dy^T x GEMM is pushed there (run later by the schedule's W) instead of being
  // computed in place; the input and bias gradients are computed at once. Off by default; set by
  // the hybrid plugin on a stage whose schedule splits the backward. Not for a replicated head
  // (its weight's gradient is summed over the sharing ranks inside autograd) or the ring mode
  // (chunked GEMMs): those compute dW at once. A deferring layer is never fused with siblings.
  void set_defer_weight_grad(bool defer) { defer_weight_grad_ = defer; }
  bool defer_weight_grad() const { return defer_weight_grad_; }

 protected:
  // x W^T (+ b) over this rank's storage, no communication: what a derived layer wraps.
  at::Tensor local_linear(const at::Tensor& x, bool with_bias) const;
  // x w^T + b (b may be undefined), with dW deferred to an open weight-gradient store when this
  // layer defers and `w` is its own leaf parameter (not a region copy of a replicated head).
  at::Tensor matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const;
  // The local GEMM of a sharded forward (column: after the input entered the region; row: before
  // the reduction), over this rank's storage `w` (a region copy for a replicated head) and `b`:
  // matmul here; a derived layer that computes the GEMM another way (FP8) overrides it and keeps
  // the region operations. Not used by the ring mode, whose GEMMs run chunk by chunk inside
  // ring_ops (a derived layer that overrides this must refuse that mode at shard()).
  virtual at::Tensor local_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

 private:
  LinearOptions options_;
  int64_t in_, out_, full_in_, full_out_, padded_out_;
  bool has_bias_;
  bool defer_weight_grad_ = false;
  dist::Communicator replica_group_;  // replicated heads: the ranks sharing this rank's head
};

// The projections of one input x, concatenated along the last dim ([.., sum of out_features]),
// as one GEMM (kernels::linear_concat: one dx GEMM in backward instead of one per projection
// plus their adds), with each projection's forward hooks fired around it. Returns nullopt —
// and the caller must call each projection's forward — unless the fused kernels run for x and
// the projections are alike (weights of one dtype and device, all with a bias or none) and
// either every one is fusable() or offers a low_rank_addition() on plain storage (LoRA: its base
// joins the GEMM, and every adapter's scaled (x A^T) B^T is added after it with one GEMM pair
// for the whole group, A's and B's hooks firing), or every one is a fusable_column_shard() over
// the same group and sequence mode: then x enters the region once (one gather under
// split_gather instead of one per projection) and the GEMM runs over this rank's column shards.
// `any_device`: also where the fused kernels are not what the model runs (the CPU), so tests reach
// this path there.
std::optional<at::Tensor> fused_projections(const at::Tensor& x,
                                            const std::vector<Linear*>& projections,
                                            bool any_device = false);

}  // namespace colossal::nn
