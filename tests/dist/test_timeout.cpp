// A collective that one rank never joins ends in a DistError naming the collective, the group
// and the rank within the group's short timeout -- not a hang -- and the job then ends normally.
#include <gtest/gtest.h>

#include <chrono>

#include "colossal/core/error.h"
#include "dist_test_env.h"

namespace colossal::dist {
namespace {

using namespace std::chrono;

void expect_dist_error(const std::function<void()>& f, const std::string& op,
                       const std::string& group, int me) {
  auto t0 = steady_clock::now();
  try {
    f();
    FAIL() << op << " on " << group << " returned although rank 0 never joined";
  } catch (const DistError& e) {
    double s = duration<double>(steady_clock::now() - t0).count();
    std::string m = e.what();
    EXPECT_LT(s, 30.0) << m;
    EXPECT_NE(m.find(op), std::string::npos) << m;
    EXPECT_NE(m.find("'" + group + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("global rank " + std::to_string(me)), std::string::npos) << m;
    std::fprintf(stderr, "rank %d got after %.1f s: %s\n", me, s, m.c_str());
  }
}

TEST(Timeout, CollectiveOneRankSkips) {
  int me = rank(), n = world_size();
  ASSERT_GE(n, 2);
  std::vector<int> all;
  for (int r = 0; r < n; ++r) all.push_back(r);
  auto g = new_group(all, "skipped");
  g.set_timeout(seconds(3));
  auto x = at::ones({8});
  g.all_reduce(x);  // everyone: connects the group
  EXPECT_TRUE(at::equal(x, at::full({8}, static_cast<double>(n))));
  if (me != 0) expect_dist_error([&] { g.all_reduce(x); }, "all_reduce(sum)", "skipped", me);
  world().barrier();  // rank 0 keeps the group alive until the others gave up
}

TEST(Timeout, GroupOneRankNeverJoins) {
  int me = rank(), n = world_size();
  std::vector<int> all;
  for (int r = 0; r < n; ++r) all.push_back(r);
  if (me != 0) {  // rank 0 never even creates it
    auto g = new_group(all, "never_joined");
    g.set_timeout(seconds(3));
    auto x = at::ones({8});
    expect_dist_error([&] { g.all_reduce(x); }, "all_reduce(sum)", "never_joined", me);
  }
  world().barrier();
}

TEST(Timeout, RecvFromSilentPeer) {
  int me = rank(), n = world_size();
  std::vector<int> all;
  for (int r = 0; r < n; ++r) all.push_back(r);
  auto g = new_group(all, "p2p");
  g.set_timeout(seconds(3));
  g.barrier();
  if (me == 1) {
    auto y = at::empty({4});
    expect_dist_error([&] { g.recv(y, 0, 7); }, "recv(src=0", "p2p", me);
  }
  world().barrier();
}

}  // namespace
}  // namespace colossal::dist
