// How this process learns its place in the job: the launcher's environment variables
// (torchrun / `colossal run`, OpenMPI's mpirun, SLURM's srun), parsed strictly.
#pragma once

#include <functional>
#include <string>

namespace colossal::dist {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // -1 when the launcher did not say (e.g. SLURM without tasks per node)
  std::string master_addr;   // empty when world_size == 1 and none was given
  int master_port = 0;       // 0 when world_size == 1 and none was given
  // torchrun's agent already hosts the TCPStore on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE):
  // every rank then connects as a client, rank 0 included.
  bool agent_store = false;
  // How long meeting the other ranks may take (reaching rank 0's store, every rank joining)
  // before init() fails: COLOSSAL_RDZV_TIMEOUT_S (`colossal run --rdzv_timeout`), default 300 s.
  // Separate from the collective timeout (30 min) so a rendezvous that cannot succeed (rank 0
  // missing, a wrong address) ends in minutes.
  double rdzv_timeout_s = 300;
  // A bound, listening socket for rank 0's store, inherited from `colossal run`
  // (COLOSSAL_STORE_FD), so no other job can take the port between the launcher's check and the
  // store's bind; -1: rank 0 binds MASTER_PORT itself.
  int store_fd = -1;
  // Names the job (COLOSSAL_JOB_ID, set by `colossal run`): a rank that reaches the store of a
  // job with another id fails at once instead of joining it. Empty: not checked.
  std::string job_id;
  std::string source = "default";  // "torchrun", "openmpi", "slurm" or "default" (no variables)
};

// Looks a variable up; returns nullptr when unset.
using EnvLookup = std::function<const char*(const char*)>;

// Seconds from an environment variable: a finite positive decimal number, else InputError
// naming the variable.
double parse_seconds_var(const char* name, const char* value);

// Parses the launch variables. Order of precedence: RANK/WORLD_SIZE (torchrun, `colossal run`),
// then OMPI_COMM_WORLD_*, then SLURM_*; nothing at all means a single process. MASTER_ADDR and
// MASTER_PORT are needed whenever world_size > 1. Missing, malformed or inconsistent values
// throw InputError naming the variable.
LaunchEnv parse_launch_env(const EnvLookup& lookup);
// The same on this process's environment.
LaunchEnv read_launch_env();

}  // namespace colossal::dist
