// `colossal run`: flag validation, host lists, port and command checks, and the two ways of
// starting a job: ranks on this node, or one `colossal run` per host over ssh (fan-out).
#include "cli/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <string_view>

#include "colossal/core/error.h"
#include "colossal/core/logging.h"

extern char** environ;

namespace colossal::cli {
namespace {

bool valid_host(const std::string& h) {
  if (h.empty()) return false;
  for (char c : h) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '-' || c == '_' || c == ':' || c == '@' || c == '[' || c == ']';
    if (!ok) return false;
  }
  return h[0] != '-';  // would read as an ssh option
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(cur);
  return out;
}

// The variables `colossal run` sets for each rank; never inherited or forwarded.
const std::set<std::string>& rank_vars() {
  static const std::set<std::string> v = {
      "RANK",        "WORLD_SIZE",      "LOCAL_RANK", "LOCAL_WORLD_SIZE",
      "MASTER_ADDR", "MASTER_PORT",     "GROUP_RANK", "GROUP_WORLD_SIZE",
      "ROLE_RANK",   "ROLE_WORLD_SIZE", "ROLE_NAME"};
  return v;
}

std::string env_name(const char* kv) {
  const char* eq = std::strchr(kv, '=');
  return eq ? std::string(kv, eq - kv) : std::string(kv);
}

bool identifier(const std::string& n) {
  if (n.empty() || (n[0] >= '0' && n[0] <= '9')) return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
      return false;
  return true;
}

// The local environment a remote launcher gets, like ColossalAI (everything with a one-line
// value) minus what describes this machine or this login session rather than the job.
std::vector<std::string> forwarded_env() {
  static const std::set<std::string> skip = {
      "HOSTNAME",           "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "TERM", "COLOSSAL_SSH",
      "COLOSSAL_REMOTE_BIN"};
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    std::string name = env_name(*e);
    std::string value = kv.size() > name.size() ? kv.substr(name.size() + 1) : "";
    if (!identifier(name) || value.empty() || value.find('\n') != std::string::npos) continue;
    if (skip.count(name) || rank_vars().count(name) || name.rfind("SSH_", 0) == 0) continue;
    out.push_back(kv);
  }
  return out;
}

std::string self_exe() {
  if (const char* b = std::getenv("COLOSSAL_REMOTE_BIN"); b && *b) return b;
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  COLOSSAL_CHECK(n > 0, "colossal run: cannot find its own executable (/proc/self/exe): ",
                 std::strerror(errno), "; set COLOSSAL_REMOTE_BIN");
  return std::string(buf, static_cast<size_t>(n));
}

std::string current_dir() {
  char buf[PATH_MAX];
  COLOSSAL_CHECK(::getcwd(buf, sizeof buf) != nullptr,
                 "colossal run: cannot read the current directory: ", std::strerror(errno));
  return buf;
}

// A new job's COLOSSAL_JOB_ID: ranks check it at the rendezvous (src/dist/runtime.cpp).
std::string new_job_id() {
  unsigned char b[8] = {};
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? ::read(fd, b, sizeof b) : -1;
  if (fd >= 0) ::close(fd);
  std::ostringstream os;
  os << std::hex;
  if (n == static_cast<ssize_t>(sizeof b)) {
    for (unsigned char c : b) os << (c >> 4) << (c & 15);
  } else {  // no /dev/urandom: unique enough on this host
    os << ::getpid() << "-" << ::time(nullptr);
  }
  return os.str();
}

std::string fmt_seconds(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace

std::vector<std::string> parse_hostfile(const std::string& path) {
  struct stat st {};
  COLOSSAL_CHECK_INPUT(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), "hostfile '", path,
                       "' not found (or not a regular file)");
  std::ifstream in(path);
  COLOSSAL_CHECK_INPUT(in.good(), "cannot read hostfile '", path, "': ", std::strerror(errno));
  std::vector<std::string> hosts;
  std::set<std::string> seen;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::string h = trim(line);
    if (h.empty()) continue;
    COLOSSAL_CHECK_INPUT(h.find_first_of(" \t") == std::string::npos, "hostfile '", path, "' line ",
                         lineno, ": expected one host name per line, got '", h, "'");
    COLOSSAL_CHECK_INPUT(valid_host(h), "hostfile '", path, "' line ", lineno, ": '", h,
                         "' is not a host name");
    COLOSSAL_CHECK_INPUT(seen.insert(h).second, "hostfile '", path, "' line ", lineno, ": host '",
                         h, "' is listed twice");
    hosts.push_back(h);
  }
  COLOSSAL_CHECK_INPUT(!hosts.empty(), "hostfile '", path, "' lists no hosts");
  return hosts;
}

