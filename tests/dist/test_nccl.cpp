// The NCCL communicator on CUDA tensors (skipped without GPUs): every collective against values
// computed locally, as in test_collectives, plus a CPU world over Gloo next to it.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/dist/mesh.h"
#include "colossal/dist/runtime.h"

namespace colossal::dist {
namespace {

bool has_gpus() {
  return backend_available(Backend::Nccl) && Accelerator::cuda().available();
}

class NcclEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (has_gpus()) init(InitOptions().with_backend(Backend::Nccl));
  }
  void TearDown() override {
    if (!is_initialized()) return;
    world().barrier();
    finalize();
  }
};
const bool registered [[maybe_unused]] =
    (::testing::AddGlobalTestEnvironment(new NcclEnvironment), true);

#define NEED_GPUS() \
  if (!has_gpus()) GTEST_SKIP() << "no CUDA device or no NCCL in this build"

at::Tensor input(int rank, int salt, at::IntArrayRef shape, at::ScalarType dt) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 * salt + rank + 1));
  return at::randint(-8, 9, shape, gen, at::TensorOptions().dtype(at::kLong)).to(dt).to(at::kCUDA);
}

void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  auto g = got.cpu(), w = want.cpu();
  if (at::isFloat8Type(g.scalar_type())) {
    EXPECT_TRUE(at::equal(g.view(at::kByte), w.view(at::kByte))) << what;
  } else {
    EXPECT_TRUE(at::allclose(g.to(at::kDouble), w.to(at::kDouble), 1e-6, 1e-6)) << what << "\n"
                                                                                << g << "\n"
                                                                                << w;
  }
}

TEST(Nccl, Device) {
  NEED_GPUS();
  EXPECT_EQ(world().backend(), Backend::Nccl);
  EXPECT_EQ(Accelerator::cuda().current_device(), local_rank());
}

TEST(Nccl, AllReduceAllDtypesAndOps) {
  NEED_GPUS();
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong}) {
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && dt == at::kLong) continue;
      auto acc = input(0, 1, {33}, at::kDouble).cpu();
      for (int r = 1; r < n; ++r) {
        auto x = input(r, 1, {33}, at::kDouble).cpu();
        acc = op == ReduceOp::Max   ? at::maximum(acc, x)
              : op == ReduceOp::Min ? at::minimum(acc, x)
                                    : acc + x;
      }
      if (op == ReduceOp::Avg) acc = acc / n;
      auto x = input(me, 1, {33}, dt);
      w.all_reduce(x, op);
      expect_same(x, acc.to(dt),
                  std::string("all_reduce ") + to_string(op) + " " + c10::toString(dt));
    }
  }
}

TEST(Nccl, GatherScatterBroadcastAllToAll) {
  NEED_GPUS();
  auto& w = world();
  int n = w.size(), me = w.rank();
  for (auto dt : {at::kFloat, at::kBFloat16, at::kFloat8_e4m3fn}) {
    std::vector<at::Tensor> xs;
    for (int r = 0; r < n; ++r) xs.push_back(input(r, 2, {2 * n, 3}, at::kFloat).to(dt));
    auto out = at::empty({2 * n * n, 3}, at::TensorOptions().dtype(dt).device(at::kCUDA));
    w.all_gather(out, xs[me]);
    expect_same(out, at::cat(xs, 0), "all_gather");
    auto a2a = at::empty({2 * n, 3}, at::TensorOptions().dtype(dt).device(at::kCUDA));
    w.all_to_all(a2a, xs[me]);
    std::vector<at::Tensor> parts;
    for (int i = 0; i < n; ++i) parts.push_back(xs[i].narrow(0, 2 * me, 2));
    expect_same(a2a, at::cat(parts, 0), "all_to_all");
    auto b = me == 0 ? xs[0].clone() : at::zeros_like(xs[0]);
    w.broadcast(b, 0);
    expect_same(b, xs[0], "broadcast");
  }
  std::vector<at::Tensor> ys;
  for (int r = 0; r < n; ++r) ys.push_back(input(r, 3, {4 * n}, at::kBFloat16));
  auto rs = at::empty({4}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  w.reduce_scatter(rs, ys[me]);
  auto sum = ys[0].to(at::kDouble);
  for (int r = 1; r < n; ++r) sum = sum + ys[r].to(at::kDouble);
  expect_same(rs, sum.narrow(0, 4 * me, 4).to(at::kBFloat16), "reduce_scatter");
  // Uneven all_to_all: r sends r + j + 1 rows to j.
  std::vector<int64_t> in_s, out_s;
  std::vector<at::Tensor> send, want;
  for (int j = 0; j < n; ++j) {
    in_s.push_back(me + j + 1);
    out_s.push_back(j + me + 1);
    send.push_back(at::full({me + j + 1, 2}, 10 * me + j,
                            at::TensorOptions().dtype(at::kLong).device(at::kCUDA)));
    want.push_back(at::full({j + me + 1, 2}, 10 * j + me, at::kLong));
  }
  auto in = at::cat(send, 0);
  auto got = at::empty({at::cat(want, 0).size(0), 2}, in.options());
  w.all_to_all(got, in, out_s, in_s);
  expect_same(got, at::cat(want, 0), "uneven all_to_all");
}

TEST(Nccl, BatchedRingAndAsync) {
  NEED_GPUS();
  auto& w = world();
  int n = w.size(), me = w.rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  int next = (me + 1) % n, prev = (me + n - 1) % n;
  auto a = at::full({1024}, me, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  auto ra = at::empty_like(a), rb = at::empty_like(a);
  w.batch_p2p(
      {P2POp::send(a, next), P2POp::send(a, prev), P2POp::recv(ra, prev), P2POp::recv(rb, next)});
  EXPECT_EQ(ra.cpu()[0].item<float>(), static_cast<float>(prev));
  EXPECT_EQ(rb.cpu()[0].item<float>(), static_cast<float>(next));
  std::vector<at::Tensor> xs;
  std::vector<Work> ws;
  for (int k = 0; k < 4; ++k) {
    xs.push_back(at::full({1 << 20}, k, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA)));
    ws.push_back(w.all_reduce(xs.back(), ReduceOp::Sum, true));
  }
  for (auto& x : ws) x.wait();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(xs[k].cpu()[7].item<float>(), static_cast<float>(k * n));
  // The Gloo world next to it moves CPU tensors.
  auto c = at::full({3}, me, at::kLong);
  world_cpu().all_reduce(c);
  EXPECT_EQ(c[0].item<int64_t>(), static_cast<int64_t>(n * (n - 1) / 2));
}

TEST(Nccl, MeshGroups) {
  NEED_GPUS();
  int n = world_size();
  if (n % 2) GTEST_SKIP() << "needs an even world";
  ProcessGroupMesh mesh({{Axis::DP, n / 2}, {Axis::TP, 2}});
  auto x = at::full({5}, rank(), at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  mesh.group(Axis::TP).all_reduce(x);
  int base = rank() / 2 * 2;
  EXPECT_EQ(x.cpu()[0].item<float>(), static_cast<float>(2 * base + 1));
  auto y = at::full({5}, rank(), at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  mesh.group(Axis::DP).all_reduce(y, ReduceOp::Max);
  EXPECT_EQ(y.cpu()[0].item<float>(), static_cast<float>(n - 2 + rank() % 2));
}

}  // namespace
}  // namespace colossal::dist
