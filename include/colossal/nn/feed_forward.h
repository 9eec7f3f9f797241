// The feed-forward slot of a decoder layer: dense today (the SwiGLU MLP of the Llama family),
// a mixture of experts later, behind one interface so a layer's FFN can be replaced by name.
#pragma once

#include <ATen/core/Tensor.h>

#include "colossal/nn/module.h"

namespace colossal::nn {

// [.., hidden] -> [.., hidden].
class FeedForward : public Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;
};

}  // namespace colossal::nn
