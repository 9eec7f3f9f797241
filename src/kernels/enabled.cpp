// The process-wide switch between the fused kernels and their ATen composites, and the device
// dispatch every op shares (kernels/enabled.h, op_common.h).
#include "colossal/kernels/enabled.h"

#include <atomic>

#include "colossal/core/accelerator.h"
#include "kernels/op_common.h"

namespace colossal::kernels {
namespace {
std::atomic<bool> g_enabled{true};
}  // namespace

void set_enabled(bool on) {
  g_enabled.store(on);
}
bool enabled() {
  return g_enabled.load();
}

namespace detail {
Path path_for(const at::Tensor& t) {
  if (t.device().is_cpu()) return Path::Cpu;
#ifdef COLOSSAL_WITH_CUDA
  if (t.device().is_cuda() && torch_has_cuda()) return Path::Cuda;
#endif
  return Path::Reference;
}
}  // namespace detail

bool has_fused_kernels(const at::Tensor& t) {
  return detail::path_for(t) != detail::Path::Reference;
}

}  // namespace colossal::kernels
