// Every collective of the Gloo communicator, on every dtype, against values computed locally
// from all ranks' (deterministic) inputs. Run at world sizes 1, 2 and 4.
#include <gtest/gtest.h>

#include <vector>

#include "colossal/core/error.h"
#include "dist_test_env.h"

namespace colossal::dist {
namespace {

using testing::rank_input;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong};
const std::vector<at::ScalarType> kMoveDtypes = {at::kFloat, at::kBFloat16,      at::kHalf,
                                                 at::kLong,  at::kFloat8_e4m3fn, at::kFloat8_e5m2};

at::Tensor reduce_expected(const std::vector<at::Tensor>& xs, ReduceOp op) {
  auto acc = xs[0].to(at::kDouble);
  for (size_t i = 1; i < xs.size(); ++i) {
    auto x = xs[i].to(at::kDouble);
    if (op == ReduceOp::Max)
      acc = at::maximum(acc, x);
    else if (op == ReduceOp::Min)
      acc = at::minimum(acc, x);
    else
      acc = acc + x;
  }
  if (op == ReduceOp::Avg) acc = acc / static_cast<double>(xs.size());
  return acc;
}

// Exact comparison for moved data (bitwise for fp8), near-exact for reductions.
void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (at::isFloat8Type(got.scalar_type())) {
    ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
    EXPECT_TRUE(at::equal(got.view(at::kByte), want.view(at::kByte))) << what;
  } else {
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), 1e-6, 1e-6))
        << what << "\ngot\n"
        << got << "\nwant\n"
        << want;
  }
}

std::vector<at::Tensor> all_inputs(int n, int salt, at::IntArrayRef shape, at::ScalarType dt) {
  std::vector<at::Tensor> xs;
  for (int r = 0; r < n; ++r) xs.push_back(rank_input(r, salt, shape, dt));
  return xs;
}

TEST(Collectives, AllReduceEveryOpAndDtype) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : kDtypes) {
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && dt == at::kLong) continue;
      auto xs = all_inputs(n, 1, {3, 5}, dt);
      auto x = xs[me].clone();
      w.all_reduce(x, op);
      EXPECT_EQ(x.scalar_type(), dt);
      expect_same(x, reduce_expected(xs, op).to(dt),
                  std::string("all_reduce ") + to_string(op) + " " + c10::toString(dt));
    }
  }
}

TEST(Collectives, ReductionRefusals) {
  auto& w = world();
  auto f8 = at::zeros({4}, at::kFloat).to(at::kFloat8_e4m3fn);
  try {
    w.all_reduce(f8);
    FAIL() << "fp8 all_reduce did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Float8_e4m3fn"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
  }
  auto i = at::zeros({4}, at::kLong);
  EXPECT_THROW(w.all_reduce(i, ReduceOp::Avg), Error);
  auto nc = at::zeros({4, 4}).t();
  EXPECT_THROW(w.all_reduce(nc), Error);
}

TEST(Collectives, AllGatherIntoOneTensor) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : kMoveDtypes) {
    auto src = at::kFloat;
    auto xs = all_inputs(n, 2, {2, 3}, src);
    for (auto& x : xs) x = x.to(dt);
    auto out = at::empty({2 * n, 3}, at::TensorOptions().dtype(dt));
    w.all_gather(out, xs[me]);
    expect_same(out, at::cat(xs, 0), std::string("all_gather ") + c10::toString(dt));
  }
}

TEST(Collectives, ReduceScatterFromOneTensor) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : kDtypes) {
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      if (op == ReduceOp::Avg && dt == at::kLong) continue;
      auto xs = all_inputs(n, 3, {4 * n}, dt);
      auto out = at::empty({4}, at::TensorOptions().dtype(dt));
      w.reduce_scatter(out, xs[me], op);
      auto want = reduce_expected(xs, op).narrow(0, 4 * me, 4).to(dt);
      expect_same(out, want,
                  std::string("reduce_scatter ") + to_string(op) + " " + c10::toString(dt));
    }
  }
}

TEST(Collectives, BroadcastFromEveryRank) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : kMoveDtypes) {
    for (int src = 0; src < n; ++src) {
      auto want = rank_input(src, 4, {7}, at::kFloat).to(dt);
      auto x = me == src ? want.clone() : at::zeros({7}, at::kFloat).to(dt);
      w.broadcast(x, src);
      expect_same(x, want,
                  std::string("broadcast from ") + std::to_string(src) + " " + c10::toString(dt));
    }
  }
}

TEST(Collectives, AllToAllEqualSplits) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : kMoveDtypes) {
    auto xs = all_inputs(n, 5, {2 * n, 3}, at::kFloat);
    for (auto& x : xs) x = x.to(dt);
    auto out = at::empty({2 * n, 3}, at::TensorOptions().dtype(dt));
    w.all_to_all(out, xs[me]);
    std::vector<at::Tensor> parts;
    for (int i = 0; i < n; ++i) parts.push_back(xs[i].narrow(0, 2 * me, 2));
    expect_same(out, at::cat(parts, 0), std::string("all_to_all ") + c10::toString(dt));
  }
}

