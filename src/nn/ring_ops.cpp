// The ring (chunked, overlapped) sequence-parallel linear operations (ring_ops.h).
#include "colossal/nn/ring_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "colossal/core/error.h"

namespace colossal::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RingSaved : torch::CustomClassHolder {
  RingSaved(dist::Communicator g, int64_t d) : group(std::move(g)), dim(d) {}
  dist::Communicator group;
  int64_t dim;
};

int64_t mod(int64_t a, int64_t w) {
  return ((a % w) + w) % w;
}

// The ring all-gather of `local` (this rank's chunk): on_chunk(c, chunk) runs for the chunk of
// every rank c, own first; while it runs, the chunk it reads is already on its way to the next
// rank and the previous rank's is arriving.
template <class F>
void ring_gather(const at::Tensor& local, dist::Communicator g, F&& on_chunk) {
  const int64_t w = g.size(), r = g.rank();
  const int next = static_cast<int>(mod(r + 1, w)), prev = static_cast<int>(mod(r - 1, w));
  at::Tensor cur = local.contiguous();
  for (int64_t s = 0; s < w; ++s) {
    at::Tensor arriving;
    dist::Work work;
    if (s + 1 < w) {
      arriving = at::empty_like(cur);
      work = g.batch_p2p({dist::P2POp::send(cur, next), dist::P2POp::recv(arriving, prev)},
                         /*async_op=*/true);
    }
    on_chunk(mod(r - s, w), cur);
    if (s + 1 < w) {
      work.wait();
      cur = std::move(arriving);
    }
  }
}

// The ring reduce-scatter of partial(c) (this rank's contribution to chunk c, made on demand):
// returns the sum over ranks of partial(rank). Each step computes the next partial while the
// running sum of the previous step travels; the sum for chunk c visits ranks c+1, ..., c.
template <class F>
at::Tensor ring_reduce_scatter(dist::Communicator g, F&& partial) {
  const int64_t w = g.size(), r = g.rank();
  const int next = static_cast<int>(mod(r + 1, w)), prev = static_cast<int>(mod(r - 1, w));
  at::Tensor acc, arriving;
  dist::Work work;
  for (int64_t s = 0; s < w; ++s) {
    at::Tensor p = partial(mod(r - s - 1, w)).contiguous();
    if (s > 0) {
      work.wait();
      acc = arriving.add_(p);
    } else {
      acc = p;
    }
    if (s + 1 < w) {
      arriving = at::empty_like(acc);
      work = g.batch_p2p({dist::P2POp::send(acc, next), dist::P2POp::recv(arriving, prev)},
                         /*async_op=*/true);
    }
  }
  return acc;
}

// [.., n, ..] -> [rows, last]: a chunk as a matrix for the weight-gradient GEMM.
at::Tensor rows(const at::Tensor& t) {
  return t.reshape({-1, t.size(-1)});
}

// Weight gradients accumulate over the chunks in fp32 (one GEMM over the whole sequence, as
// split_gather does, accumulates inside the GEMM at fp32 or better).
void accumulate(at::Tensor& acc, const at::Tensor& dy_chunk, const at::Tensor& x_chunk) {
  at::Tensor g = at::mm(rows(dy_chunk).t(), rows(x_chunk));
  acc.add_(g.scalar_type() == at::kFloat ? g : g.to(at::kFloat));
}

