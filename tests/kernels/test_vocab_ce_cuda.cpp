// The split-softmax kernels of the vocab-parallel cross-entropy (softmax_row_stats_,
// softmax_grad_given_lse_) on CUDA: against their ATen references on the GPU and the CPU, for
// the 16-byte and the scalar kernel variants, and a vocabulary split in parts (as over tp
// ranks, on one GPU) against the whole row's cross_entropy_grad_reference_. Skipped without a
// visible GPU (this machine's CI).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/fused.h"
#include "kernels/numerics.h"

using namespace colossal;
namespace K = colossal::kernels;
using namespace colossal::test;

namespace {

bool have_gpu() {
  return Accelerator::cuda().available();
}
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible"

at::Device gpu() {
  return at::Device(at::kCUDA, 0);
}

}  // namespace

TEST(CudaVocabCE, KernelsEqualTheirReferences) {
  REQUIRE_GPU();
  for (auto dt : kTypes) {
    for (int64_t V : {int64_t(4096), int64_t(1001)}) {  // 16-byte packs, and the scalar kernel
      const std::string what = std::string(c10::toString(dt)) + " V " + std::to_string(V);
      at::manual_seed(21);
      const int64_t n = 37;
      at::Tensor x0 = (at::randn({n, V}) * 4).to(dt);
      at::Tensor stats = K::softmax_row_stats_(x0.to(gpu()));
      at::Tensor ref = K::softmax_row_stats_reference_(x0.to(gpu()));
      ASSERT_EQ(stats.sizes(), (std::vector<int64_t>{n, 2})) << what;
      EXPECT_TRUE(at::equal(stats.select(1, 0), ref.select(1, 0))) << what;  // max is exact
      EXPECT_LE(max_abs(stats - ref), 1e-5 * max_abs(ref)) << what;
      EXPECT_LE(max_abs(stats.cpu() - K::softmax_row_stats_(x0)), 1e-5 * max_abs(ref)) << what;
      // Targets: local columns, some held elsewhere (-1 or >= V), some rows ignored (scale 0).
      at::Tensor t = at::randint(0, V, {n}, at::kLong);
      t.narrow(0, 0, 5).fill_(-1);
      t.narrow(0, 5, 3).fill_(V + 7);
      at::Tensor scale = at::rand({n});
      scale.narrow(0, 10, 4).zero_();
      at::Tensor lse = ref.select(1, 0) + ref.select(1, 1).log();
      at::Tensor x = x0.to(gpu()), xr = x0.to(gpu()), xc = x0.clone();
      K::softmax_grad_given_lse_(x, t.to(gpu()), lse.contiguous(), scale.to(gpu()));
      K::softmax_grad_given_lse_reference_(xr, t.to(gpu()), lse.contiguous(), scale.to(gpu()));
      K::softmax_grad_given_lse_(xc, t, lse.cpu().contiguous(), scale);
      ASSERT_TRUE(at::isfinite(x).all().item<bool>()) << what;
      const double tol = dt == at::kFloat ? 1e-5 : ulp(dt);
      EXPECT_LE(max_abs(x.to(at::kFloat) - xr.to(at::kFloat)),
                tol * max_abs(xr.to(at::kFloat)) + 1e-12)
          << what;
      EXPECT_LE(max_abs(x.cpu().to(at::kFloat) - xc.to(at::kFloat)),
                tol * max_abs(xc.to(at::kFloat)) + 1e-12)
          << what;
    }
  }
}

// Split a row in parts as ranks hold it: the combined statistics give the whole row's loss and
// each part's gradient is its slice of the whole row's.
TEST(CudaVocabCE, SplitRowsEqualTheWholeRow) {
  REQUIRE_GPU();
  const int64_t n = 19, V = 3001;
  at::manual_seed(22);
  at::Tensor x0 = (at::randn({n, V}) * 4).to(gpu());
  at::Tensor t = at::randint(0, V, {n}, at::kLong).to(gpu());
  at::Tensor whole = x0.clone();
  at::Tensor loss = K::cross_entropy_grad_reference_(whole, t, -100, at::Tensor());
  const std::vector<int64_t> bounds = {0, 1024, 2048, V};
  at::Tensor m = at::full({n}, -INFINITY, x0.options());
  std::vector<at::Tensor> stats;
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    stats.push_back(
        K::softmax_row_stats_(x0.narrow(1, bounds[p], bounds[p + 1] - bounds[p]).contiguous()));
    m = at::maximum(m, stats.back().select(1, 0));
  }
  at::Tensor sum = at::zeros({n}, x0.options());
  for (auto& s : stats) sum += s.select(1, 1) * (s.select(1, 0) - m).exp();
  at::Tensor lse = (m + sum.log()).contiguous();
  at::Tensor target_logit = x0.gather(1, t.unsqueeze(1)).squeeze(1);
  EXPECT_LE(max_abs(lse - target_logit - loss), 1e-5 * max_abs(loss));
  at::Tensor ones = at::ones({n}, x0.options());
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    const int64_t b = bounds[p], len = bounds[p + 1] - b;
    at::Tensor part = x0.narrow(1, b, len).contiguous();
    at::Tensor local = at::where((t >= b) & (t < b + len), t - b, -1);
    K::softmax_grad_given_lse_(part, local, lse, ones);
    EXPECT_LE(max_abs(part - whole.narrow(1, b, len)), 1e-5 * max_abs(whole)) << "part " << p;
  }
}
