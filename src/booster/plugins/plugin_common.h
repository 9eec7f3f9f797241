// What the data-parallel plugins (none, ddp, low_level_zero, gemini) share: the cast of a model
// to the working dtype with its fp32 masters, the default data-parallel communicator, rank 0's
// weights broadcast at boost, the trainable-parameter list and the check that an optimizer
// holds the boosted model's own parameters. Private to the plugins (src/booster/plugins/).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "colossal/dist/communicator.h"

namespace torch::nn {
class Module;
}
namespace colossal::optim {
class Optimizer;
}

namespace colossal::booster::plugins {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Where the fp32 master values taken at the cast are kept.
enum class MasterCopies {
  // Every trainable floating parameter, copied on the device (ddp, none, low_level_zero).
  kOnDevice,
  // Only under bf16/fp16, on the host: the CPU fp32 tensor itself when the model was built there
  // (no copy), so a model that fits the device in its working dtype is boosted without a full
  // fp32 copy on the device (gemini: the chunk manager takes its master shards from them).
  kHostWhenHalf,
};

// Casts the floating parameters and buffers of `module` to `dtype` and moves everything to
// `device` ("cpu" | "cuda") in place: the Parameter objects stay the same, so an optimizer built
// before keeps working. Returns the fp32 values before the cast (the master weights) of the
// parameters that train: a frozen one (a LoRA run's base) is never stepped, so it gets none (a
// 7b base under bf16 would otherwise pass through 25 GiB of fp32 copies on the device).
NamedTensors cast_module_in_place(torch::nn::Module& module, at::ScalarType dtype,
                                  const std::string& device,
                                  MasterCopies masters = MasterCopies::kOnDevice);

// `comm` when valid, else the world communicator of dist::init(); an InputError naming `plugin`
// when the runtime is not initialised.
dist::Communicator default_dp_comm(dist::Communicator comm, const std::string& plugin);

// Every rank starts from rank 0's parameters, masters and (when `buffers`) buffers, as torch
// DDP does. Host tensors go through the device when the backend moves device memory only (NCCL).
void broadcast_from_rank0(dist::Communicator& comm, torch::nn::Module& module,
                          NamedTensors& masters, bool buffers);

// The parameters that take gradients, by name, in registration order.
NamedTensors trainable(torch::nn::Module& module);

// The optimizer must hold the boosted model's parameters (it is built on the module before
// boost); an InputError names the first one that is not.
void check_optimizer_params(const optim::Optimizer& optimizer, torch::nn::Module& module);

}  // namespace colossal::booster::plugins
