// Autograd functions for the tensor/sequence-parallel region operations (parallel_ops.h).
#include "colossal/nn/parallel_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "colossal/core/error.h"

namespace colossal::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor all_reduce_sum(const at::Tensor& x, const dist::Communicator& g) {
  at::Tensor y = x.contiguous().clone();
  const_cast<dist::Communicator&>(g).all_reduce(y, dist::ReduceOp::Sum);
  return y;
}

// Concatenates every rank's x along dim (rank order).
at::Tensor all_gather_dim(const at::Tensor& x, const dist::Communicator& g, int64_t dim) {
  const int64_t w = g.size();
  at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] *= w;
  at::Tensor out = at::empty(shape, moved.options());
  const_cast<dist::Communicator&>(g).all_gather(out, moved);
  return out.movedim(0, dim);
}

at::Tensor reduce_scatter_dim(const at::Tensor& x, const dist::Communicator& g, int64_t dim) {
  const int64_t w = g.size();
  COLOSSAL_CHECK(x.size(dim) % w == 0, "reduce_scatter over ", g.name(), ": dim ", dim, " of size ",
                 x.size(dim), " is not divisible by the group size ", w);
  at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] /= w;
  at::Tensor out = at::empty(shape, moved.options());
  const_cast<dist::Communicator&>(g).reduce_scatter(out, moved, dist::ReduceOp::Sum);
  return out.movedim(0, dim);
}

at::Tensor own_slice(const at::Tensor& x, const dist::Communicator& g, int64_t dim) {
  const int64_t w = g.size();
  COLOSSAL_CHECK(x.size(dim) % w == 0, "split over ", g.name(), ": dim ", dim, " of size ",
                 x.size(dim), " is not divisible by the group size ", w);
  const int64_t n = x.size(dim) / w;
  return x.narrow(dim, g.rank() * n, n).contiguous();
}

// The group and dim travel in the context as a capsule (freed with the graph).
struct Saved : torch::CustomClassHolder {
  Saved(dist::Communicator g, int64_t d) : group(std::move(g)), dim(d) {}
  dist::Communicator group;
  int64_t dim;
};

template <at::Tensor (*Fwd)(const at::Tensor&, const dist::Communicator&, int64_t),
          at::Tensor (*Bwd)(const at::Tensor&, const dist::Communicator&, int64_t)>
struct RegionOp : torch::autograd::Function<RegionOp<Fwd, Bwd>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<Saved>& saved) {
    ctx->saved_data["region"] = c10::IValue::make_capsule(saved);
    return Fwd(x, saved->group, saved->dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["region"].toCapsule());
    return {Bwd(grads[0], s->group, s->dim), at::Tensor()};
  }
};

at::Tensor identity(const at::Tensor& x, const dist::Communicator&, int64_t) {
  return x;
}
at::Tensor reduce(const at::Tensor& x, const dist::Communicator& g, int64_t) {
  return all_reduce_sum(x, g);
}

template <class Op>
at::Tensor apply(const at::Tensor& x, const dist::Communicator& group, int64_t dim) {
  if (!group.valid() || group.size() == 1) return x;
  if (dim < 0) dim += x.dim();
  return Op::apply(x, c10::make_intrusive<Saved>(group, dim));
}

}  // namespace

at::Tensor copy_to_region(const at::Tensor& x, const dist::Communicator& group) {
  return apply<RegionOp<identity, reduce>>(x, group, 0);
}

at::Tensor reduce_from_region(const at::Tensor& x, const dist::Communicator& group) {
  return apply<RegionOp<reduce, identity>>(x, group, 0);
}

at::Tensor gather_from_sequence(const at::Tensor& x, const dist::Communicator& group, int64_t dim) {
  return apply<RegionOp<all_gather_dim, reduce_scatter_dim>>(x, group, dim);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, const dist::Communicator& group,
                                   int64_t dim) {
  return apply<RegionOp<reduce_scatter_dim, all_gather_dim>>(x, group, dim);
}

at::Tensor split_sequence(const at::Tensor& x, const dist::Communicator& group, int64_t dim) {
  return apply<RegionOp<own_slice, all_gather_dim>>(x, group, dim);
}

at::Tensor gather_from_region(const at::Tensor& x, const dist::Communicator& group, int64_t dim) {
  return apply<RegionOp<all_gather_dim, own_slice>>(x, group, dim);
}

}  // namespace colossal::nn