// y = gather(x) W^T around the ring.
struct RingColumn : torch::autograd::Function<RingColumn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const c10::intrusive_ptr<RingSaved>& saved) {
    ctx->saved_data["ring"] = c10::IValue::make_capsule(saved);
    ctx->save_for_backward({x, w});
    const int64_t d = saved->dim, n = x.size(d), world = saved->group.size();
    std::vector<int64_t> shape = x.sizes().vec();
    shape[d] = n * world;
    shape.back() = w.size(0);
    at::Tensor y = at::empty(shape, x.options().dtype(w.scalar_type()));
    ring_gather(x, saved->group, [&](int64_t c, const at::Tensor& chunk) {
      y.narrow(d, c * n, n).copy_(at::linear(chunk, w));
    });
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = c10::static_intrusive_pointer_cast<RingSaved>(ctx->saved_data["ring"].toCapsule());
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor dy = grads[0].contiguous();
    const int64_t d = s->dim, n = x.size(d);
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(1)) {
      // The input chunks go round once more; each arrived one adds its share of dW.
      at::Tensor acc = at::zeros(w.sizes(), w.options().dtype(at::kFloat));
      ring_gather(x, s->group, [&](int64_t c, const at::Tensor& chunk) {
        accumulate(acc, dy.narrow(d, c * n, n), chunk);
      });
      dw = acc.to(w.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      dx = ring_reduce_scatter(s->group,
                               [&](int64_t c) { return at::matmul(dy.narrow(d, c * n, n), w); });
    }
    return {dx, dw, at::Tensor()};
  }
};

// y = reduce_scatter(x W^T) around the ring.
struct RingRow : torch::autograd::Function<RingRow> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const c10::intrusive_ptr<RingSaved>& saved) {
    ctx->saved_data["ring"] = c10::IValue::make_capsule(saved);
    ctx->save_for_backward({x, w});
    const int64_t d = saved->dim, n = x.size(d) / saved->group.size();
    return ring_reduce_scatter(saved->group,
                               [&](int64_t c) { return at::linear(x.narrow(d, c * n, n), w); });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = c10::static_intrusive_pointer_cast<RingSaved>(ctx->saved_data["ring"].toCapsule());
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const int64_t d = s->dim, n = x.size(d) / s->group.size();
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    at::Tensor dx =
        need_dx ? at::empty(x.sizes(), x.options().dtype(w.scalar_type())) : at::Tensor();
    at::Tensor acc = need_dw ? at::zeros(w.sizes(), w.options().dtype(at::kFloat)) : at::Tensor();
    // The output gradient's chunks go round; each arrived one gives its rows of dx and its
    // share of dW.
    ring_gather(grads[0], s->group, [&](int64_t c, const at::Tensor& dy) {
      if (need_dx) dx.narrow(d, c * n, n).copy_(at::matmul(dy, w));
      if (need_dw) accumulate(acc, dy, x.narrow(d, c * n, n));
    });
    return {dx, need_dw ? acc.to(w.scalar_type()) : at::Tensor(), at::Tensor()};
  }
};

int64_t check_dim(const at::Tensor& x, const at::Tensor& w, int64_t dim, const char* op) {
  COLOSSAL_CHECK(x.dim() >= 2 && w.dim() == 2, op, ": input of ", x.dim(),
                 " dims and a 2-d weight expected, got weight of ", w.dim(), " dims");
  if (dim < 0) dim += x.dim();
  COLOSSAL_CHECK(dim >= 0 && dim < x.dim() - 1, op, ": the sequence dim ", dim,
                 " must be a dim of the input other than the last (input has ", x.dim(), " dims)");
  return dim;
}

}  // namespace

at::Tensor ring_gather_linear(const at::Tensor& x, const at::Tensor& weight,
                              const dist::Communicator& group, int64_t dim) {
  dim = check_dim(x, weight, dim, "ring_gather_linear");
  if (!group.valid() || group.size() == 1) return at::linear(x, weight);
  return RingColumn::apply(x, weight, c10::make_intrusive<RingSaved>(group, dim));
}

at::Tensor ring_linear_reduce_scatter(const at::Tensor& x, const at::Tensor& weight,
                                      const dist::Communicator& group, int64_t dim) {
  dim = check_dim(x, weight, dim, "ring_linear_reduce_scatter");
  if (!group.valid() || group.size() == 1) return at::linear(x, weight);
  COLOSSAL_CHECK_INPUT(x.size(dim) % group.size() == 0,
                       "sequence parallelism 'ring': the sequence length ", x.size(dim), " (dim ",
                       dim, ") is not divisible by the tensor-parallel size ", group.size(),
                       " of group ", group.name());
  return RingRow::apply(x, weight, c10::make_intrusive<RingSaved>(group, dim));
}

}  // namespace colossal::nn