std::vector<std::string> parse_host_list(const std::string& list, const std::string& what) {
  std::vector<std::string> hosts;
  std::set<std::string> seen;
  for (const auto& raw : split(list, ',')) {
    std::string h = trim(raw);
    COLOSSAL_CHECK_INPUT(valid_host(h), what, " '", list, "': '", h,
                         "' is not a host name (expected host1,host2,...)");
    COLOSSAL_CHECK_INPUT(seen.insert(h).second, what, " '", list, "': host '", h,
                         "' is listed twice");
    hosts.push_back(h);
  }
  return hosts;
}

std::vector<std::string> filter_hosts(const std::vector<std::string>& hosts,
                                      const std::string& include, const std::string& exclude) {
  COLOSSAL_CHECK_INPUT(include.empty() || exclude.empty(),
                       "--include and --exclude are mutually exclusive; give only one");
  if (include.empty() && exclude.empty()) return hosts;
  bool inc = !include.empty();
  auto names = parse_host_list(inc ? include : exclude, inc ? "--include" : "--exclude");
  std::set<std::string> known(hosts.begin(), hosts.end());
  for (const auto& n : names)
    COLOSSAL_CHECK_INPUT(known.count(n), inc ? "--include" : "--exclude", ": host '", n,
                         "' is not in the hostfile");
  std::vector<std::string> out;
  if (inc) return names;  // in the order given, like ColossalAI
  std::set<std::string> drop(names.begin(), names.end());
  for (const auto& h : hosts)
    if (!drop.count(h)) out.push_back(h);
  COLOSSAL_CHECK_INPUT(!out.empty(), "--exclude '", exclude, "' leaves no hosts to run on");
  return out;
}

std::string resolve_command(const std::string& name) {
  COLOSSAL_CHECK_INPUT(!name.empty(), "the command to run is an empty string");
  auto check = [](const std::string& p, bool explicit_path) -> bool {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) {
      COLOSSAL_CHECK_INPUT(!explicit_path, "command '", p, "' not found: ", std::strerror(errno));
      return false;
    }
    if (S_ISDIR(st.st_mode)) {
      COLOSSAL_CHECK_INPUT(!explicit_path, "command '", p, "' is a directory, not a program");
      return false;
    }
    if (::access(p.c_str(), X_OK) != 0) {
      COLOSSAL_CHECK_INPUT(!explicit_path, "command '", p,
                           "' is not executable (chmod +x it, or run it through its "
                           "interpreter, e.g. python ",
                           p, ")");
      return false;
    }
    return true;
  };
  if (name.find('/') != std::string::npos) {
    check(name, true);
    return name;
  }
  const char* path_env = std::getenv("PATH");
  std::string path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  for (const auto& dir : split(path, ':')) {
    std::string cand = (dir.empty() ? "." : dir) + "/" + name;
    if (check(cand, false)) return cand;
  }
  throw InputError(
      str("command '", name, "' not found in PATH (", path, "); give its full path or fix PATH"));
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-./=:,+@%") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out.push_back(c);
  }
  out += "'";
  return out;
}

