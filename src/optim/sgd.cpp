// SGD with momentum, dampening, nesterov and weight decay, in torch.optim.SGD's order of ops.
#include "colossal/optim/sgd.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "colossal/core/error.h"

namespace colossal::optim {

void sgd_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                std::vector<at::Tensor>& bufs, const SGDHyper& h) {
  COLOSSAL_CHECK(grads.size() == params.size(), "sgd_update: ", params.size(), " params but ",
                 grads.size(), " grads");
  COLOSSAL_CHECK(h.momentum == 0.0 || bufs.size() == params.size(), "sgd_update: ", params.size(),
                 " params but ", bufs.size(), " momentum buffers");
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    at::Tensor d = grads[i];
    COLOSSAL_CHECK(d.sizes() == p.sizes(), "sgd_update: tensor ", i, " grad shape ", d.sizes(),
                   " != param ", p.sizes());
    if (h.weight_decay != 0.0) d = d.add(p, h.weight_decay);
    if (h.momentum != 0.0) {
      at::Tensor& buf = bufs[i];
      if (!buf.defined()) {
        buf = d.clone().detach();
      } else {
        buf.mul_(h.momentum).add_(d, 1.0 - h.dampening);
      }
      d = h.nesterov ? d.add(buf, h.momentum) : buf;
    }
    p.add_(d, -h.lr);
  }
}

void SGD::update(const GroupOptions& g, std::vector<at::Tensor>& params,
                 std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) {
  SGDHyper h{g.lr, g.momentum, g.dampening, g.weight_decay, g.nesterov};
  std::vector<at::Tensor> bufs(params.size());
  if (h.momentum != 0.0)
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = states[i]->tensors.find("momentum_buffer");
      if (it != states[i]->tensors.end()) bufs[i] = it->second;
    }
  if (grad_divisor() != 1.0) {
    // SGD has no fused divisor: divide copies (the caller's .grad stays untouched).
    std::vector<at::Tensor> scaled = at::_foreach_div(grads, at::Scalar(grad_divisor()));
    sgd_update(params, scaled, bufs, h);
  } else {
    sgd_update(params, grads, bufs, h);
  }
  if (h.momentum != 0.0)
    for (size_t i = 0; i < params.size(); ++i) states[i]->tensors["momentum_buffer"] = bufs[i];
}

}  // namespace colossal::optim
