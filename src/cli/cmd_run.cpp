// `colossal run`: the launcher's flags (named and defaulted like ColossalAI's `colossalai run`,
// plus torchrun's --nnodes/--node_rank) parsed into LaunchOptions.
#include <climits>

#include "cli/args.h"
#include "cli/command.h"
#include "cli/launcher.h"
#include "colossal/core/error.h"

namespace colossal::cli {
namespace {

int to_int(const Args& a, const std::string& name) {
  int64_t v = a.i64(name);
  COLOSSAL_CHECK_INPUT(v >= INT_MIN && v <= INT_MAX, "option --", name, " value ", v,
                       " is out of range");
  return static_cast<int>(v);
}

int cmd_run(int argc, char** argv) {
  Args a("run",
         "Start N ranks of a command on this node, or on several hosts over ssh, with RANK,\n"
         "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set for each.\n"
         "Output lines are prefixed with the rank; if one rank fails, the others are stopped.\n"
         "Multi-node: run it on every node with --nnodes M --node_rank R --master_addr A, or\n"
         "once with --hostfile/--host (ssh; set COLOSSAL_SSH to use another ssh program).\n"
         "A node starts at most 4 x max(CPU cores, GPUs) ranks (--allow_oversubscribe for more).\n"
         "Rank 0 of a colossal program takes over the launcher's listening socket on\n"
         "--master_port, so two jobs cannot race for one port: the second is refused.");
  a.option("nproc_per_node", "ranks to start on each node", "", true)
      .option("nnodes", "number of nodes (default: 1, or every selected host)")
      .option("num_nodes", "same as --nnodes (ColossalAI's name)")
      .option("node_rank", "this node's index, 0..nnodes-1 (multi-node without ssh)")
      .option("host", "comma-separated hosts to start ranks on over ssh", "", false, "-H")
      .option("hostfile", "file with one host per line to start ranks on over ssh")
      .option("include", "only these hosts of the hostfile (host1,host2)")
      .option("exclude", "all hosts of the hostfile but these (host1,host2)")
      .option("master_addr", "address of the node running rank 0 (with hosts: the first host)",
              "127.0.0.1")
      .option("master_port", "rendezvous port on the master (0: a free one, single node)", "29500")
      .option("ssh_port", "ssh port of the hosts")
      .option("grace_period",
              "seconds between SIGTERM and SIGKILL when stopping ranks after a failure", "5")
      .option("save_grace_period",
              "seconds the ranks get after a forwarded SIGTERM/SIGUSR1/SIGINT (a preemption "
              "notice; `colossal train` saves a checkpoint first) before SIGKILL",
              "120")
      .option("rdzv_timeout",
              "seconds the ranks may take to meet (reach rank 0's store, all join) before they "
              "fail (default: COLOSSAL_RDZV_TIMEOUT_S, else 300)")
      .option("dist_timeout",
              "seconds a collective may wait for the other ranks before it fails (default: "
              "COLOSSAL_DIST_TIMEOUT_S, else 1800)")
      .flag("allow_oversubscribe",
            "start more than 4 x max(CPU cores, GPUs) ranks on a node (refused without it)")
      .flag("stop_on_stdin_eof",
            "stop when stdin closes (set on remote launchers by the ssh fan-out)")
      .rest("command", "the program each rank runs, and its arguments");
  a.parse(argc, argv);

  LaunchOptions o;
  o.nproc_per_node = to_int(a, "nproc_per_node");
  COLOSSAL_CHECK_INPUT(!(a.given("nnodes") && a.given("num_nodes")),
                       "--nnodes and --num_nodes are the same option; give one");
  if (a.given("nnodes")) o.nnodes = to_int(a, "nnodes");
  if (a.given("num_nodes")) {
    o.nnodes = to_int(a, "num_nodes");  // -1: ColossalAI's "all hosts"
    COLOSSAL_CHECK_INPUT(o.nnodes == -1 || o.nnodes >= 1, "--num_nodes ", o.nnodes,
                         " must be at least 1 (or -1 for all hosts)");
  }
  if (a.given("node_rank")) {
    o.node_rank = to_int(a, "node_rank");
    COLOSSAL_CHECK_INPUT(o.node_rank >= 0, "--node_rank ", o.node_rank, " must not be negative");
  }
  if (a.given("nnodes"))
    COLOSSAL_CHECK_INPUT(o.nnodes >= 1, "--nnodes ", o.nnodes, " must be at least 1");
  if (a.given("host")) o.host = a.str("host");
  if (a.given("hostfile")) o.hostfile = a.str("hostfile");
  if (a.given("include")) o.include = a.str("include");
  if (a.given("exclude")) o.exclude = a.str("exclude");
  o.master_addr = a.str("master_addr");
  o.master_addr_given = a.given("master_addr");
  o.master_port = to_int(a, "master_port");
  if (a.given("ssh_port")) o.ssh_port = to_int(a, "ssh_port");
  o.grace_period_s = a.f64("grace_period");
  o.save_grace_period_s = a.f64("save_grace_period");
  if (a.given("rdzv_timeout")) o.rdzv_timeout_s = a.f64("rdzv_timeout");
  if (a.given("dist_timeout")) o.dist_timeout_s = a.f64("dist_timeout");
  o.allow_oversubscribe = a.on("allow_oversubscribe");
  o.stop_on_stdin_eof = a.on("stop_on_stdin_eof");
  o.command = a.rest_args();
  return launch(std::move(o));
}

}  // namespace

COLOSSAL_COMMAND("run", "start N ranks of a command (torchrun style, or over ssh from a hostfile)",
                 cmd_run);

}  // namespace colossal::cli