// Rank r sends r + j + 1 rows to rank j; row values say (source, destination, row).
TEST(Collectives, AllToAllUnevenSplits) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  auto rows = [](int src, int dst) { return static_cast<int64_t>(src + dst + 1); };
  auto block = [](int src, int dst, int64_t k) {
    return (at::arange(k, at::kLong) + 100 * src + 10 * dst).unsqueeze(1).repeat({1, 2});
  };
  std::vector<int64_t> in_splits, out_splits;
  std::vector<at::Tensor> send_parts, want_parts;
  for (int j = 0; j < n; ++j) {
    in_splits.push_back(rows(me, j));
    send_parts.push_back(block(me, j, rows(me, j)));
    out_splits.push_back(rows(j, me));
    want_parts.push_back(block(j, me, rows(j, me)));
  }
  auto input = at::cat(send_parts, 0);
  auto want = at::cat(want_parts, 0);
  for (auto dt : {at::kLong, at::kBFloat16, at::kFloat8_e4m3fn}) {
    auto in = dt == at::kFloat8_e4m3fn ? (input % 8).to(at::kFloat).to(dt) : input.to(dt);
    auto wt = dt == at::kFloat8_e4m3fn ? (want % 8).to(at::kFloat).to(dt) : want.to(dt);
    auto out = at::empty(wt.sizes(), at::TensorOptions().dtype(dt));
    w.all_to_all(out, in, out_splits, in_splits);
    expect_same(out, wt, std::string("uneven all_to_all ") + c10::toString(dt));
  }
  // A split list that does not match the tensor is caught before any communication.
  auto bad = at::empty({want.size(0) + 1, 2}, at::kLong);
  EXPECT_THROW(w.all_to_all(bad, input, out_splits, in_splits), Error);
}

TEST(Collectives, SendRecvRing) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  if (n == 1) GTEST_SKIP() << "a ring needs two ranks";
  int next = (me + 1) % n, prev = (me + n - 1) % n;
  for (auto dt : kMoveDtypes) {
    // Batched: both directions at once, two tags.
    auto a = rank_input(me, 6, {5}, at::kFloat).to(dt);
    auto b = rank_input(me, 7, {3}, at::kFloat).to(dt);
    auto ra = at::zeros({5}, at::kFloat).to(dt);
    auto rb = at::zeros({3}, at::kFloat).to(dt);
    w.batch_p2p({P2POp::send(a, next, 1), P2POp::send(b, prev, 2), P2POp::recv(ra, prev, 1),
                 P2POp::recv(rb, next, 2)});
    expect_same(ra, rank_input(prev, 6, {5}, at::kFloat).to(dt), "ring forward");
    expect_same(rb, rank_input(next, 7, {3}, at::kFloat).to(dt), "ring backward");
  }
  // Plain async send + blocking recv around the ring.
  auto x = at::full({4}, static_cast<double>(me), at::kFloat);
  auto y = at::empty({4}, at::kFloat);
  auto s = w.send(x, next, 0, /*async_op=*/true);
  w.recv(y, prev, 0);
  s.wait();
  EXPECT_TRUE(at::equal(y, at::full({4}, static_cast<double>(prev), at::kFloat)));
  EXPECT_THROW(w.send(x, me), Error);  // to itself
}

TEST(Collectives, AsyncHandles) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  std::vector<at::Tensor> xs;
  std::vector<Work> works;
  for (int k = 0; k < 6; ++k) {
    xs.push_back(at::full({1000}, static_cast<double>(me + k), at::kFloat));
    works.push_back(
        w.all_reduce(xs.back(), k % 2 ? ReduceOp::Avg : ReduceOp::Sum, /*async_op=*/true));
  }
  auto g_out = at::empty({n * 2}, at::kLong);
  auto g = w.all_gather(g_out, at::full({2}, me, at::kLong), true);
  for (auto& wk : works) wk.wait();
  g.wait();
  g.wait();  // idempotent
  double rank_sum = n * (n - 1) / 2.0;
  for (int k = 0; k < 6; ++k) {
    double want = k % 2 ? (rank_sum + n * k) / n : rank_sum + n * k;
    EXPECT_TRUE(works[k].is_completed());
    EXPECT_TRUE(at::allclose(xs[k], at::full({1000}, want, at::kFloat))) << k;
  }
  EXPECT_TRUE(at::equal(g_out, at::arange(n, at::kLong).repeat_interleave(2)));
  Work none;
  EXPECT_TRUE(none.is_completed());
  none.wait();
}

TEST(Collectives, BarrierAndSubGroup) {
  auto& w = world();
  int n = w.size(), me = w.rank();
  w.barrier();
  // Odd and even ranks form groups; each sums its members' ranks.
  std::vector<int> evens, odds;
  for (int r = 0; r < n; ++r) (r % 2 ? odds : evens).push_back(r);
  auto mine = me % 2 ? odds : evens;
  auto g = new_group(mine, me % 2 ? "odds" : "evens");
  if (n > 1) {
    auto other = new_group(me % 2 ? evens : odds, me % 2 ? "evens" : "odds");
    EXPECT_FALSE(other.valid());
  }
  ASSERT_TRUE(g.valid());
  EXPECT_EQ(g.size(), static_cast<int>(mine.size()));
  EXPECT_EQ(g.ranks(), mine);
  auto x = at::full({2}, static_cast<double>(me), at::kDouble);
  g.all_reduce(x);
  double want = 0;
  for (int r : mine) want += r;
  EXPECT_TRUE(at::equal(x, at::full({2}, want, at::kDouble)));
}

TEST(Collectives, Runtime) {
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(world().backend(), Backend::Gloo);
  EXPECT_EQ(world().size(), world_size());
  EXPECT_EQ(world().rank(), rank());
  EXPECT_EQ(world().name(), "world");
  EXPECT_EQ(world().timeout(), default_timeout());
  EXPECT_EQ(world_cpu().impl(), world().impl());
  // Seeded with 1024 on every rank: the same first draw everywhere.
  EXPECT_EQ(at::detail::getDefaultCPUGenerator().current_seed(), 1024u);
}

}  // namespace
}  // namespace colossal::dist
