// Layers of other kinds for the seam tests: each counts its forwards and otherwise computes what
// the layer it replaces computes, so a model with them must give the same outputs, and a fused
// path that bypassed them would show as a zero count.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "colossal/models/llama/model.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/linear.h"

namespace colossal::testing {

// A Linear of another kind sharing the replaced layer's parameters (the same tensors, so the
// optimizer and checkpoints see no difference).
class RecordingLinear : public nn::Linear {
 public:
  explicit RecordingLinear(const nn::Linear& base) : nn::Linear(base.options()) {
    replace_parameter("weight", base.weight());
    if (base.has_bias()) replace_parameter("bias", base.param("bias"));
  }
  at::Tensor forward(const at::Tensor& x) override {
    ++calls;
    return nn::Linear::forward(x);
  }
  int calls = 0;
};

class RecordingAttention : public nn::SdpaAttention {
 public:
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const nn::AttentionMask& mask, const nn::SequenceInfo& seq) override {
    ++calls;
    return nn::SdpaAttention::forward(q, k, v, mask, seq);
  }
  int calls = 0;
};

// An FFN of another kind around the dense MLP it replaces.
class RecordingFFN : public nn::FeedForward {
 public:
  explicit RecordingFFN(std::shared_ptr<nn::FeedForward> inner)
      : inner_(register_module("inner", std::move(inner))) {}
  at::Tensor forward(const at::Tensor& x) override {
    ++calls;
    return inner_->forward(x);
  }
  int calls = 0;

 private:
  std::shared_ptr<nn::FeedForward> inner_;
};

// Replaces the Linear at `path` of `model` by a RecordingLinear over the same parameters.
inline std::shared_ptr<RecordingLinear> record_linear(torch::nn::Module& model,
                                                      const std::string& path) {
  auto base = std::dynamic_pointer_cast<nn::Linear>(nn::find_module(model, path));
  auto rec = std::make_shared<RecordingLinear>(*base);
  nn::replace_module(model, path, rec);
  return rec;
}

}  // namespace colossal::testing
