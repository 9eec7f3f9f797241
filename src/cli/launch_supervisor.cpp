// Process supervision for `colossal run`: fork/exec of the workers (ranks, or ssh clients in a
// fan-out), line-wise relay of their output, and stopping the job as a whole.
//
// Why it is built this way:
// - Each worker is the leader of its own process group, so a stop reaches the processes a rank
//   started itself (data loaders, compilers) with one kill(-pgid). A terminal's Ctrl-C therefore
//   reaches only the launcher, which forwards it.
// - PR_SET_PDEATHSIG(SIGKILL): if the launcher is killed outright, ranks do not linger.
// - Signals are turned into bytes on a self-pipe, so the only blocking call is one poll().
// - Output is written a whole line per write(): lines from different ranks never mix.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "cli/launcher.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"

namespace colossal::cli {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

// When each child exited, taken in the SIGCHLD handler: the main loop may reap two ranks in one
// pass (one failed, the other then lost its connection to it), and the summary must blame the
// one that died first. A pending SIGCHLD keeps the first child's siginfo, so the earliest exit
// is always recorded; a child without an entry gets the time it was reaped.
struct ExitRecord {
  pid_t pid;
  int64_t ns;
};
constexpr int kMaxExitRecords = 4096;
ExitRecord g_exits[kMaxExitRecords];
std::atomic<int> g_n_exits{0};

int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe, and steady_clock's clock
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void on_sigchld(int sig, siginfo_t* info, void*) {
  int saved = errno;
  int i = g_n_exits.load(std::memory_order_relaxed);
  if (info && i < kMaxExitRecords) {
    g_exits[i] = {info->si_pid, now_ns()};
    g_n_exits.store(i + 1, std::memory_order_release);
  }
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

const int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};

std::string signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    case SIGKILL:
      return "SIGKILL";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGALRM:
      return "SIGALRM";
    default:
      return "signal " + std::to_string(sig);
  }
}

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {  // a non-blocking stdout: wait until it drains
        pollfd pfd{fd, POLLOUT, 0};
        ::poll(&pfd, 1, 100);
        continue;
      }
      return;  // EPIPE and friends: the reader is gone; drop the output, keep supervising
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// One output stream of one worker, relayed to the launcher's fd of the same kind.
struct Stream {
  int fd = -1;
  int out_fd = 1;
  const std::string* prefix = nullptr;
  std::string buf;
  std::string* last_line = nullptr;  // stderr: the last non-blank line, for the summary
};

constexpr size_t kMaxLine = 64 * 1024;  // longer lines are relayed in pieces of this size

void emit_lines(Stream& s, bool flush_partial) {
  size_t start = 0;
  std::string line;
  while (true) {
    // '\r' ends a line too: a rank's progress bar redraws in place on the launcher's terminal.
    size_t nl = s.buf.find_first_of("\n\r", start);
    char term = nl != std::string::npos ? s.buf[nl] : '\n';
    size_t end;
    if (nl != std::string::npos) {
      end = nl;
    } else if (s.buf.size() - start >= kMaxLine) {
      end = start + kMaxLine;
    } else if (flush_partial && start < s.buf.size()) {
      end = s.buf.size();
    } else {
      break;
    }
    line.assign(*s.prefix);
    line.append(s.buf, start, end - start);
    if (s.last_line) {
      size_t b = s.buf.find_first_not_of(" \t", start);
      if (b != std::string::npos && b < end)
        s.last_line->assign(s.buf, b, std::min<size_t>(end - b, 400));
    }
    line.push_back(nl == end ? term : '\n');
    write_all(s.out_fd, line.data(), line.size());
    start = nl == end ? end + 1 : end;
  }
  s.buf.erase(0, start);
}

