// `colossal run`: starts the ranks of a job on this node (torchrun style) or on a list of hosts
// over ssh (ColossalAI style), relays their output line by line with a rank prefix, and stops
// the whole job when one rank fails or the launcher is signalled. Plain POSIX (fork/exec, pipes,
// poll, signals): nothing here needs LibTorch.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace colossal::cli {

struct LaunchOptions {
  int nproc_per_node = 0;
  int nnodes = -1;     // -1: 1 on a single node, all selected hosts with --hostfile/--host
  int node_rank = -1;  // -1: not given (0 on a single node; assigned per host in fan-out)
  std::string hostfile;
  std::string host;  // comma-separated host names
  std::string include, exclude;
  std::string master_addr = "127.0.0.1";
  bool master_addr_given = false;
  int master_port = 29500;      // 0: pick a free port (single node only)
  int ssh_port = -1;            // -1: ssh's default
  double grace_period_s = 5.0;  // SIGTERM -> SIGKILL when stopping ranks after a failure
  // The launcher's own SIGTERM/SIGUSR1/SIGINT (a scheduler's preemption notice) -> SIGKILL: the
  // ranks of `colossal train` save a checkpoint at the next step boundary first, which takes
  // minutes at 7b, not the seconds a failed job needs to go away.
  double save_grace_period_s = 120.0;
  // Not given: the ranks use COLOSSAL_RDZV_TIMEOUT_S (else 300 s) and COLOSSAL_DIST_TIMEOUT_S
  // (else 30 min) from the environment.
  std::optional<double> rdzv_timeout_s, dist_timeout_s;
  bool allow_oversubscribe = false;  // skip the per-node rank limit (max_local_ranks())
  bool stop_on_stdin_eof = false;    // set by the fan-out on remote launchers
  std::vector<std::string> command;
};

// Hostfile: one host per line; blank lines and '#' comments are skipped. Throws InputError
// naming the file and line for anything else (two words on a line, odd characters, duplicates).
std::vector<std::string> parse_hostfile(const std::string& path);
// "h1,h2" -> {h1, h2}; throws InputError on empty names, odd characters or duplicates.
std::vector<std::string> parse_host_list(const std::string& list, const std::string& what);
// Applies --include/--exclude (comma-separated names that must be in `hosts`).
std::vector<std::string> filter_hosts(const std::vector<std::string>& hosts,
                                      const std::string& include, const std::string& exclude);

// The executable a command name resolves to (PATH search like execvp); throws InputError when
// it is missing or not executable.
std::string resolve_command(const std::string& name);
// POSIX shell single-quoting.
std::string shell_quote(const std::string& s);
// Binds and listens on `port` (0: a free one) on all interfaces, IPv6 and IPv4, and returns the
// close-on-exec socket; *bound_port gets the port. Listening, not only bound, is what keeps a
// second job's launcher (or store) off the port. Throws InputError when it is taken.
int listen_port(int port, int* bound_port);
// Ranks one node may start without --allow_oversubscribe: 4 x max(CPU cores this process may
// use, GPUs of the host). More ranks than that only thrash (or exhaust memory and pids).
int max_local_ranks();
// Whether the program at `path` reads COLOSSAL_STORE_FD (it links colossal's distributed
// runtime): only such a rank 0 is handed the listening socket; any other program binds
// MASTER_PORT itself and would find it taken.
bool program_adopts_store_fd(const std::string& path);
// getaddrinfo on `addr`; throws InputError naming `flag` when it does not resolve.
void check_master_addr(const std::string& addr, const std::string& flag);

// Runs the job; returns the launcher's exit code (0 when every rank exited 0).
int launch(LaunchOptions opts);

// ---- process supervision (launch_supervisor.cpp) --------------------------------------------

struct Worker {
  std::string label;              // "rank 3", "node 1 (host-a)": used in messages
  std::string path;               // executable
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> env;   // the full environment, "K=V"
  std::string prefix;             // put before each output line ("[rank 3] "), may be empty
  bool stdin_pipe = false;        // stdin is a pipe the launcher holds (closed to stop the worker)
  // A descriptor the worker inherits under the same number (rank 0's store socket); the
  // launcher's copy is closed once the worker is started. -1: none.
  int inherit_fd = -1;
};

struct SuperviseOptions {
  double grace_period_s = 5.0;
  double save_grace_period_s = 120.0;  // after a signal the launcher forwards
  bool stop_on_stdin_eof = false;
};

// Starts every worker in its own process group and relays its stdout/stderr line by line.
// When one exits non-zero or dies from a signal, or the launcher gets SIGINT/SIGTERM/SIGHUP/
// SIGUSR1, the others are stopped (the signal, or SIGTERM / stdin closed, then SIGKILL after the
// grace period: save_grace_period_s for a forwarded signal, grace_period_s otherwise). Returns 0,
// the first failing worker's exit code, or 128 + signal number. The summary names the worker that
// failed first by exit time, with the last line it wrote to stderr, and the cause of every other
// worker that failed.
int supervise(const std::vector<Worker>& workers, const SuperviseOptions& opts);

}  // namespace colossal::cli
