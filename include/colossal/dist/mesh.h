// ProcessGroupMesh: the ranks laid out on a grid of named parallel axes (dp, pp, tp, sp, ep) in
// C order -- the last axis varies fastest, so tensor-parallel peers are neighbouring ranks (one
// node, fast links). Every group along one or several axes is sliced out of that one grid,
// created on first request and cached.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "colossal/dist/communicator.h"

namespace colossal::dist {

enum class Axis { DP, PP, TP, SP, EP };
const char* to_string(Axis a);
Axis parse_axis(const std::string& name);  // "dp" ... "ep"; InputError otherwise

class ProcessGroupMesh {
 public:
  // `axes` in layout order, e.g. {{Axis::DP, 2}, {Axis::PP, 2}, {Axis::TP, 2}}. The product of
  // the sizes must equal the world size (InputError naming the sizes otherwise). `world` is the
  // communicator the groups are sliced from (default: dist::world()).
  explicit ProcessGroupMesh(std::vector<std::pair<Axis, int>> axes);
  ProcessGroupMesh(std::vector<std::pair<Axis, int>> axes, const Communicator& world);

  // Number of mesh axes ("dim" is kept for tensor dimensions, as in torchtitan).
  int num_axes() const { return static_cast<int>(axes_.size()); }
  const std::vector<Axis>& axes() const { return axes_; }
  const std::vector<int>& shape() const { return shape_; }
  bool has(Axis a) const;
  int size(Axis a) const;  // 1 for an axis the mesh does not have
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }  // this process's global rank

  // Grid coordinate of a global rank (default: this rank), in axis order.
  std::vector<int> coordinate(int global_rank = -1) const;
  int coordinate(Axis a, int global_rank = -1) const;
  int ravel(const std::vector<int>& coord) const;  // coordinate -> global rank

  // Global ranks of the group through `global_rank` along `along` (the other coordinates fixed),
  // in group-rank order (the first listed axis is the slowest).
  std::vector<int> group_ranks(const std::vector<Axis>& along, int global_rank = -1) const;
  // Every group along `along`, ordered by their first rank.
  std::vector<std::vector<int>> all_group_ranks(const std::vector<Axis>& along) const;

  // This rank's group along one or several axes; built on first call and cached.
  Communicator& group(Axis a);
  Communicator& group(const std::vector<Axis>& along);

  std::string describe() const;  // "dp=2 x pp=1 x tp=2"

 private:
  int axis_index(Axis a) const;
  std::vector<Axis> axes_;
  std::vector<int> shape_;
  int world_size_ = 1;
  int rank_ = 0;
  int id_ = 0;
  Communicator world_;
  std::map<std::vector<int>, Communicator> groups_;  // key: axis indices in request order
};

}  // namespace colossal::dist
