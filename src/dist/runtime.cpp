// Process-wide distributed state: launch values, the rendezvous store and the world groups.
#include "colossal/dist/runtime.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "dist/communicator_impl.h"

namespace colossal::dist {
namespace {

struct State {
  bool initialized = false;
  LaunchEnv env;
  c10::intrusive_ptr<c10d::Store> store;
  Communicator world;
  Communicator world_cpu;
};

State& state() {
  static State s;
  return s;
}

State& initialized_state() {
  auto& s = state();
  COLOSSAL_CHECK(s.initialized,
                 "the distributed runtime is not initialised; call colossal::dist::init() first");
  return s;
}

Backend default_backend() {
  if (const char* v = std::getenv("COLOSSAL_DIST_BACKEND"); v && *v) {
    if (!std::strcmp(v, "gloo")) return Backend::Gloo;
    if (!std::strcmp(v, "nccl")) return Backend::Nccl;
    throw InputError(
        str("environment variable COLOSSAL_DIST_BACKEND='", v, "' must be gloo or nccl"));
  }
  if (backend_available(Backend::Nccl) && Accelerator::cuda().available()) return Backend::Nccl;
  return Backend::Gloo;
}

}  // namespace

void init(const InitOptions& options) {
  init(read_launch_env(), options);
}

void init(const LaunchEnv& env, const InitOptions& options) {
  auto& s = state();
  COLOSSAL_CHECK(!s.initialized,
                 "colossal::dist::init() was already called; call finalize() first");
  Backend kind = options.backend ? *options.backend : default_backend();
  COLOSSAL_CHECK_INPUT(backend_available(kind), "the ", to_string(kind),
                       " backend is not in this build (see `colossal check`); choose ",
                       kind == Backend::Nccl ? "gloo" : "nccl", " or rebuild with it");
  auto timeout = options.timeout ? *options.timeout : default_timeout();
  set_log_rank(env.world_size > 1 ? env.rank : -1);

  auto& cuda = Accelerator::cuda();
  int n_gpus = cuda.device_count();
  if (kind == Backend::Nccl) {
    COLOSSAL_CHECK_INPUT(env.local_rank < n_gpus, "local rank ", env.local_rank,
                         " has no CUDA device: this host shows ", n_gpus, " (start at most ",
                         n_gpus, " ranks per node, or check CUDA_VISIBLE_DEVICES)");
    cuda.set_device(env.local_rank);
  } else if (env.local_rank < n_gpus) {
    cuda.set_device(
        env.local_rank);  // Gloo world on a GPU host: CUDA tensors still go to this rank's GPU
  } else if (n_gpus > 0) {
    log_debug("dist: local rank ", env.local_rank, " has no GPU of its own (", n_gpus,
              " visible); the CUDA device is left as it is");
  }
  Accelerator::current().manual_seed(options.seed);
  Accelerator::cpu().manual_seed(options.seed);

  c10::intrusive_ptr<c10d::Store> store;
  if (env.world_size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0 && !env.agent_store;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.waitWorkers = true;
    so.timeout = timeout;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      std::string msg = dynamic_cast<const c10::Error*>(&e)
                            ? static_cast<const c10::Error&>(e).what_without_backtrace()
                            : e.what();
      throw DistError(str("rendezvous at ", env.master_addr, ":", env.master_port,
                          " failed for rank ", env.rank, " of ", env.world_size, " (", env.source,
                          " launch; rank 0 hosts the store): ", msg));
    }
  }
  std::vector<int> all(static_cast<size_t>(env.world_size));
  for (int i = 0; i < env.world_size; ++i) all[i] = i;
  s.world = make_communicator(store, kind, "world", all, env.rank, timeout, /*lazy=*/false);
  if (kind == Backend::Gloo) {
    s.world_cpu = s.world;
  } else if (options.cpu_world && backend_available(Backend::Gloo)) {
    s.world_cpu = make_communicator(store, Backend::Gloo, "world_cpu", all, env.rank, timeout,
                                    /*lazy=*/false);
  }
  s.env = env;
  s.store = store;
  s.initialized = true;
  log_debug("dist: rank ", env.rank, " of ", env.world_size, " (local ", env.local_rank, ") up on ",
            to_string(kind), " via ", env.source, ", seed ", options.seed);
}

bool is_initialized() {
  return state().initialized;
}

void finalize() {
  auto& s = state();
  if (!s.initialized) return;
  for (auto* c : {&s.world, &s.world_cpu}) {
    if (c->valid() && c->backend() == Backend::Nccl && c->impl().use_count() == 1 &&
        c->impl()->created()) {
      try {
        c->impl()->backend->shutdown();
      } catch (const std::exception& e) {
        log_warn("dist: shutting down group '", c->name(), "' failed: ", e.what());
      }
    }
  }
  s.world = Communicator();
  s.world_cpu = Communicator();
  s.store.reset();
  s.initialized = false;
}

const LaunchEnv& launch_env() {
  return initialized_state().env;
}
int rank() {
  return initialized_state().env.rank;
}
int world_size() {
  return initialized_state().env.world_size;
}
int local_rank() {
  return initialized_state().env.local_rank;
}
Communicator& world() {
  return initialized_state().world;
}
Communicator& world_cpu() {
  auto& s = initialized_state();
  COLOSSAL_CHECK(
      s.world_cpu.valid(),
      "no CPU world group: this build has no Gloo, or init() ran with cpu_world = false");
  return s.world_cpu;
}
Communicator new_group(const std::vector<int>& global_ranks, const std::string& name) {
  auto& s = initialized_state();
  for (int r : global_ranks)
    COLOSSAL_CHECK(r >= 0 && r < s.env.world_size, "group '", name, "' lists rank ", r,
                   " but the world has ", s.env.world_size, " ranks");
  return s.world.new_group(global_ranks, name);
}

}  // namespace colossal::dist
