// The accelerator on whatever this machine has: CPU always; CUDA only when a GPU is visible.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"

namespace colossal {
namespace {

TEST(Accelerator, CpuRngStateRoundTrip) {
  auto& cpu = Accelerator::cpu();
  cpu.manual_seed(1234);
  EXPECT_EQ(cpu.initial_seed(), 1234u);
  auto state = cpu.get_rng_state();
  auto a = at::randn({16});
  cpu.set_rng_state(state);
  auto b = at::randn({16});
  EXPECT_TRUE(at::equal(a, b));
  cpu.manual_seed(1234);
  EXPECT_TRUE(at::equal(at::randn({16}), a));
}

TEST(Accelerator, CpuBasics) {
  auto& cpu = Accelerator::cpu();
  EXPECT_STREQ(cpu.name(), "cpu");
  EXPECT_STREQ(cpu.communication_backend(), "gloo");
  EXPECT_TRUE(cpu.available());
  EXPECT_EQ(cpu.device(), c10::Device(c10::kCPU, 0));
  EXPECT_THROW(cpu.set_device(1), Error);
  cpu.synchronize();
  auto s = cpu.current_stream();
  EXPECT_EQ(s.device_type(), c10::DeviceType::CPU);
  auto e0 = cpu.new_event(true), e1 = cpu.new_event(true);
  e0->record();
  auto x = at::randn({256, 256});
  auto y = at::mm(x, x);
  e1->record();
  EXPECT_GE(e0->elapsed_ms(*e1), 0.0);
  EXPECT_TRUE(e1->query());
}

// RSS must grow by roughly what we touch: a 64 MiB tensor written once.
TEST(Accelerator, CpuMemoryStatsAreProcessRss) {
  auto& cpu = Accelerator::cpu();
  cpu.reset_peak_memory_stats();
  auto before = cpu.memory_stats();
  EXPECT_FALSE(before.exact);
  EXPECT_FALSE(before.note.empty());
  EXPECT_GT(before.allocated, 0);
  auto t = at::ones({16 * 1024 * 1024}, at::kFloat);
  auto after = cpu.memory_stats();
  EXPECT_GT(after.allocated - before.allocated, 48 << 20);
  EXPECT_GE(after.peak_allocated, after.allocated);
}

TEST(Accelerator, CudaWhenPresent) {
  auto& cuda = Accelerator::cuda();
  if (!cuda.available()) {
    EXPECT_EQ(&Accelerator::current(), &Accelerator::cpu());
    EXPECT_THROW(cuda.current_device(), Error);
    GTEST_SKIP() << "no CUDA device";
  }
  EXPECT_EQ(&Accelerator::current(), &cuda);
  cuda.set_device(0);
  cuda.reset_peak_memory_stats();
  auto before = cuda.memory_stats();
  auto t = at::empty({64 << 20}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  auto after = cuda.memory_stats();
  EXPECT_EQ(after.allocated - before.allocated, 64 << 20);
  EXPECT_GE(after.peak_allocated, after.allocated);
  cuda.manual_seed(7);
  auto st = cuda.get_rng_state();
  auto a = at::randn({8}, at::kCUDA);
  cuda.set_rng_state(st);
  EXPECT_TRUE(at::equal(a, at::randn({8}, at::kCUDA)));
  auto s = cuda.new_stream();
  auto e = cuda.new_event(true), f = cuda.new_event(true);
  e->record(s);
  f->record(s);
  f->synchronize();
  EXPECT_GE(e->elapsed_ms(*f), 0.0);
}

TEST(Accelerator, KernelRegistry) {
  register_cuda_kernel("zz_test_kernel");
  auto k = cuda_kernels();
  EXPECT_NE(std::find(k.begin(), k.end(), "zz_test_kernel"), k.end());
}

}  // namespace
}  // namespace colossal