struct Proc {
  const Worker* w = nullptr;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  int stdin_fd = -1;  // write end held by the launcher
  Stream out, err;
  int64_t exit_ns = 0;        // CLOCK_MONOTONIC
  bool after_stop = false;    // exited after the launcher began stopping the job
  std::string last_err_line;  // what it said last on stderr
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return str("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return str("was killed by ", signal_name(WTERMSIG(status)));
  return "stopped";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void make_pipe(int fds[2]) {
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw Error(str("colossal run: pipe2 failed: ", std::strerror(errno)));
}

std::vector<char*> c_array(const std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Forks and execs one worker. Only async-signal-safe calls happen in the child.
void spawn(Proc& p, pid_t launcher_pid, int devnull) {
  int out[2], err[2], in[2] = {-1, -1};
  make_pipe(out);
  make_pipe(err);
  if (p.w->stdin_pipe) make_pipe(in);
  auto argv = c_array(p.w->argv);
  auto envp = c_array(p.w->env);
  const char* path = p.w->path.c_str();

  pid_t pid = ::fork();
  if (pid < 0) throw Error(str("colossal run: fork failed: ", std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher_pid) ::_exit(127);  // the launcher died before prctl
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : kForwarded) ::sigaction(sig, &dfl, nullptr);
    ::sigaction(SIGCHLD, &dfl, nullptr);
    ::sigaction(SIGPIPE, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(in[0] >= 0 ? in[0] : devnull, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    if (p.w->inherit_fd >= 0) ::fcntl(p.w->inherit_fd, F_SETFD, 0);  // keep it across exec
    ::execve(path, argv.data(), envp.data());
    const char msg[] = "colossal run: exec failed for ";
    [[maybe_unused]] ssize_t n = ::write(2, msg, sizeof msg - 1);
    n = ::write(2, path, std::strlen(path));
    n = ::write(2, "\n", 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also in the parent, so kill(-pid) works right after fork returns
  ::close(out[1]);
  ::close(err[1]);
  if (in[0] >= 0) ::close(in[0]);
  // Handed over: from now on only the worker holds it (a later worker must not inherit it, and
  // it must go away with the worker).
  if (p.w->inherit_fd >= 0) ::close(p.w->inherit_fd);
  p.pid = pid;
  p.alive = true;
  p.stdin_fd = in[1];
  p.out.fd = out[0];
  p.out.out_fd = 1;
  p.out.prefix = &p.w->prefix;
  p.err.fd = err[0];
  p.err.out_fd = 2;
  p.err.prefix = &p.w->prefix;
  p.err.last_line = &p.last_err_line;
}

void kill_group(const Proc& p, int sig) {
  if (p.pid > 0) ::kill(-p.pid, sig);
}

}  // namespace

int supervise(const std::vector<Worker>& workers, const SuperviseOptions& opts) {
  COLOSSAL_CHECK(!workers.empty(), "colossal run: no workers to start");
  // With fd 0, 1 or 2 closed, a pipe could land on it and dup2 in the child would be a no-op
  // that leaves it close-on-exec: occupy them with /dev/null first.
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      int nfd = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (nfd >= 0 && nfd != fd) ::close(nfd);  // only fill the lowest free slot
    }
  }
  make_pipe(g_signal_pipe);
  ::fcntl(g_signal_pipe[0], F_SETFL, O_NONBLOCK);
  ::fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK);
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  COLOSSAL_CHECK(devnull >= 0, "colossal run: cannot open /dev/null: ", std::strerror(errno));

  // Handlers first, with the signals blocked across the forks: a child resets them and
  // unblocks before exec, so no signal is lost or handled by the wrong process.
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : kForwarded) ::sigaction(sig, &sa, nullptr);
  struct sigaction sc {};
  sc.sa_sigaction = on_sigchld;
  sigemptyset(&sc.sa_mask);
  sc.sa_flags = SA_RESTART | SA_NOCLDSTOP | SA_SIGINFO;
  g_n_exits.store(0);
  ::sigaction(SIGCHLD, &sc, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : kForwarded) sigaddset(&block, sig);
  sigaddset(&block, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &block, &old);

  std::vector<Proc> procs(workers.size());
  pid_t self = ::getpid();
  for (size_t i = 0; i < workers.size(); ++i) {
    procs[i].w = &workers[i];
    try {
      spawn(procs[i], self, devnull);
    } catch (...) {
      for (auto& p : procs) kill_group(p, SIGKILL);
      ::sigprocmask(SIG_SETMASK, &old, nullptr);
      throw;
    }
  }
  ::sigprocmask(SIG_SETMASK, &old, nullptr);
  ::close(devnull);

  bool stopping = false, killed = false;
  int stop_signal = 0;  // the launcher's own signal, when that is why we stop
  Clock::time_point kill_deadline{}, drain_deadline{};
  bool drain_started = false;
  int exit_code = 0;
  std::string failure;
  auto grace = std::chrono::milliseconds(static_cast<int64_t>(opts.grace_period_s * 1000));

  bool fan_out = false;
  for (const auto& w : workers) fan_out |= w.stdin_pipe;
  // A remote launcher needs its own grace period to stop its ranks and report; give it that
  // and a margin before its ssh client is killed.
  if (fan_out) grace += std::chrono::seconds(3);
  // A forwarded signal asks the ranks to save before they go (`colossal train` does, at the next
  // step boundary): they get the longer save grace period. A failure stops them at once.
  auto save_grace = std::max(
      grace, std::chrono::milliseconds(static_cast<int64_t>(opts.save_grace_period_s * 1000)) +
                 (fan_out ? std::chrono::seconds(3) : std::chrono::seconds(0)));
  auto stop_all = [&](int sig, bool forwarded = false) {
    stopping = true;
    kill_deadline = Clock::now() + (forwarded ? save_grace : grace);
    for (auto& p : procs) {
      if (p.w->stdin_pipe) {  // ssh clients: EOF tells the remote launcher to stop its ranks
        if (p.stdin_fd >= 0) ::close(p.stdin_fd);
        p.stdin_fd = -1;
        continue;
      }
      kill_group(p, sig);
    }
  };
  auto n_alive = [&] {
    int n = 0;
    for (auto& p : procs) n += p.alive;
    return n;
  };

  bool watch_stdin = opts.stop_on_stdin_eof;
  std::vector<pollfd> fds;
  std::vector<Stream*> streams;
  while (true) {
    // Reap everything that exited, then look at it in the order the processes died.
    std::vector<Proc*> exited;
    for (auto& p : procs) {
      if (!p.alive) continue;
      int st = 0;
      pid_t r = ::waitpid(p.pid, &st, WNOHANG);
      if (r != p.pid) continue;
      p.alive = false;
      p.status = st;
      p.exit_ns = now_ns();
      int n = std::min(g_n_exits.load(std::memory_order_acquire), kMaxExitRecords);
      for (int i = 0; i < n; ++i)
        if (g_exits[i].pid == p.pid) p.exit_ns = std::min(p.exit_ns, g_exits[i].ns);
      p.after_stop = stopping;
      exited.push_back(&p);
    }
    std::stable_sort(exited.begin(), exited.end(),
                     [](const Proc* a, const Proc* b) { return a->exit_ns < b->exit_ns; });
    for (Proc* pp : exited) {
      Proc& p = *pp;
      int st = p.status;
      bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      if (!ok && !stopping) {
        failure = str(p.w->label, " (pid ", p.pid, ") ", describe_status(st));
        exit_code = exit_code_of(st);
        int others = n_alive();
        log_error("colossal run: ", failure,
                  others > 0 ? str("; stopping the other ", others,
                                   others == 1 ? " process" : " processes")
                             : std::string());
        stop_all(SIGTERM);
      }
    }
    int alive = n_alive();
    if (alive == 0 && !drain_started) {
      drain_started = true;
      // Output that descendants still hold open is read for a moment, not waited for.
      drain_deadline = Clock::now() + std::chrono::milliseconds(500);
      if (stopping)
        for (auto& p : procs) kill_group(p, SIGKILL);  // leftovers that ignored SIGTERM
    }
    if (stopping && !killed && alive > 0 && Clock::now() >= kill_deadline) {
      killed = true;
      log_warn("colossal run: ", alive, alive == 1 ? " process" : " processes",
               " still running after the grace period; sending SIGKILL");
      for (auto& p : procs) kill_group(p, SIGKILL);
    }

    fds.clear();
    streams.clear();
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    streams.push_back(nullptr);
    for (auto& p : procs) {
      for (Stream* s : {&p.out, &p.err}) {
        if (s->fd < 0) continue;
        fds.push_back({s->fd, POLLIN, 0});
        streams.push_back(s);
      }
    }
    size_t stdin_idx = 0;
    if (watch_stdin && !stopping) {
      stdin_idx = fds.size();
      fds.push_back({0, POLLIN, 0});
      streams.push_back(nullptr);
    }
    bool any_open = fds.size() > 1 + (stdin_idx ? 1 : 0);
    if (alive == 0 && (!any_open || Clock::now() >= drain_deadline)) break;

    int timeout_ms = 500;
    auto now = Clock::now();
    if (stopping && !killed && alive > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_deadline - now);
      timeout_ms = std::max<int>(0, std::min<int64_t>(timeout_ms, left.count() + 1));
    }
    if (alive == 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(drain_deadline - now);
      timeout_ms = std::max<int>(0, std::min<int64_t>(timeout_ms, left.count() + 1));
    }
    int r = ::poll(fds.data(), fds.size(), timeout_ms);
    if (r < 0 && errno != EINTR)
      throw Error(str("colossal run: poll failed: ", std::strerror(errno)));
    if (r <= 0) continue;

    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t n;
      while ((n = ::read(g_signal_pipe[0], sigs, sizeof sigs)) > 0) {
        for (ssize_t i = 0; i < n; ++i) {
          int sig = sigs[i];
          if (sig == SIGCHLD) continue;  // reaped at the top of the loop
          if (!stopping) {
            stop_signal = sig;
            log_warn("colossal run: received ", signal_name(sig), "; passing it to ", n_alive(),
                     " processes, which may save first (killed after ",
                     std::chrono::duration<double>(save_grace).count(),
                     " s; signal again to kill them at once)");
            stop_all(sig, /*forwarded=*/true);
          } else if (!killed) {  // a second signal: no more patience
            killed = true;
            log_warn("colossal run: received ", signal_name(sig), " again; sending SIGKILL");
            for (auto& p : procs) kill_group(p, SIGKILL);
          }
        }
      }
    }
    if (stdin_idx && fds[stdin_idx].revents) {
      char buf[4096];
      ssize_t n = ::read(0, buf, sizeof buf);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN) ||
          (fds[stdin_idx].revents & (POLLHUP | POLLERR | POLLNVAL))) {
        watch_stdin = false;
        if (!stopping) {
          log_error(
              "colossal run: lost the connection to the launching node (stdin closed); "
              "stopping ",
              n_alive(), " processes");
          if (exit_code == 0) exit_code = 1;
          failure = "the launching node went away";
          stop_all(SIGTERM);
        }
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      Stream* s = streams[i];
      if (!s || !fds[i].revents) continue;
      char buf[65536];
      ssize_t n = ::read(s->fd, buf, sizeof buf);
      if (n > 0) {
        s->buf.append(buf, static_cast<size_t>(n));
        emit_lines(*s, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit_lines(*s, true);
        ::close(s->fd);
        s->fd = -1;
      }
    }
  }

  for (auto& p : procs) {
    for (Stream* s : {&p.out, &p.err}) {
      if (s->fd < 0) continue;
      emit_lines(*s, true);
      ::close(s->fd);
      s->fd = -1;
    }
    if (p.stdin_fd >= 0) ::close(p.stdin_fd);
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : kForwarded) ::sigaction(sig, &dfl, nullptr);
  ::sigaction(SIGCHLD, &dfl, nullptr);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;

  if (!failure.empty()) {
    // Every process that failed on its own, by exit time: the first is the cause, the others
    // usually its consequences (a peer's "connection closed"); those the launcher stopped
    // (killed by its signal, or exiting with 128 + it) are only counted.
    std::vector<const Proc*> failed;
    int n_stopped = 0;
    for (const auto& p : procs) {
      bool ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0;
      if (ok) continue;
      bool by_stop =
          p.after_stop && ((WIFSIGNALED(p.status) &&
                            (WTERMSIG(p.status) == SIGTERM || WTERMSIG(p.status) == SIGKILL)) ||
                           (WIFEXITED(p.status) && WEXITSTATUS(p.status) == 128 + SIGTERM));
      if (by_stop) {
        ++n_stopped;
        continue;
      }
      failed.push_back(&p);
    }
    std::stable_sort(failed.begin(), failed.end(),
                     [](const Proc* a, const Proc* b) { return a->exit_ns < b->exit_ns; });
    auto cause = [](const Proc& p) {
      std::string c = str(p.w->label, " (pid ", p.pid, ") ", describe_status(p.status));
      if (!p.last_err_line.empty()) c += ": " + p.last_err_line;
      return c;
    };
    if (!failed.empty()) {
      const Proc& first = *failed.front();
      exit_code = exit_code_of(first.status);
      log_error("colossal run: job failed: ", cause(first),
                failed.size() > 1 ? " (first to fail)" : "");
      if (failed.size() > 1) {
        for (const Proc* p : failed)
          log_error("colossal run:   +", (p->exit_ns - first.exit_ns) / 1000000,
                    " ms: ", cause(*p));
      }
    } else {
      log_error("colossal run: job failed: ", failure);
    }
    if (n_stopped > 0)
      log_error("colossal run:   ", n_stopped,
                n_stopped == 1 ? " other process was" : " other processes were",
                " stopped by the launcher");
    return exit_code != 0 ? exit_code : 1;
  }
  if (stop_signal) {
    log_error("colossal run: job stopped by ", signal_name(stop_signal));
    return 128 + stop_signal;
  }
  return 0;
}

}  // namespace colossal::cli
