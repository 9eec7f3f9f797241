// ProcessGroupMesh at world 4: for (dp2,tp2), (pp2,tp2), (dp2,pp2) and (dp1,pp2,tp2) every
// rank's groups hold the members computed here independently (by enumerating the grid), and a
// collective on each group gives the sum and the ordered list of its members.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/mesh.h"
#include "dist_test_env.h"

namespace colossal::dist {
namespace {

using Layout = std::vector<std::pair<Axis, int>>;

// Coordinates of every rank by walking the grid in C order with an odometer.
std::vector<std::vector<int>> grid_coords(const Layout& layout) {
  std::vector<std::vector<int>> out;
  std::vector<int> c(layout.size(), 0);
  while (true) {
    out.push_back(c);
    int i = static_cast<int>(layout.size()) - 1;
    while (i >= 0 && ++c[i] == layout[i].second) c[i--] = 0;
    if (i < 0) break;
  }
  return out;
}

// Members of `me`'s group along `along`: ranks agreeing with me on every other axis, in rank order.
std::vector<int> expected_members(const Layout& layout, const std::vector<Axis>& along, int me) {
  auto coords = grid_coords(layout);
  std::vector<int> out;
  for (int q = 0; q < static_cast<int>(coords.size()); ++q) {
    bool same = true;
    for (size_t k = 0; k < layout.size(); ++k) {
      bool free = false;
      for (Axis a : along) free |= a == layout[k].first;
      if (!free && coords[q][k] != coords[me][k]) same = false;
    }
    if (same) out.push_back(q);
  }
  return out;
}

void check_layout(const Layout& layout) {
  ProcessGroupMesh mesh(layout);
  int me = rank();
  auto coords = grid_coords(layout);
  EXPECT_EQ(mesh.coordinate(), coords[me]);
  EXPECT_EQ(mesh.ravel(coords[me]), me);
  std::vector<std::vector<Axis>> sets;
  for (auto& [a, n] : layout) sets.push_back({a});
  for (size_t i = 0; i < layout.size(); ++i)
    for (size_t j = i + 1; j < layout.size(); ++j)
      sets.push_back({layout[i].first, layout[j].first});
  for (const auto& along : sets) {
    std::string what = mesh.describe() + " along";
    for (Axis a : along) what += std::string(" ") + to_string(a);
    auto want = expected_members(layout, along, me);
    EXPECT_EQ(mesh.group_ranks(along), want) << what;
    auto& g = mesh.group(along);
    EXPECT_EQ(&g, &mesh.group(along)) << what << ": not cached";
    EXPECT_EQ(g.ranks(), want) << what;
    ASSERT_EQ(g.size(), static_cast<int>(want.size())) << what;
    EXPECT_EQ(want[g.rank()], me) << what;
    auto x = at::full({3}, static_cast<double>(me + 1), at::kFloat);
    g.all_reduce(x);
    double sum = 0;
    for (int r : want) sum += r + 1;
    EXPECT_TRUE(at::equal(x, at::full({3}, sum, at::kFloat))) << what;
    auto out = at::empty({g.size()}, at::kLong);
    g.all_gather(out, at::full({1}, me, at::kLong));
    EXPECT_TRUE(
        at::equal(out, at::tensor(std::vector<int64_t>(want.begin(), want.end()), at::kLong)))
        << what;
  }
  // Every group along the first axis, listed once each, covers the world.
  auto all = mesh.all_group_ranks({layout[0].first});
  int covered = 0;
  for (auto& g : all) covered += static_cast<int>(g.size());
  EXPECT_EQ(covered, world_size());
}

TEST(Mesh, DpTp) {
  ASSERT_EQ(world_size(), 4);
  check_layout({{Axis::DP, 2}, {Axis::TP, 2}});
}
TEST(Mesh, PpTp) {
  check_layout({{Axis::PP, 2}, {Axis::TP, 2}});
}
TEST(Mesh, DpPp) {
  check_layout({{Axis::DP, 2}, {Axis::PP, 2}});
}
TEST(Mesh, Dp1PpTp) {
  check_layout({{Axis::DP, 1}, {Axis::PP, 2}, {Axis::TP, 2}});
}

TEST(Mesh, TpPeersAreNeighbours) {
  ProcessGroupMesh mesh({{Axis::DP, 2}, {Axis::TP, 2}});
  int me = rank();
  EXPECT_EQ(mesh.group_ranks({Axis::TP}), (std::vector<int>{me / 2 * 2, me / 2 * 2 + 1}));
  EXPECT_EQ(mesh.coordinate(Axis::TP), me % 2);
  EXPECT_EQ(mesh.coordinate(Axis::SP), 0);
  EXPECT_EQ(mesh.size(Axis::EP), 1);
}

TEST(Mesh, WrongSizeNamesTheSizes) {
  try {
    ProcessGroupMesh mesh({{Axis::DP, 2}, {Axis::TP, 3}});
    FAIL() << "no error";
  } catch (const InputError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("dp=2 x tp=3"), std::string::npos) << m;
    EXPECT_NE(m.find("6"), std::string::npos) << m;
    EXPECT_NE(m.find("4"), std::string::npos) << m;
  }
  EXPECT_THROW(ProcessGroupMesh({{Axis::DP, 2}, {Axis::DP, 2}}), InputError);
  EXPECT_THROW(parse_axis("xp"), InputError);
  EXPECT_EQ(parse_axis("ep"), Axis::EP);
}

}  // namespace
}  // namespace colossal::dist
