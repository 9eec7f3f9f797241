// AdamW over a module's parameters in the trainer's two groups: matrices (dim >= 2) with
// `weight_decay`, vectors (norms, biases) without; both at `lr`. Shared by the plugin tests
// (tests/zero, tests/booster) that train a model through the Booster.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <vector>

#include "colossal/optim/adamw.h"

namespace colossal::tests {

inline std::shared_ptr<optim::AdamW> adamw_decay_groups(torch::nn::Module& m, double lr,
                                                        double weight_decay) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> decay, other;
  for (auto& item : m.named_parameters(true))
    (item.value().dim() >= 2 ? decay : other).push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = lr;
  g.weight_decay = weight_decay;
  opt->add_param_group(decay, g);
  g.weight_decay = 0.0;
  opt->add_param_group(other, g);
  return opt;
}

}  // namespace colossal::tests
