// Launch-variable parsing: every launcher says the same four things (rank, world size, local
// rank, local world size) under its own names; the rendezvous address always comes from
// MASTER_ADDR/MASTER_PORT so all launchers meet the same TCPStore.
#include "colossal/dist/env.h"

#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "colossal/core/error.h"

namespace colossal::dist {
namespace {

// Strict: optional '-', then decimal digits, nothing else (no spaces, '+', hex or suffix), and
// within int: strtoll alone would take "4x" as 4, and a cast would wrap 4294967297 to 1.
std::optional<long long> get_int(const EnvLookup& env, const char* name, const char* source) {
  const char* v = env(name);
  if (!v) return std::nullopt;
  std::string s(v);
  COLOSSAL_CHECK_INPUT(!s.empty(), "environment variable ", name, " is set but empty (", source,
                       " launch); set it to an integer or unset it");
  size_t digits = s[0] == '-' ? 1 : 0;
  bool ok = s.size() > digits && s.find_first_not_of("0123456789", digits) == std::string::npos;
  COLOSSAL_CHECK_INPUT(ok, "environment variable ", name, "='", s, "' is not an integer (", source,
                       " launch)");
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(s.c_str(), &end, 10);
  COLOSSAL_CHECK_INPUT(errno == 0 && x >= INT_MIN && x <= INT_MAX, "environment variable ", name,
                       "='", s, "' is out of range (", source, " launch; at most ", INT_MAX, ")");
  return x;
}

long long need_int(const EnvLookup& env, const char* name, const char* source) {
  auto v = get_int(env, name, source);
  COLOSSAL_CHECK_INPUT(v.has_value(), "environment variable ", name, " is not set (", source,
                       " launch); the launcher must set it");
  return *v;
}

// SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE look like "4" or "4(x2)" or "4(x2),3".
std::optional<long long> slurm_tasks_per_node(const EnvLookup& env) {
  for (const char* name :
       {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"}) {
    const char* v = env(name);
    if (!v || !*v) continue;
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v, &end, 10);
    COLOSSAL_CHECK_INPUT(errno == 0 && end != v && x > 0 && x <= INT_MAX, "environment variable ",
                         name, "='", v, "' does not start with a positive task count");
    return x;
  }
  return std::nullopt;
}

}  // namespace

double parse_seconds_var(const char* name, const char* value) {
  std::string s(value);
  char* end = nullptr;
  errno = 0;
  double x = s.empty() || std::isspace(static_cast<unsigned char>(s[0]))
                 ? -1
                 : std::strtod(s.c_str(), &end);
  // The upper bound keeps milliseconds in int64 and the value meaningful (about 30 years).
  COLOSSAL_CHECK_INPUT(end && *end == '\0' && errno == 0 && std::isfinite(x) && x > 0 && x <= 1e9,
                       "environment variable ", name, "='", s,
                       "' is not a positive number of seconds");
  return x;
}

LaunchEnv parse_launch_env(const EnvLookup& env) {
  LaunchEnv e;
  const char* rank_var = nullptr;
  const char* world_var = nullptr;
  const char* local_rank_var = nullptr;
  const char* local_world_var = nullptr;
  if (env("RANK") || env("WORLD_SIZE")) {
    e.source = "torchrun";
    rank_var = "RANK";
    world_var = "WORLD_SIZE";
    e.rank = static_cast<int>(need_int(env, "RANK", "torchrun-style"));
    e.world_size = static_cast<int>(need_int(env, "WORLD_SIZE", "torchrun-style"));
    local_rank_var = "LOCAL_RANK";
    local_world_var = "LOCAL_WORLD_SIZE";
    auto lr = get_int(env, "LOCAL_RANK", "torchrun-style");
    COLOSSAL_CHECK_INPUT(lr.has_value() || e.world_size == 1,
                         "environment variable LOCAL_RANK is not set but WORLD_SIZE=", e.world_size,
                         " (torchrun-style launch); the launcher must set it");
    e.local_rank = static_cast<int>(lr.value_or(0));
    auto lw = get_int(env, "LOCAL_WORLD_SIZE", "torchrun-style");
    e.local_world_size = lw ? static_cast<int>(*lw) : (e.world_size == 1 ? 1 : -1);
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    e.source = "openmpi";
    rank_var = "OMPI_COMM_WORLD_RANK";
    world_var = "OMPI_COMM_WORLD_SIZE";
    local_rank_var = "OMPI_COMM_WORLD_LOCAL_RANK";
    local_world_var = "OMPI_COMM_WORLD_LOCAL_SIZE";
    e.rank = static_cast<int>(need_int(env, rank_var, "OpenMPI"));
    e.world_size = static_cast<int>(need_int(env, world_var, "OpenMPI"));
    e.local_rank = static_cast<int>(need_int(env, local_rank_var, "OpenMPI"));
    e.local_world_size = static_cast<int>(need_int(env, local_world_var, "OpenMPI"));
  } else if (env("SLURM_PROCID")) {
    e.source = "slurm";
    rank_var = "SLURM_PROCID";
    world_var = env("SLURM_NTASKS") ? "SLURM_NTASKS" : "SLURM_NPROCS";
    local_rank_var = "SLURM_LOCALID";
    local_world_var = "SLURM_NTASKS_PER_NODE";
    e.rank = static_cast<int>(need_int(env, rank_var, "SLURM"));
    e.world_size = static_cast<int>(need_int(env, world_var, "SLURM"));
    e.local_rank = static_cast<int>(need_int(env, local_rank_var, "SLURM"));
    auto tpn = slurm_tasks_per_node(env);
    e.local_world_size = tpn ? static_cast<int>(*tpn) : -1;
  } else {
    // A plain single process: no variables at all.
    e.source = "default";
  }

  if (rank_var) {
    COLOSSAL_CHECK_INPUT(e.world_size >= 1, "environment variable ", world_var, "=", e.world_size,
                         " must be at least 1");
    COLOSSAL_CHECK_INPUT(e.rank >= 0 && e.rank < e.world_size, "environment variable ", rank_var,
                         "=", e.rank, " is outside [0, ", world_var, "=", e.world_size, ")");
    COLOSSAL_CHECK_INPUT(e.local_rank >= 0, "environment variable ", local_rank_var, "=",
                         e.local_rank, " must not be negative");
    if (e.local_world_size != -1) {
      COLOSSAL_CHECK_INPUT(e.local_world_size >= 1 && e.local_world_size <= e.world_size,
                           "environment variable ", local_world_var, "=", e.local_world_size,
                           " must be in [1, ", world_var, "=", e.world_size, "]");
      COLOSSAL_CHECK_INPUT(e.local_rank < e.local_world_size, "environment variable ",
                           local_rank_var, "=", e.local_rank, " is outside [0, ", local_world_var,
                           "=", e.local_world_size, ")");
    } else {
      COLOSSAL_CHECK_INPUT(e.local_rank < e.world_size, "environment variable ", local_rank_var,
                           "=", e.local_rank, " is outside [0, ", world_var, "=", e.world_size,
                           ")");
    }
  }

  const char* addr = env("MASTER_ADDR");
  auto port = get_int(env, "MASTER_PORT", e.source.c_str());
  if (e.world_size > 1) {
    COLOSSAL_CHECK_INPUT(
        addr && *addr, "environment variable MASTER_ADDR is not set but the world has ",
        e.world_size, " ranks (", e.source,
        " launch); set it to the address of rank 0's host, e.g. MASTER_ADDR=127.0.0.1");
    COLOSSAL_CHECK_INPUT(
        port.has_value(), "environment variable MASTER_PORT is not set but the world has ",
        e.world_size, " ranks (", e.source, " launch); set it to a free TCP port on rank 0's host");
  }
  if (addr) e.master_addr = addr;
  if (const char* a = env("TORCHELASTIC_USE_AGENT_STORE")) {
    std::string v(a);
    COLOSSAL_CHECK_INPUT(
        v == "True" || v == "False" || v == "1" || v == "0" || v == "true" || v == "false",
        "environment variable TORCHELASTIC_USE_AGENT_STORE='", v, "' is not True or False");
    e.agent_store = v == "True" || v == "1" || v == "true";
  }
  if (port) {
    COLOSSAL_CHECK_INPUT(*port >= 1 && *port <= 65535, "environment variable MASTER_PORT=", *port,
                         " is not a TCP port (1..65535)");
    e.master_port = static_cast<int>(*port);
  }
  if (const char* t = env("COLOSSAL_RDZV_TIMEOUT_S"))
    e.rdzv_timeout_s = parse_seconds_var("COLOSSAL_RDZV_TIMEOUT_S", t);
  if (const char* id = env("COLOSSAL_JOB_ID")) {
    std::string v(id);
    bool ok = !v.empty() && v.size() <= 128 &&
              v.find_first_not_of(
                  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                  "-_.:") == std::string::npos;
    COLOSSAL_CHECK_INPUT(ok, "environment variable COLOSSAL_JOB_ID='", v,
                         "' must be 1 to 128 letters, digits or -_.:");
    e.job_id = v;
  }
  if (auto fd = get_int(env, "COLOSSAL_STORE_FD", e.source.c_str())) {
    COLOSSAL_CHECK_INPUT(*fd >= 3, "environment variable COLOSSAL_STORE_FD=", *fd,
                         " is not a socket descriptor (it is set by `colossal run`; unset it)");
    // Only rank 0 hosts the store; a descriptor leaking to another rank is a launcher bug, not
    // something to work around silently.
    COLOSSAL_CHECK_INPUT(
        e.rank == 0, "environment variable COLOSSAL_STORE_FD=", *fd, " is set for rank ", e.rank,
        ", but only rank 0 hosts the store (it is set by `colossal run`; unset it)");
    COLOSSAL_CHECK_INPUT(!e.agent_store,
                         "environment variables COLOSSAL_STORE_FD and "
                         "TORCHELASTIC_USE_AGENT_STORE are both set: the store is either rank "
                         "0's (colossal run) or torchrun's agent's; unset one");
    e.store_fd = static_cast<int>(*fd);
  }
  return e;
}

LaunchEnv read_launch_env() {
  return parse_launch_env([](const char* name) { return std::getenv(name); });
}

}  // namespace colossal::dist
