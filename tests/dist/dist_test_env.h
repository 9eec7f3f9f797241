// Shared by the multi-rank tests: every rank initialises the runtime (Gloo, CPU) from the
// launcher's variables before the tests and finalises after a closing barrier.
#pragma once

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "colossal/dist/runtime.h"

namespace colossal::dist::testing {

class DistEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { init(InitOptions().with_backend(Backend::Gloo)); }
  void TearDown() override {
    world().barrier();
    finalize();
  }
};

inline const bool dist_env_registered [[maybe_unused]] =
    (::testing::AddGlobalTestEnvironment(new DistEnvironment), true);

// Deterministic small integer values in [-8, 8] for (rank, salt): every rank can compute every
// other rank's input, and sums of a few of them are exact in bf16/fp16.
inline at::Tensor rank_input(int rank, int salt, at::IntArrayRef shape, at::ScalarType dtype) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 * salt + rank + 1));
  auto x = at::randint(-8, 9, shape, gen, at::TensorOptions().dtype(at::kLong));
  return x.to(dtype);
}

}  // namespace colossal::dist::testing
