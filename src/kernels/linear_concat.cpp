// Concatenated linear (kernels/linear_concat.h): argument checks, the reference and the
// autograd function; ATen GEMMs only (cuBLAS / CPU BLAS), so one file serves every device.
#include "colossal/kernels/linear_concat.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/op_common.h"

namespace colossal::kernels {

namespace {

using namespace detail;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- Concatenated linear ----
void check_linear_concat(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& biases) {
  COLOSSAL_CHECK_INPUT(x.defined() && x.dim() >= 1, "linear_concat: x must be [..., in]");
  COLOSSAL_CHECK_INPUT(!weights.empty(), "linear_concat: no weights");
  COLOSSAL_CHECK_INPUT(biases.empty() || biases.size() == weights.size(),
                       "linear_concat: ", biases.size(), " biases for ", weights.size(),
                       " weights (give all or none)");
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string name = "weights[" + std::to_string(i) + "]";
    check_same("linear_concat", name.c_str(), weights[i], "x", x);
    COLOSSAL_CHECK_INPUT(weights[i].dim() == 2 && weights[i].size(1) == x.size(-1),
                         "linear_concat: ", name, " has shape ", weights[i].sizes(),
                         "; expected [out, ", x.size(-1), "] for x of shape ", x.sizes());
    if (!biases.empty()) {
      const std::string bname = "biases[" + std::to_string(i) + "]";
      check_same("linear_concat", bname.c_str(), biases[i], "x", x);
      COLOSSAL_CHECK_INPUT(biases[i].dim() == 1 && biases[i].size(0) == weights[i].size(0),
                           "linear_concat: ", bname, " has shape ", biases[i].sizes(),
                           "; expected [", weights[i].size(0), "]");
    }
  }
}

// Two ways to run it, chosen per call by the weights' shapes (LinearConcatFn::use_cat):
//  - cat: one GEMM against cat(weights), rebuilt in backward (never saved). Pays 2 reads and 2
//    writes of the weights per step; wins when some weight is thin (GQA k/v: 256 rows at 1b),
//    where separate GEMMs run far below the matrix-rate ceiling.
//  - slices: one GEMM per weight writing its column block of the output in place (cuBLAS takes
//    the row stride), dx accumulated by beta = 1 GEMMs; no weight copies (at 7b the cat would
//    move ~1 GB per layer and step).
struct LinearConcatFn : torch::autograd::Function<LinearConcatFn> {
  static constexpr int64_t kThinRows = 1024;
  static bool use_cat(at::TensorList weights) {
    for (const auto& w : weights)
      if (w.size(0) < kThinRows) return true;
    return false;
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList weights,
                            at::TensorList biases) {
    std::vector<at::Tensor> save{x};
    save.insert(save.end(), weights.begin(), weights.end());
    ctx->save_for_backward(save);
    ctx->saved_data["biases"] = static_cast<int64_t>(biases.size());
    if (use_cat(weights)) {
      at::Tensor w = at::cat(weights, 0);
      return biases.empty() ? at::linear(x, w) : at::linear(x, w, at::cat(biases, 0));
    }
    int64_t total = 0;
    for (const auto& w : weights) total += w.size(0);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = total;
    at::Tensor y = at::empty(shape, x.options());
    at::Tensor y2 = y.view({-1, total}), x2 = x.reshape({-1, x.size(-1)});
    int64_t off = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      at::Tensor block = y2.narrow(1, off, weights[i].size(0));
      if (biases.empty())
        at::mm_out(block, x2, weights[i].t());
      else
        at::addmm_out(block, biases[i], x2, weights[i].t());
      off += weights[i].size(0);
    }
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const size_t nw = saved.size() - 1;
    const auto nb = static_cast<size_t>(ctx->saved_data["biases"].toInt());
    variable_list out(1 + nw + nb);
    if (!grad[0].defined()) return out;
    const at::Tensor& x = saved[0];
    std::vector<at::Tensor> ws(saved.begin() + 1, saved.end());
    std::vector<int64_t> rows;
    for (const auto& w : ws) rows.push_back(w.size(0));
    const int64_t in = x.size(-1), total = grad[0].size(-1);
    at::Tensor dy = grad[0].reshape({-1, total});
    at::Tensor x2 = x.reshape({-1, in});
    bool any_w = false;
    for (size_t i = 0; i < nw; ++i) any_w = any_w || ctx->needs_input_grad(1 + i);
    if (use_cat(ws)) {
      if (ctx->needs_input_grad(0)) out[0] = at::mm(dy, at::cat(ws, 0)).view(x.sizes());
      if (any_w) {
        // One GEMM for every weight's gradient; each is a row block (contiguous) of it.
        std::vector<at::Tensor> dws = at::mm(dy.t(), x2).split_with_sizes(rows, 0);
        for (size_t i = 0; i < nw; ++i)
          if (ctx->needs_input_grad(1 + i)) out[1 + i] = dws[i];
      }
    } else {
      std::vector<at::Tensor> dys = dy.split_with_sizes(rows, 1);  // column blocks, no copies
      if (ctx->needs_input_grad(0)) {
        at::Tensor dx = at::mm(dys[0], ws[0]);
        for (size_t i = 1; i < nw; ++i) dx.addmm_(dys[i], ws[i]);  // cuBLAS beta = 1
        out[0] = dx.view(x.sizes());
      }
      for (size_t i = 0; i < nw; ++i)
        if (ctx->needs_input_grad(1 + i)) out[1 + i] = at::mm(dys[i].t(), x2);
    }
    if (nb > 0) {
      std::vector<at::Tensor> dbs = dy.sum(0).split_with_sizes(rows, 0);
      for (size_t i = 0; i < nb; ++i)
        if (ctx->needs_input_grad(1 + nw + i)) out[1 + nw + i] = dbs[i];
    }
    return out;
  }
};

}  // namespace

// ---- Concatenated linear ----
at::Tensor linear_concat_reference(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<at::Tensor>& biases) {
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < weights.size(); ++i)
    ys.push_back(biases.empty() ? at::linear(x, weights[i]) : at::linear(x, weights[i], biases[i]));
  return at::cat(ys, -1);
}

at::Tensor linear_concat(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& biases) {
  check_linear_concat(x, weights, biases);
  return LinearConcatFn::apply(x, at::TensorList(weights), at::TensorList(biases));
}

}  // namespace colossal::kernels
