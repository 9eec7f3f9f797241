// A process-wide counter of weight updates: every optimizer step (optim::Optimizer::step, the
// Booster's OptimizerWrapper::step) and every model load through the Booster bumps it. Caches
// derived from weights (FP8 casts of a weight, nn/fp8_linear.h) key on it besides the tensor's
// version counter, because updates may write weights without ATen ops (fused optimizer kernels,
// collectives into parameter storage), which the version counter does not see.
#pragma once

#include <cstdint>

namespace colossal {

uint64_t weights_epoch();
void bump_weights_epoch();

}  // namespace colossal
