// The process-wide switch between the fused kernels and their ATen composites (fused.h).
#include <atomic>

#include "colossal/kernels/fused.h"

namespace colossal::kernels {
namespace {
std::atomic<bool> g_enabled{true};
}  // namespace

void set_enabled(bool on) { g_enabled.store(on); }
bool enabled() { return g_enabled.load(); }

}  // namespace colossal::kernels
