// Process-wide distributed state: launch values, the rendezvous store and the world groups.
#include "colossal/dist/runtime.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

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

using Clock = std::chrono::steady_clock;

// How often a rank still waiting in the rendezvous says so: often enough to see it is alive,
// rare enough not to bury the log (c10d's own retry warning came every 0.7 s).
constexpr auto kWaitMessageEvery = std::chrono::seconds(10);

std::string seconds_str(double s) {
  std::ostringstream os;
  os.precision(3);
  os << s << " s";
  return os.str();
}

// MASTER_ADDR resolved up front: a typo then fails at once with its name, not after the timeout.
// Temporary DNS failures (EAI_AGAIN) are retried by the caller until the rendezvous deadline.
struct Resolved {
  addrinfo* list = nullptr;
  int error = 0;
  ~Resolved() {
    if (list) ::freeaddrinfo(list);
  }
};

void resolve(const LaunchEnv& env, Resolved& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (out.list) ::freeaddrinfo(out.list);
  out.list = nullptr;
  std::string port = std::to_string(env.master_port);
  out.error = ::getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &out.list);
  if (out.error != 0 && out.error != EAI_AGAIN)
    throw InputError(str("MASTER_ADDR '", env.master_addr, "' (rank ", env.rank, " of ",
                         env.world_size, ", ", env.source,
                         " launch) cannot be resolved: ", ::gai_strerror(out.error),
                         "; give the address or host name of rank 0's host (colossal run "
                         "--master_addr)"));
}

