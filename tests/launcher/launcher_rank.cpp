// A rank for the launcher's tests that meets the others through colossal's own runtime (so rank
// 0 takes over the launcher's socket, COLOSSAL_STORE_FD): init, a barrier, optionally holds the
// job for argv[1] seconds, a closing barrier. Prints "rank R of W met" after the first barrier
// and "rank R of W ok" at the end.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"

int main(int argc, char** argv) {
  using namespace colossal;
  try {
    double hold_s = argc > 1 ? std::atof(argv[1]) : 0.0;
    dist::init(dist::InitOptions().with_backend(dist::Backend::Gloo));
    dist::world().barrier();
    std::printf("rank %d of %d met\n", dist::rank(), dist::world_size());
    std::fflush(stdout);
    if (hold_s > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(hold_s * 1000)));
    dist::world().barrier();
    std::printf("rank %d of %d ok\n", dist::rank(), dist::world_size());
    std::fflush(stdout);
    dist::finalize();
    return 0;
  } catch (const InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
