// The distributed runtime of one process: init() reads the launcher's variables (see env.h),
// meets the other ranks through a c10d::TCPStore hosted by rank 0, builds the world
// Communicator, sets this rank's CUDA device and seeds the RNGs; finalize() tears it down.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "colossal/dist/communicator.h"
#include "colossal/dist/env.h"

namespace colossal::dist {

struct InitOptions {
  // Same seed on every rank (ColossalAI's default); call Accelerator::manual_seed again to differ.
  uint64_t seed = 1024;
  // Engine of world(): by default NCCL when this build has it and a CUDA device is present,
  // else Gloo. COLOSSAL_DIST_BACKEND=gloo|nccl overrides the default (not an explicit choice).
  std::optional<Backend> backend;
  // Collective and rendezvous timeout; default: default_timeout() (30 min or
  // COLOSSAL_DIST_TIMEOUT_S).
  std::optional<std::chrono::milliseconds> timeout;
  // When world() is NCCL, also build a Gloo world for CPU tensors (world_cpu()).
  bool cpu_world = true;

  InitOptions& with_seed(uint64_t s) {
    seed = s;
    return *this;
  }
  InitOptions& with_backend(Backend b) {
    backend = b;
    return *this;
  }
  InitOptions& with_timeout(std::chrono::milliseconds t) {
    timeout = t;
    return *this;
  }
};

// Initialises from this process's environment. Throws InputError for bad variables and
// DistError when the rendezvous fails. Calling it twice without finalize() is an error.
void init(const InitOptions& options = {});
// The same with explicit launch values (tests, embedding programs).
void init(const LaunchEnv& env, const InitOptions& options = {});
bool is_initialized();
// Drops every communicator and the store. Safe to call when not initialised.
void finalize();

const LaunchEnv& launch_env();
int rank();
int world_size();
int local_rank();
// All ranks; its engine is InitOptions::backend.
Communicator& world();
// All ranks over Gloo (CPU tensors): world() itself when that is Gloo.
Communicator& world_cpu();
// world().new_group(ranks, name): only members need to call it.
Communicator new_group(const std::vector<int>& global_ranks, const std::string& name);

// Runs finalize() on scope exit, e.g. `dist::Session s;` at the top of main.
struct Session {
  explicit Session(const InitOptions& options = {}) { init(options); }
  ~Session() { finalize(); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

}  // namespace colossal::dist
