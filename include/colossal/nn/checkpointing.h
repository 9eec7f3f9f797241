// Activation checkpointing (recompute): a block's forward runs without keeping its intermediate
// activations; backward re-runs it (same RNG state) and differentiates the recomputed graph.
// LibTorch has no torch.utils.checkpoint, so this is a custom autograd function.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace colossal::nn {

enum class CheckpointMode {
  None,       // keep every activation
  Full,       // recompute each whole decoder layer (keeps only its input)
  Attention,  // recompute input_layernorm + self-attention only (selective); the MLP keeps its own
};
const char* to_string(CheckpointMode mode);
CheckpointMode checkpoint_mode_from_string(const std::string& name);  // none|full|attention

// y = fn(x), with only `x` (and the block's parameters) kept for backward. `params` must be every
// tensor requiring grad that fn reads besides x (the block's parameters): they are inputs of the
// autograd node, so their gradients reach the normal accumulation (and any gradient hooks).
// fn must be deterministic given its inputs and the RNG state; the CPU generator and that of
// x's device are saved before forward and restored around the recompute (then put back).
// fn runs twice, so forward hooks of the modules inside it fire twice.
// Without grad mode, or when nothing requires grad, this is just fn(x).
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x,
                      const std::vector<at::Tensor>& params);

// How many times checkpoint() recomputed a block in backward since the process started (tests).
int64_t checkpoint_recompute_count();

}  // namespace colossal::nn
