// The only translation unit that includes ProcessGroupGloo.hpp: it needs Gloo's own headers
// (Debian's libgloo-dev or a carried copy), while the code that runs is the Gloo compiled into
// libtorch_cpu. Debian's libgloo is never linked.
#include "dist/backend_factory.h"

#include <cstdlib>

#include "colossal/core/error.h"
#include "colossal/core/logging.h"

#ifdef COLOSSAL_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace colossal::dist::detail {

bool gloo_compiled() {
#ifdef COLOSSAL_WITH_GLOO
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& group_name) {
#ifdef COLOSSAL_WITH_GLOO
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  // Same device choice as torch.distributed: an explicit interface, else this host's address.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  } catch (const std::exception& e) {
    throw DistError(str("creating the Gloo communicator for group '", group_name, "' (rank ", rank,
                        " of ", size, ") failed: ", e.what()));
  }
#else
  (void)store;
  (void)timeout;
  throw Error(str(
      "group '", group_name, "' (rank ", rank, " of ", size,
      "): this build has no CPU collectives (Gloo headers were not found at build time; install "
      "libgloo-dev or pass -DCOLOSSAL_GLOO_INCLUDE=... and rebuild)"));
#endif
}

}  // namespace colossal::dist::detail
