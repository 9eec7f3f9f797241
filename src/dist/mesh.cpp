// ProcessGroupMesh: rank <-> coordinate arithmetic and group slicing (one grid, C order).
#include "colossal/dist/mesh.h"

#include <atomic>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"

namespace colossal::dist {

const char* to_string(Axis a) {
  switch (a) {
    case Axis::DP:
      return "dp";
    case Axis::PP:
      return "pp";
    case Axis::TP:
      return "tp";
    case Axis::SP:
      return "sp";
    case Axis::EP:
      return "ep";
  }
  return "?";
}

Axis parse_axis(const std::string& name) {
  for (Axis a : {Axis::DP, Axis::PP, Axis::TP, Axis::SP, Axis::EP})
    if (name == to_string(a)) return a;
  throw InputError(str("unknown mesh axis '", name, "': expected one of dp, pp, tp, sp, ep"));
}

namespace {
std::atomic<int> g_mesh_count{0};
}

ProcessGroupMesh::ProcessGroupMesh(std::vector<std::pair<Axis, int>> axes)
    : ProcessGroupMesh(std::move(axes), world()) {}

ProcessGroupMesh::ProcessGroupMesh(std::vector<std::pair<Axis, int>> axes,
                                   const Communicator& world)
    : world_(world) {
  COLOSSAL_CHECK_INPUT(!axes.empty(), "a process-group mesh needs at least one axis");
  COLOSSAL_CHECK(world_.valid(), "ProcessGroupMesh needs a valid world communicator");
  long long product = 1;
  for (auto& [a, n] : axes) {
    COLOSSAL_CHECK_INPUT(n >= 1, "mesh axis ", to_string(a), " has size ", n,
                         "; sizes must be at least 1");
    for (Axis b : axes_)
      COLOSSAL_CHECK_INPUT(b != a, "mesh axis ", to_string(a), " is listed twice");
    axes_.push_back(a);
    shape_.push_back(n);
    product *= n;
  }
  world_size_ = world_.size();
  COLOSSAL_CHECK_INPUT(product == world_size_, "the mesh ", describe(), " holds ", product,
                       " ranks but the world has ", world_size_,
                       "; choose axis sizes whose product is the number of ranks");
  rank_ = world_.rank();
  // Meshes are built by every rank in the same (program) order, so this id agrees across ranks
  // and keeps the groups of two meshes apart.
  id_ = g_mesh_count++;
}

bool ProcessGroupMesh::has(Axis a) const {
  for (Axis b : axes_)
    if (a == b) return true;
  return false;
}

int ProcessGroupMesh::axis_index(Axis a) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i] == a) return static_cast<int>(i);
  throw Error(str("the mesh ", describe(), " has no axis ", to_string(a)));
}

int ProcessGroupMesh::size(Axis a) const {
  return has(a) ? shape_[axis_index(a)] : 1;
}

std::vector<int> ProcessGroupMesh::coordinate(int global_rank) const {
  int r = global_rank < 0 ? rank_ : global_rank;
  COLOSSAL_CHECK(r < world_size_, "rank ", r, " is outside the mesh ", describe());
  std::vector<int> c(shape_.size());
  for (int i = static_cast<int>(shape_.size()) - 1; i >= 0; --i) {
    c[i] = r % shape_[i];
    r /= shape_[i];
  }
  return c;
}

int ProcessGroupMesh::coordinate(Axis a, int global_rank) const {
  if (!has(a)) return 0;
  return coordinate(global_rank)[axis_index(a)];
}

int ProcessGroupMesh::ravel(const std::vector<int>& coord) const {
  COLOSSAL_CHECK(coord.size() == shape_.size(), "coordinate has ", coord.size(),
                 " entries but the mesh ", describe(), " has ", shape_.size(), " axes");
  int r = 0;
  for (size_t i = 0; i < shape_.size(); ++i) {
    COLOSSAL_CHECK(coord[i] >= 0 && coord[i] < shape_[i], "coordinate ", coord[i],
                   " is outside axis ", to_string(axes_[i]), " of size ", shape_[i]);
    r = r * shape_[i] + coord[i];
  }
  return r;
}

std::vector<int> ProcessGroupMesh::group_ranks(const std::vector<Axis>& along,
                                               int global_rank) const {
  COLOSSAL_CHECK(!along.empty(), "group_ranks needs at least one axis");
  std::vector<int> idx;
  for (Axis a : along) {
    int i = axis_index(a);
    for (int j : idx) COLOSSAL_CHECK(j != i, "axis ", to_string(a), " is listed twice");
    idx.push_back(i);
  }
  std::vector<int> base = coordinate(global_rank);
  // Enumerate the chosen axes' coordinates, the first listed axis slowest.
  int n = 1;
  for (int i : idx) n *= shape_[i];
  std::vector<int> out;
  out.reserve(n);
  for (int k = 0; k < n; ++k) {
    int rem = k;
    auto c = base;
    for (int j = static_cast<int>(idx.size()) - 1; j >= 0; --j) {
      c[idx[j]] = rem % shape_[idx[j]];
      rem /= shape_[idx[j]];
    }
    out.push_back(ravel(c));
  }
  return out;
}

std::vector<std::vector<int>> ProcessGroupMesh::all_group_ranks(
    const std::vector<Axis>& along) const {
  std::vector<std::vector<int>> out;
  std::vector<bool> seen(world_size_, false);
  for (int r = 0; r < world_size_; ++r) {
    if (seen[r]) continue;
    auto g = group_ranks(along, r);
    for (int m : g) seen[m] = true;
    out.push_back(std::move(g));
  }
  return out;
}

Communicator& ProcessGroupMesh::group(Axis a) {
  return group(std::vector<Axis>{a});
}

Communicator& ProcessGroupMesh::group(const std::vector<Axis>& along) {
  std::vector<int> key;
  for (Axis a : along) key.push_back(axis_index(a));
  auto it = groups_.find(key);
  if (it != groups_.end()) return it->second;
  std::vector<int> members;
  for (int r : group_ranks(along)) members.push_back(world_.global_rank(r));
  std::string name = "mesh" + std::to_string(id_) + ":";
  for (size_t i = 0; i < along.size(); ++i)
    name += (i ? "," : "") + std::string(to_string(along[i]));
  auto comm = world_.new_group(members, name);
  COLOSSAL_CHECK(comm.valid(), "internal: rank ", rank_, " is not in its own ", name, " group");
  return groups_.emplace(key, std::move(comm)).first->second;
}

std::string ProcessGroupMesh::describe() const {
  std::string s;
  for (size_t i = 0; i < axes_.size(); ++i)
    s += (i ? " x " : "") + std::string(to_string(axes_[i])) + "=" + std::to_string(shape_[i]);
  return s;
}

}  // namespace colossal::dist
