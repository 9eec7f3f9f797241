// The switch between the fused kernels and their ATen composites, and which devices have the
// kernels (kernels/ layer; every op header includes it).
#pragma once

#include <ATen/core/Tensor.h>

namespace colossal::kernels {

// Process-wide switch (default on) read by the model layers and the optimizers: off, they run
// the ATen composites instead (A/B measurements: `colossal bench --fused_kernels false`).
void set_enabled(bool on);
bool enabled();

// Whether `t`'s device has our fused kernel for the ops of kernels/fused.h (CPU always; CUDA
// when this build compiled the .cu files).
bool has_fused_kernels(const at::Tensor& t);

}  // namespace colossal::kernels