int listen_port(int port, int* bound_port) {
  COLOSSAL_CHECK_INPUT(port >= 0 && port <= 65535, "--master_port ", port,
                       " is not a port number (0..65535; 0 picks a free one)");
  auto fail = [&](int err) -> int {
    if (err == EADDRINUSE)
      throw InputError(str("--master_port ", port,
                           " is already in use on this node (another job's store?); pick another "
                           "port, or --master_port 0 for a free one (single node)"));
    if (err == EACCES)
      throw InputError(str("--master_port ", port,
                           " needs privileges to bind (ports below 1024); pick a port above 1024"));
    throw InputError(str("--master_port ", port, " cannot be bound: ", std::strerror(err)));
  };
  // One dual-stack IPv6 socket covers IPv4 too, like the store's own bind; IPv4 alone where the
  // host has no IPv6.
  for (int family : {AF_INET6, AF_INET}) {
    int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      if (errno == EAFNOSUPPORT && family == AF_INET6) continue;
      fail(errno);
    }
    int one = 1, zero = 0;
    // SO_REUSEADDR lets a port in TIME_WAIT from the previous job be bound; two binds of the
    // same port then both succeed, but only one listen() does (the other gets EADDRINUSE).
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (family == AF_INET6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc == 0) rc = ::listen(fd, 1024);
    if (rc != 0) {
      int err = errno;
      ::close(fd);
      if (family == AF_INET6 && (err == EADDRNOTAVAIL || err == EAFNOSUPPORT)) continue;
      fail(err);
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
    *bound_port = family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
                                    : ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    return fd;
  }
  throw Error("colossal run: this host has neither IPv6 nor IPv4 sockets");
}

int max_local_ranks() {
  int cores = 0;
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  int gpus = 0;
  // The driver lists every GPU of the host here; no CUDA runtime needed in the launcher.
  if (DIR* d = ::opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++gpus;
    ::closedir(d);
  }
  return 4 * std::max({cores, gpus, 1});
}

bool program_adopts_store_fd(const std::string& path) {
  // The variable's name is in the read-only data of every program linking colossal's
  // distributed runtime (src/dist/env.cpp), and in no interpreter or shell script that does not
  // mention it. Read in pieces; a name split across two pieces is caught by the overlap.
  static constexpr std::string_view kMarker = "COLOSSAL_STORE_FD";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string buf;
  std::vector<char> chunk(1 << 20);
  bool found = false;
  while (!found) {
    ssize_t n = ::read(fd, chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buf.append(chunk.data(), static_cast<size_t>(n));
    found = buf.find(kMarker) != std::string::npos;
    buf.erase(0, buf.size() > kMarker.size() ? buf.size() - kMarker.size() : 0);
  }
  ::close(fd);
  return found;
}

void check_master_addr(const std::string& addr, const std::string& flag) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(addr.c_str(), nullptr, &hints, &res);
  if (res) ::freeaddrinfo(res);
  // EAI_AGAIN (DNS not answering now) is left to the ranks, which retry until the rendezvous
  // timeout; a name that does not exist is refused before anything starts.
  COLOSSAL_CHECK_INPUT(rc == 0 || rc == EAI_AGAIN, flag, " '", addr,
                       "' cannot be resolved: ", ::gai_strerror(rc),
                       "; give the address or host name of the node that runs rank 0");
}

