// SGD exactly as torch.optim.SGD (maximize=False):
//   d = g + wd*p;  if momentum: buf = d (first step) else buf = momentum*buf + (1-dampening)*d;
//   d = nesterov ? d + momentum*buf : buf;  p -= lr*d
#pragma once

#include <colossal/optim/optimizer.h>

#include <vector>

namespace colossal::optim {

struct SGDHyper {
  double lr = 1e-3, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
};

// In-place update over lists. `momentum_buffers` has one entry per param when momentum != 0:
// an undefined entry is created (the first step) and written back.
void sgd_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                std::vector<at::Tensor>& momentum_buffers, const SGDHyper& hyper);

class SGD : public Optimizer {
 public:
  explicit SGD(OptimizerOptions options = {}) : Optimizer(options) {}
  const char* type() const override { return "sgd"; }

 protected:
  void update(const GroupOptions& group, std::vector<at::Tensor>& params,
              std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) override;
  std::vector<std::string> state_keys(const GroupOptions& g) const override {
    return g.momentum != 0.0 ? std::vector<std::string>{"momentum_buffer"}
                             : std::vector<std::string>{};
  }
};

}  // namespace colossal::optim
