// The plugins' shared pieces (see plugin_common.h).
#include "booster/plugins/plugin_common.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <set>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/optim/optimizer.h"

namespace colossal::booster::plugins {

NamedTensors cast_module_in_place(torch::nn::Module& module, at::ScalarType dtype,
                                  const std::string& device, MasterCopies where) {
  at::Device dev = device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);
  NamedTensors masters;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor& p = item.value();
    at::Tensor data = p.detach();
    const bool floating = at::isFloatingType(p.scalar_type());
    const bool trains = floating && p.requires_grad();  // a frozen parameter gets no master
    if (trains && where == MasterCopies::kOnDevice) {
      masters.emplace_back(item.key(),
                           data.to(dev, at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    } else if (trains && dtype != at::kFloat) {
      const bool reuse = data.is_cpu() && data.scalar_type() == at::kFloat;
      masters.emplace_back(item.key(),
                           reuse ? data : data.to(at::kCPU, at::kFloat, false, /*copy=*/true));
    }
    at::Tensor converted = floating ? data.to(dev, dtype) : data.to(dev);
    if (!converted.is_same(data)) p.set_data(converted);
  }
  for (auto& item : module.named_buffers(/*recurse=*/true)) {
    at::Tensor& b = item.value();
    at::Tensor converted = at::isFloatingType(b.scalar_type()) ? b.to(dev, dtype) : b.to(dev);
    if (!converted.is_same(b)) b.set_data(converted);
  }
  return masters;
}

dist::Communicator default_dp_comm(dist::Communicator comm, const std::string& plugin) {
  if (comm.valid()) return comm;
  COLOSSAL_CHECK_INPUT(dist::is_initialized(), "the ", plugin,
                       " plugin needs the distributed runtime: call colossal::dist::init() first "
                       "(or start the program with `colossal run`)");
  return dist::world();
}

void broadcast_from_rank0(dist::Communicator& comm, torch::nn::Module& module,
                          NamedTensors& masters, bool buffers) {
  if (comm.size() <= 1) return;
  const bool host_ok = comm.backend() == dist::Backend::Gloo;
  auto bcast = [&](const at::Tensor& t) {
    at::Tensor d = t.detach();
    if (!host_ok && d.is_cpu()) {  // NCCL moves device memory: one tensor at a time
      at::Tensor dev = d.to(Accelerator::cuda().device());
      comm.broadcast(dev, 0);
      d.copy_(dev);
    } else {
      comm.broadcast(d, 0);
    }
  };
  for (auto& item : module.named_parameters(true)) bcast(item.value());
  for (auto& [name, m] : masters) bcast(m);
  if (buffers)
    for (auto& item : module.named_buffers(true)) bcast(item.value());
}

NamedTensors trainable(torch::nn::Module& module) {
  NamedTensors out;
  for (auto& item : module.named_parameters(true))
    if (item.value().requires_grad()) out.emplace_back(item.key(), item.value());
  return out;
}

void check_optimizer_params(const optim::Optimizer& optimizer, torch::nn::Module& module) {
  std::set<const void*> model_params;
  for (auto& item : module.named_parameters(true))
    model_params.insert(item.value().unsafeGetTensorImpl());
  for (const auto& g : optimizer.param_groups())
    for (size_t i = 0; i < g.params.size(); ++i)
      COLOSSAL_CHECK_INPUT(model_params.count(g.params[i].unsafeGetTensorImpl()),
                           "optimizer parameter '", g.names[i],
                           "' is not a parameter of the boosted model");
}

}  // namespace colossal::booster::plugins
