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

// ---- all-to-all ----------------------------------------------------------------------------
namespace {

at::Tensor all_to_all_dims(const at::Tensor& x, const dist::Communicator& g, int64_t scatter,
                           int64_t gather) {
  const int64_t w = g.size();
  const int64_t n = x.size(scatter) / w;
  // [w, ... n at scatter ...]: slice j first, as the engine sends slice j to rank j.
  at::Tensor in = x.unflatten(scatter, {w, n}).movedim(scatter, 0).contiguous();
  at::Tensor out = at::empty_like(in);
  const_cast<dist::Communicator&>(g).all_to_all(out, in);
  // out[i] came from rank i: it becomes the i-th part of the gather dim.
  return out.movedim(0, gather).flatten(gather, gather + 1);
}

struct AllToAllSaved : torch::CustomClassHolder {
  AllToAllSaved(dist::Communicator g, int64_t s, int64_t d)
      : group(std::move(g)), scatter(s), gather(d) {}
  dist::Communicator group;
  int64_t scatter, gather;
};

struct AllToAllOp : torch::autograd::Function<AllToAllOp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<AllToAllSaved>& saved) {
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(saved);
    return all_to_all_dims(x, saved->group, saved->scatter, saved->gather);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = c10::static_intrusive_pointer_cast<AllToAllSaved>(ctx->saved_data["a2a"].toCapsule());
    return {all_to_all_dims(grads[0], s->group, s->gather, s->scatter), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_to_all_region(const at::Tensor& x, const dist::Communicator& group,
                             int64_t scatter_dim, int64_t gather_dim) {
  if (scatter_dim < 0) scatter_dim += x.dim();
  if (gather_dim < 0) gather_dim += x.dim();
  COLOSSAL_CHECK_INPUT(scatter_dim >= 0 && scatter_dim < x.dim() && gather_dim >= 0 &&
                           gather_dim < x.dim() && scatter_dim != gather_dim,
                       "all_to_all_region: scatter_dim ", scatter_dim, " and gather_dim ",
                       gather_dim, " must be two different dims of a ", x.dim(), "-dim tensor");
  if (!group.valid() || group.size() == 1) return x;
  COLOSSAL_CHECK_INPUT(x.size(scatter_dim) % group.size() == 0, "all_to_all_region over ",
                       group.name(), ": scatter dim ", scatter_dim, " of size ",
                       x.size(scatter_dim), " is not divisible by the group size ", group.size());
  return AllToAllOp::apply(x, c10::make_intrusive<AllToAllSaved>(group, scatter_dim, gather_dim));
}

}  // namespace colossal::nn