namespace {

int launch_local(const LaunchOptions& o) {
  int nnodes = o.nnodes < 0 ? 1 : o.nnodes;
  int node_rank = o.node_rank < 0 ? 0 : o.node_rank;
  COLOSSAL_CHECK_INPUT(nnodes >= 1, "--nnodes ", nnodes, " must be at least 1");
  COLOSSAL_CHECK_INPUT(node_rank < nnodes, "--node_rank ", node_rank, " must be below --nnodes ",
                       nnodes, " (node ranks are 0..", nnodes - 1, ")");
  COLOSSAL_CHECK_INPUT(o.master_port != 0 || nnodes == 1,
                       "--master_port 0 (a free port) works on a single node only; with --nnodes ",
                       nnodes, " give every node the same --master_port");
  COLOSSAL_CHECK_INPUT(o.ssh_port < 0, "--ssh_port needs --hostfile or --host");
  std::string path = resolve_command(o.command[0]);
  // Products in 64 bits: --nnodes 2147483647 must not wrap WORLD_SIZE into a small number.
  int64_t world64 = static_cast<int64_t>(o.nproc_per_node) * nnodes;
  COLOSSAL_CHECK_INPUT(world64 <= INT_MAX, "--nproc_per_node ", o.nproc_per_node, " x --nnodes ",
                       nnodes, " = ", world64, " ranks is more than a job can have (", INT_MAX,
                       ")");
  int world = static_cast<int>(world64);
  check_master_addr(o.master_addr, "--master_addr");
  int port = o.master_port;
  int store_fd = -1;
  if (node_rank == 0) {
    // The launcher binds the port and keeps listening on it until rank 0's store takes the
    // socket over (COLOSSAL_STORE_FD): no other job can slip in between a check and the
    // store's own bind. A program that cannot take it over binds the port itself, so for it
    // the socket is closed right before the ranks start (the check it always was).
    store_fd = listen_port(o.master_port, &port);
    if (!program_adopts_store_fd(path)) {
      log_debug("colossal run: ", path, " does not read COLOSSAL_STORE_FD; port ", port,
                " is released for rank 0 to bind");
      ::close(store_fd);
      store_fd = -1;
    }
  }
  std::vector<std::string> base;
  bool has_omp = false, has_unbuffered = false, has_tty = false, has_job_id = false;
  for (char** e = environ; *e; ++e) {
    std::string name = env_name(*e);
    if (rank_vars().count(name)) continue;
    has_omp |= name == "OMP_NUM_THREADS";
    has_unbuffered |= name == "PYTHONUNBUFFERED";
    has_tty |= name == "COLOSSAL_TTY";
    has_job_id |= name == "COLOSSAL_JOB_ID";
    if (name == "COLOSSAL_STORE_FD") continue;  // ours, for rank 0 only
    if (name == "COLOSSAL_RDZV_TIMEOUT_S" && o.rdzv_timeout_s) continue;
    if (name == "COLOSSAL_DIST_TIMEOUT_S" && o.dist_timeout_s) continue;
    base.push_back(*e);
  }
  // The ranks' stderr is a pipe; tell them whether the person watching has a terminal, so rank
  // 0 can draw a progress bar ('\r' lines are relayed as such).
  if (!has_tty) base.push_back(::isatty(STDERR_FILENO) ? "COLOSSAL_TTY=1" : "COLOSSAL_TTY=0");
  // Ranks write into pipes, where Python would buffer whole blocks; at a terminal (torchrun's
  // default) it writes lines. Keep the interactive behaviour: logs appear as they happen.
  if (!has_unbuffered) base.push_back("PYTHONUNBUFFERED=1");
  // A job id lets a rank that reaches another job's store on this port fail at once. Nodes
  // started one by one cannot agree on a random one: there only the user's COLOSSAL_JOB_ID.
  if (!has_job_id && nnodes == 1) base.push_back("COLOSSAL_JOB_ID=" + new_job_id());
  if (o.rdzv_timeout_s) base.push_back("COLOSSAL_RDZV_TIMEOUT_S=" + fmt_seconds(*o.rdzv_timeout_s));
  if (o.dist_timeout_s) base.push_back("COLOSSAL_DIST_TIMEOUT_S=" + fmt_seconds(*o.dist_timeout_s));
  if (!has_omp && o.nproc_per_node > 1) {
    // Like torchrun: N ranks each using every core would oversubscribe the machine.
    base.push_back("OMP_NUM_THREADS=1");
    log_info("colossal run: OMP_NUM_THREADS=1 for each of the ", o.nproc_per_node,
             " ranks (set OMP_NUM_THREADS to choose another value)");
  }
  std::vector<Worker> workers;
  for (int lr = 0; lr < o.nproc_per_node; ++lr) {
    int rank = node_rank * o.nproc_per_node + lr;
    Worker w;
    w.label = str("rank ", rank);
    if (nnodes > 1) w.label += str(" (node ", node_rank, ", local rank ", lr, ")");
    w.path = path;
    w.argv = o.command;
    w.env = base;
    w.env.push_back(str("RANK=", rank));
    w.env.push_back(str("WORLD_SIZE=", world));
    w.env.push_back(str("LOCAL_RANK=", lr));
    w.env.push_back(str("LOCAL_WORLD_SIZE=", o.nproc_per_node));
    w.env.push_back(str("GROUP_RANK=", node_rank));
    w.env.push_back(str("GROUP_WORLD_SIZE=", nnodes));
    w.env.push_back(str("ROLE_RANK=", rank));
    w.env.push_back(str("ROLE_WORLD_SIZE=", world));
    w.env.push_back("ROLE_NAME=default");
    w.env.push_back("MASTER_ADDR=" + o.master_addr);
    w.env.push_back(str("MASTER_PORT=", port));
    w.prefix = str("[rank ", rank, "] ");
    if (rank == 0 && store_fd >= 0) {
      w.inherit_fd = store_fd;
      w.env.push_back(str("COLOSSAL_STORE_FD=", store_fd));
    }
    workers.push_back(std::move(w));
  }
  log_debug("colossal run: node ", node_rank, "/", nnodes, ": starting ranks ",
            node_rank * o.nproc_per_node, "..", (node_rank + 1) * o.nproc_per_node - 1, " of ",
            world, ", master ", o.master_addr, ":", port);
  return supervise(workers, {o.grace_period_s, o.save_grace_period_s, o.stop_on_stdin_eof});
}

int launch_fan_out(const LaunchOptions& o) {
  COLOSSAL_CHECK_INPUT(o.hostfile.empty() || o.host.empty(),
                       "--hostfile and --host are mutually exclusive; give only one");
  COLOSSAL_CHECK_INPUT(o.node_rank < 0,
                       "--node_rank is assigned to each host by the launcher; leave it out with "
                       "--hostfile/--host");
  std::vector<std::string> hosts;
  if (!o.hostfile.empty()) {
    hosts = filter_hosts(parse_hostfile(o.hostfile), o.include, o.exclude);
  } else {
    hosts = parse_host_list(o.host, "--host");
  }
  if (o.nnodes >= 0) {
    COLOSSAL_CHECK_INPUT(o.nnodes >= 1, "--nnodes ", o.nnodes, " must be at least 1");
    COLOSSAL_CHECK_INPUT(static_cast<size_t>(o.nnodes) <= hosts.size(), "--nnodes ", o.nnodes,
                         " is more than the ", hosts.size(), " hosts selected");
    hosts.resize(static_cast<size_t>(o.nnodes));
  }
  int nnodes = static_cast<int>(hosts.size());
  int64_t world = static_cast<int64_t>(o.nproc_per_node) * nnodes;
  COLOSSAL_CHECK_INPUT(world <= INT_MAX, "--nproc_per_node ", o.nproc_per_node, " x ", nnodes,
                       " hosts = ", world, " ranks is more than a job can have (", INT_MAX, ")");
  COLOSSAL_CHECK_INPUT(o.master_port != 0 || nnodes == 1,
                       "--master_port 0 (a free port) works on a single node only; give a port "
                       "that is free on the first host");
  COLOSSAL_CHECK_INPUT(o.ssh_port < 0 || (o.ssh_port >= 1 && o.ssh_port <= 65535), "--ssh_port ",
                       o.ssh_port, " is not a port number");
  std::string master = o.master_addr;
  if (!o.master_addr_given) {  // the first host runs rank 0
    master = hosts[0].substr(hosts[0].find('@') + 1);
    if (master.size() > 2 && master.front() == '[' && master.back() == ']')
      master = master.substr(1, master.size() - 2);
  }

  std::vector<std::string> ssh;
  const char* ssh_env = std::getenv("COLOSSAL_SSH");
  std::istringstream words(ssh_env && *ssh_env ? ssh_env : "ssh");
  for (std::string w; words >> w;) ssh.push_back(w);
  std::string ssh_path = resolve_command(ssh[0]);

  std::string env_part;
  for (const auto& kv : forwarded_env()) env_part += " " + shell_quote(kv);
  if (const char* id = std::getenv("COLOSSAL_JOB_ID"); !id || !*id)
    env_part += " COLOSSAL_JOB_ID=" + new_job_id();  // the same on every host
  std::string cd = "cd " + shell_quote(current_dir());
  std::string bin = shell_quote(self_exe());
  std::string cmd_part;
  for (const auto& a : o.command) cmd_part += " " + shell_quote(a);

  std::vector<Worker> workers;
  for (int i = 0; i < nnodes; ++i) {
    std::string remote = str(
        cd, " && exec env", env_part, " ", bin, " run --nproc_per_node ", o.nproc_per_node,
        " --nnodes ", nnodes, " --node_rank ", i, " --master_addr ", shell_quote(master),
        " --master_port ", o.master_port, " --grace_period ", fmt_seconds(o.grace_period_s),
        " --save_grace_period ", fmt_seconds(o.save_grace_period_s),
        o.rdzv_timeout_s ? " --rdzv_timeout " + fmt_seconds(*o.rdzv_timeout_s) : "",
        o.dist_timeout_s ? " --dist_timeout " + fmt_seconds(*o.dist_timeout_s) : "",
        o.allow_oversubscribe ? " --allow_oversubscribe" : "", " --stop_on_stdin_eof --", cmd_part);
    // One argv string, which Linux caps at 128 KiB (MAX_ARG_STRLEN), here and on the host.
    COLOSSAL_CHECK_INPUT(remote.size() < 120 * 1024, "colossal run: the command for host ",
                         hosts[i], " is ", remote.size(),
                         " bytes with the forwarded environment, over the 128 KiB a command line "
                         "may have; unset large environment variables");
    Worker w;
    w.label = str("node ", i, " (", hosts[i], ")");
    w.path = ssh_path;
    w.argv = ssh;
    if (o.ssh_port > 0) {
      w.argv.push_back("-p");
      w.argv.push_back(std::to_string(o.ssh_port));
    }
    w.argv.push_back(hosts[i]);
    w.argv.push_back(remote);
    for (char** e = environ; *e; ++e) w.env.push_back(*e);
    w.stdin_pipe = true;  // the remote launcher stops when this closes
    workers.push_back(std::move(w));
  }
  log_info("colossal run: starting ", o.nproc_per_node, " ranks on each of ", nnodes,
           nnodes == 1 ? " host" : " hosts", " over ", ssh[0], ", master ", master, ":",
           o.master_port);
  return supervise(workers, {o.grace_period_s, o.save_grace_period_s, false});
}

}  // namespace

