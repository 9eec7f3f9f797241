// The weight-update counter (colossal/core/weights_epoch.h).
#include "colossal/core/weights_epoch.h"

#include <atomic>

namespace colossal {

namespace {
std::atomic<uint64_t> epoch{0};
}  // namespace

uint64_t weights_epoch() {
  return epoch.load(std::memory_order_acquire);
}

void bump_weights_epoch() {
  epoch.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace colossal
