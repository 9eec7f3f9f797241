// GradReducer: one axis's reducer from its communicator, and the composition over several axes.
#include "colossal/amp/grad_reducer.h"

#include <utility>

#include "colossal/dist/parallel_dims.h"

namespace colossal::amp {

bool GradReducer::counts(const std::vector<std::string>& replicated_over) const {
  for (const std::string& name : replicated_over)
    for (const Axis& a : axes)
      if (a.name == name && a.rank != 0) return false;
  return true;
}

GradReducer over(const dist::Communicator& comm, at::Device device, std::string axis) {
  GradReducer r;
  if (!comm.valid()) {
    r.axes.push_back({std::move(axis), 0, 1});
    return r;
  }
  r.axes.push_back({std::move(axis), comm.rank(), comm.size()});
  if (comm.size() == 1) return r;
  auto reduce = [device](dist::Communicator c, dist::ReduceOp op) {
    return [c, device, op](at::Tensor& t) mutable {
      at::Tensor d = t.to(device);
      c.all_reduce(d, op);
      t.copy_(d);
    };
  };
  r.all_reduce_sum = reduce(comm, dist::ReduceOp::Sum);
  r.all_reduce_max = reduce(comm, dist::ReduceOp::Max);
  return r;
}

GradReducer compose(const std::vector<GradReducer>& reducers) {
  GradReducer out;
  std::vector<std::function<void(at::Tensor&)>> sums, maxes;
  for (const GradReducer& r : reducers) {
    if (r.all_reduce_sum) sums.push_back(r.all_reduce_sum);
    if (r.all_reduce_max) maxes.push_back(r.all_reduce_max);
    out.axes.insert(out.axes.end(), r.axes.begin(), r.axes.end());
  }
  auto chain = [](std::vector<std::function<void(at::Tensor&)>> fns) {
    return [fns = std::move(fns)](at::Tensor& t) {
      for (const auto& f : fns) f(t);
    };
  };
  if (!sums.empty()) out.all_reduce_sum = chain(std::move(sums));
  if (!maxes.empty()) out.all_reduce_max = chain(std::move(maxes));
  return out;
}

GradReducer over_parallel_dims(dist::ParallelDims& dims, at::Device device) {
  return compose({over(dims.dp_sp(), device, "dp"), over(dims.tp(), device, "tp"),
                  over(dims.pp(), device, "pp")});
}

}  // namespace colossal::amp