int launch(LaunchOptions o) {
  COLOSSAL_CHECK_INPUT(!o.command.empty(),
                       "no command given; usage: colossal run --nproc_per_node N <command> "
                       "[args...]");
  COLOSSAL_CHECK_INPUT(o.nproc_per_node >= 1, "--nproc_per_node ", o.nproc_per_node,
                       " must be at least 1");
  COLOSSAL_CHECK_INPUT(o.master_port >= 0 && o.master_port <= 65535, "--master_port ",
                       o.master_port, " is not a port number (0..65535; 0 picks a free one)");
  // Checked before anything is forked: each rank is a process with its own memory, and
  // --nproc_per_node 100000 would fork until the OOM killer acts. Each node checks its own
  // limit (in a fan-out, the remote launchers do).
  if (!o.allow_oversubscribe && o.hostfile.empty() && o.host.empty()) {
    int limit = max_local_ranks();
    COLOSSAL_CHECK_INPUT(o.nproc_per_node <= limit, "--nproc_per_node ", o.nproc_per_node,
                         " is more than this node can run (", limit,
                         " = 4 x max(CPU cores, GPUs)); start fewer ranks, or give "
                         "--allow_oversubscribe to start them anyway");
  }
  COLOSSAL_CHECK_INPUT(o.grace_period_s >= 0 && std::isfinite(o.grace_period_s), "--grace_period ",
                       o.grace_period_s, " must be a non-negative number");
  COLOSSAL_CHECK_INPUT(o.save_grace_period_s >= 0 && o.save_grace_period_s <= 1e7,
                       "--save_grace_period ", o.save_grace_period_s,
                       " must be a number of seconds in 0..1e7");
  for (auto [name, v] : {std::pair{"--rdzv_timeout", o.rdzv_timeout_s},
                         std::pair{"--dist_timeout", o.dist_timeout_s}})
    COLOSSAL_CHECK_INPUT(!v || (std::isfinite(*v) && *v > 0 && *v <= 1e9), name, " ", *v,
                         " must be a positive number of seconds (at most 1e9)");
  COLOSSAL_CHECK_INPUT(!o.master_addr.empty(), "--master_addr must not be empty");
  COLOSSAL_CHECK_INPUT(o.include.empty() || o.exclude.empty(),
                       "--include and --exclude are mutually exclusive; give only one");
  COLOSSAL_CHECK_INPUT((o.include.empty() && o.exclude.empty()) || !o.hostfile.empty(),
                       "--include/--exclude select hosts of a --hostfile; give --hostfile too");
  if (!o.hostfile.empty() || !o.host.empty()) return launch_fan_out(o);
  return launch_local(o);
}

}  // namespace colossal::cli
