// The only translation unit that includes ProcessGroupNCCL.hpp (CUDA LibTorch + nccl.h).
#include "dist/backend_factory.h"

#include "colossal/core/error.h"

#include "colossal/dist/communicator.h"

#ifdef COLOSSAL_WITH_NCCL
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace colossal::dist::detail {

bool nccl_compiled() {
#ifdef COLOSSAL_WITH_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& group_name) {
#ifdef COLOSSAL_WITH_NCCL
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  // The watchdog enforces this timeout on every collective; it also names the group in its report.
  opts->timeout = timeout;
  opts->group_name = group_name;
  opts->group_desc = group_name;
  try {
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  } catch (const std::exception& e) {
    throw DistError(str("creating the NCCL communicator for group '", group_name, "' (rank ", rank,
                        " of ", size, ") failed: ", e.what()));
  }
#else
  (void)store;
  (void)timeout;
  throw Error(str("group '", group_name, "' (rank ", rank, " of ", size,
                  "): this build has no NCCL (it needs a CUDA LibTorch and nccl.h at build time)"));
#endif
}

}  // namespace colossal::dist::detail

namespace colossal::dist {

std::string nccl_version() {
#ifdef COLOSSAL_WITH_NCCL
  // LibTorch packs the NCCL it was built with as major << 32 | minor << 16 | patch.
  uint64_t v = torch::cuda::nccl::version();
  return std::to_string(v >> 32) + "." + std::to_string((v >> 16) & 0xffff) + "." +
         std::to_string(v & 0xffff);
#else
  return "";
#endif
}

}  // namespace colossal::dist