// True when something accepts TCP connections at one of the resolved addresses. The probe
// connection is closed at once; the store's server takes that as a client that left.
bool can_connect(const Resolved& r, std::string& why) {
  for (addrinfo* a = r.list; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = ::poll(&p, 1, 1000) == 1 ? 0 : -1;
      int err = ETIMEDOUT;
      if (rc == 0) {
        socklen_t len = sizeof err;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
    int err = errno;
    ::close(fd);
    if (rc == 0) return true;
    why = std::strerror(err);
  }
  return false;
}

// A client rank waits here until rank 0's store listens, instead of in c10d's connect loop
// (which warns on every retry and waits the collective timeout).
void wait_for_store(const LaunchEnv& env, Clock::time_point deadline) {
  Resolved r;
  auto t0 = Clock::now(), next_message = t0 + kWaitMessageEvery;
  std::string why = "not resolved yet";
  while (true) {
    if (!r.list) resolve(env, r);
    if (r.list && can_connect(r, why)) return;
    if (!r.list) why = ::gai_strerror(r.error);
    auto now = Clock::now();
    if (now >= deadline)
      throw DistError(str("rendezvous timed out after ",
                          seconds_str(std::chrono::duration<double>(now - t0).count()), ": rank ",
                          env.rank, " of ", env.world_size, " found no store at ", env.master_addr,
                          ":", env.master_port, " (", why,
                          "); rank 0 hosts it: is rank 0 running, and are MASTER_ADDR/"
                          "MASTER_PORT right? (the limit is colossal run --rdzv_timeout / "
                          "COLOSSAL_RDZV_TIMEOUT_S)"));
    if (now >= next_message) {
      log_warn("dist: rank ", env.rank, " still waiting for rank 0's store at ", env.master_addr,
               ":", env.master_port, " (", why, "; ",
               seconds_str(std::chrono::duration<double>(deadline - now).count()),
               " left of the rendezvous timeout)");
      next_message = now + kWaitMessageEvery;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// Every rank counts itself in and waits for the others, saying every few seconds how many are
// there; rank 0's store would otherwise wait silently (and clients not at all).
//
// Two jobs on one port: `colossal run` gives each job an id (COLOSSAL_JOB_ID) that rank 0 puts
// in the store, and a rank of another job leaves before it counts itself in, so the job that
// owns the store never notices. Without ids, a rank whose own count exceeds the world is the
// one too many and fails; the ranks counted before it go on.
void wait_for_ranks(c10d::Store& store, const LaunchEnv& env, bool server,
                    Clock::time_point deadline) {
  const std::string job_key = "colossal/rdzv/job_id";
  if (server) {
    store.set(job_key, std::vector<uint8_t>(env.job_id.begin(), env.job_id.end()));
  } else if (!env.job_id.empty() && !env.agent_store) {
    auto v = store.get(job_key);  // rank 0 sets it first thing; waits up to the store timeout
    std::string theirs(v.begin(), v.end());
    if (!theirs.empty() && theirs != env.job_id)
      throw DistError(str("rendezvous at ", env.master_addr, ":", env.master_port, ": rank ",
                          env.rank, " reached the store of another job (job id ", theirs,
                          ", this rank's ", env.job_id,
                          "): two jobs use the same MASTER_ADDR/MASTER_PORT; give each its own "
                          "--master_port"));
  }
  const std::string key = "colossal/rdzv/joined";
  int64_t mine = store.add(key, 1);
  if (mine > env.world_size)
    throw DistError(str("rendezvous at ", env.master_addr, ":", env.master_port, ": rank ",
                        env.rank, " is rank number ", mine, " to join a world of ", env.world_size,
                        "; another job uses the same MASTER_ADDR/MASTER_PORT"));
  int64_t joined = mine;
  auto t0 = Clock::now(), next_message = t0 + kWaitMessageEvery;
  while (joined < env.world_size) {
    auto now = Clock::now();
    if (now >= deadline)
      throw DistError(str("rendezvous timed out after ",
                          seconds_str(std::chrono::duration<double>(now - t0).count()), ": only ",
                          joined, " of ", env.world_size, " ranks reached the store at ",
                          env.master_addr, ":", env.master_port, " (rank ", env.rank,
                          "); are all ranks started, with the same WORLD_SIZE? (the limit is "
                          "colossal run --rdzv_timeout / COLOSSAL_RDZV_TIMEOUT_S)"));
    if (now >= next_message) {
      log_warn("dist: rank ", env.rank, " waiting for the other ranks: ", joined, " of ",
               env.world_size, " joined (",
               seconds_str(std::chrono::duration<double>(deadline - now).count()),
               " left of the rendezvous timeout)");
      next_message = now + kWaitMessageEvery;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    joined = store.add(key, 0);
  }
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
    auto rdzv = std::chrono::milliseconds(static_cast<int64_t>(env.rdzv_timeout_s * 1000.0));
    auto deadline = Clock::now() + rdzv;
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0 && !env.agent_store;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.waitWorkers = false;  // wait_for_ranks below, with a deadline and progress messages
    so.timeout = rdzv;
    if (so.isServer) {
      Resolved r;
      resolve(env, r);  // rank 0 names a bad MASTER_ADDR too: the others would never find it
      if (env.store_fd >= 0) {
        struct stat st {};
        COLOSSAL_CHECK_INPUT(::fstat(env.store_fd, &st) == 0 && S_ISSOCK(st.st_mode),
                             "environment variable COLOSSAL_STORE_FD=", env.store_fd,
                             " is not an open socket (it is set by `colossal run` for rank 0; "
                             "unset it when starting ranks another way)");
        so.masterListenFd = env.store_fd;
        // Taken over: programs this rank starts must neither inherit the socket (it would keep
        // the port after this rank is gone) nor see the variable.
        ::fcntl(env.store_fd, F_SETFD, FD_CLOEXEC);
        ::unsetenv("COLOSSAL_STORE_FD");
      }
    } else {
      wait_for_store(env, deadline);
      so.timeout =
          std::max(std::chrono::milliseconds(1000),
                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    }
    try {
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
      wait_for_ranks(*store, env, so.isServer, deadline);
      store->setTimeout(timeout);  // from here on the store serves collectives' set-up
    } catch (const DistError&) {
      throw;
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
