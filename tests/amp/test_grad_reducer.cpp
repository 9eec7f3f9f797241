// The norm / overflow reducer composed over mesh axes, at world 4 as dp2 x tp2 over Gloo: a model
// of one tensor replicated over tp (a norm weight) and one split over tp (a column-parallel
// weight), each further sharded over dp as ZeRO does. The composed norm, with the replicated
// tensor counted on tp rank 0 only, equals the norm of the full model; counted everywhere it
// does not; an overflow on one rank is agreed on every rank only when the reducer spans both
// axes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "colossal/amp/grad_reducer.h"
#include "colossal/amp/grad_scaler.h"
#include "colossal/dist/parallel_dims.h"
#include "dist/dist_test_env.h"

namespace colossal::amp {
namespace {

struct Model {
  at::Tensor a, b;  // full gradients: a replicated over tp, b split over tp
};

Model full_grads() {
  at::manual_seed(3);  // the same on every rank
  return {at::randn({10}, at::kFloat), at::randn({12}, at::kFloat)};
}

double full_norm(const Model& m) {
  return std::sqrt(
      (m.a.to(at::kDouble).square().sum() + m.b.to(at::kDouble).square().sum()).item<double>());
}

// This rank's dp shard of its local (tp) part of each tensor.
std::vector<at::Tensor> shards(const Model& m, int dp_rank, int tp_rank) {
  at::Tensor a_local = m.a;                            // replicated over tp
  at::Tensor b_local = m.b.narrow(0, 6 * tp_rank, 6);  // split over tp
  return {a_local.narrow(0, 5 * dp_rank, 5).clone(), b_local.narrow(0, 3 * dp_rank, 3).clone()};
}

dist::ParallelDegrees dp2_tp2() {
  dist::ParallelDegrees d;
  d.dp = 2;
  d.tp = 2;
  return d;
}

TEST(GradReducer, ComposedNormCountsReplicatedTensorsOnce) {
  ASSERT_EQ(dist::world_size(), 4);
  dist::ParallelDims pd(dp2_tp2());
  const at::Device cpu(at::kCPU);
  GradReducer r = compose({over(pd.dp(), cpu, "dp"), over(pd.tp(), cpu, "tp")});
  ASSERT_EQ(r.axes.size(), 2u);
  EXPECT_EQ(r.axes[0].name, "dp");
  EXPECT_EQ(r.axes[1].size, 2);
  const Model m = full_grads();
  const auto s = shards(m, pd.dp().rank(), pd.tp().rank());
  EXPECT_EQ(r.counts({"tp"}), pd.tp().rank() == 0);
  EXPECT_TRUE(r.counts({}));
  EXPECT_TRUE(r.counts({"pp"}));  // an axis the reducer does not span replicates nothing here

  std::vector<at::Tensor> counted = {s[1]};
  if (r.counts({"tp"})) counted.push_back(s[0]);
  const double want = full_norm(m);
  EXPECT_NEAR(global_grad_norm(counted, 2.0, r), want / 2.0, 1e-12 * want);
  auto clip = unscale_and_clip(counted, 1.0, 0.0, r, /*apply=*/false);
  EXPECT_FALSE(clip.overflow);
  EXPECT_NEAR(clip.norm, want, 1e-12 * want);

  // The same from the ParallelDims helper (dp x sp, tp, pp; pp has one rank here).
  GradReducer whole = over_parallel_dims(pd, cpu);
  ASSERT_EQ(whole.axes.size(), 3u);
  EXPECT_EQ(whole.axes[1].name, "tp");
  EXPECT_EQ(whole.counts({"tp"}), r.counts({"tp"}));
  EXPECT_NEAR(global_grad_norm(counted, 1.0, whole), want, 1e-12 * want);

  // Counting the replicated tensor on both tp ranks overstates the norm.
  const double twice = global_grad_norm({s[0], s[1]}, 1.0, r);
  const double a2 = m.a.to(at::kDouble).square().sum().item<double>();
  EXPECT_NEAR(twice * twice, want * want + a2, 1e-9 * want * want);
  EXPECT_GT(twice, want * (1 + 1e-6));

  // Over dp only (today's default), the sum misses the other tp rank's half of b.
  GradReducer dp_only = over(pd.dp(), cpu, "dp");
  const double partial = global_grad_norm(counted, 1.0, dp_only);
  EXPECT_LT(partial, want * (1 - 1e-6));
}

TEST(GradReducer, OverflowOnOneRankIsAgreedOverEveryAxis) {
  dist::ParallelDims pd(dp2_tp2());
  const at::Device cpu(at::kCPU);
  GradReducer r = compose({over(pd.dp(), cpu, "dp"), over(pd.tp(), cpu, "tp")});
  GradReducer dp_only = over(pd.dp(), cpu, "dp");
  std::vector<at::Tensor> g = {at::ones({4})};
  if (dist::rank() == 3) g[0][1] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(grads_overflow(g, r));
  EXPECT_TRUE(unscale_and_clip(g, 1.0, 1.0, r, /*apply=*/false).overflow);
  EXPECT_FALSE(std::isfinite(global_grad_norm(g, 1.0, r)));
  // Rank 3's dp group is {1, 3}: ranks 0 and 2 would not see its overflow over dp alone.
  EXPECT_EQ(grads_overflow(g, dp_only), dist::rank() == 1 || dist::rank() == 3);
}

TEST(GradReducer, OneRankAxesAddNoCollective) {
  dist::ParallelDims pd(dp2_tp2());
  GradReducer r = compose({over(pd.dp(), at::Device(at::kCPU), "dp"),
                           over(pd.pp(), at::Device(at::kCPU), "pp"), over({}, at::kCPU, "sp")});
  EXPECT_EQ(r.axes.size(), 3u);
  at::Tensor t = at::full({1}, 1.0, at::kDouble);
  r.all_reduce_sum(t);
  EXPECT_EQ(t.item<double>(), 2.0);  // dp only: pp and sp have one rank
  GradReducer none = compose({over(pd.pp(), at::Device(at::kCPU), "pp")});
  EXPECT_FALSE(none.all_reduce_sum);
  EXPECT_FALSE(none.all_reduce_max);
}

}  // namespace
}  // namespace colossal::amp
