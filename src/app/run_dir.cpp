// The save folder of a training run (see colossal/app/run_dir.h).
#include "colossal/app/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"

namespace colossal::app {

namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "step-00000042" -> 42; -1 for anything else (also "step-00000042.staging").
int64_t parse_step_name(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    char ch = name[i];
    if (ch < '0' || ch > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (ch - '0');
  }
  return v;
}

std::vector<std::string> list_names(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    names.push_back(it->path().filename().string());
  return names;
}

bool is_complete_step(const std::string& dir, const std::string& name) {
  std::error_code ec;
  return parse_step_name(name) >= 0 && fs::is_directory(dir + "/" + name, ec) &&
         fs::exists(dir + "/" + name + "/trainer_state.json", ec);
}

std::string read_latest(const std::string& dir) {
  std::ifstream f(dir + "/latest");
  if (!f) return "";
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

void probe_writable_dir(const std::string& dir, const std::string& option) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw InputError(
        str("option '", option, "' (", dir, "): cannot create the folder: ", ec.message()));
  if (!fs::is_directory(dir, ec))
    throw InputError(str("option '", option, "' (", dir, ") is not a folder"));
  const std::string probe = str(dir, "/.probe-", host_name(), "-", ::getpid());
  auto fail = [&](const char* what) {
    int err = errno;
    ::unlink(probe.c_str());
    throw InputError(str("option '", option, "' (", dir, "): checkpoints cannot be written there: ",
                         what, " ", probe, " failed: ", std::strerror(err)));
  };
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("creating");
  const char byte = '\n';
  ssize_t w;
  do {
    w = ::write(fd, &byte, 1);
  } while (w < 0 && errno == EINTR);
  if (w != 1) {
    if (w >= 0) errno = ENOSPC;
    int err = errno;
    ::close(fd);
    errno = err;
    fail("writing");
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    errno = err;
    fail("fsync of");
  }
  if (::close(fd) != 0) fail("closing");
  if (::unlink(probe.c_str()) != 0) fail("removing");
}

RunDirLock::RunDirLock(const std::string& dir) {
  const std::string path = dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw InputError(str("option 'save_dir' (", dir, "): cannot open the lock file ", path, ": ",
                         std::strerror(errno)));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    std::string owner;
    char buf[512];
    ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    if (n > 0) {
      owner.assign(buf, static_cast<size_t>(n));
      while (!owner.empty() && (owner.back() == '\n' || owner.back() == ' ')) owner.pop_back();
    }
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw InputError(str("option 'save_dir' (", dir, ") is in use by another training job",
                           owner.empty() ? std::string() : str(" (", owner, ")"),
                           ": two runs writing one folder overwrite each other's checkpoints; "
                           "wait for it to end or choose another save_dir"));
    throw InputError(
        str("option 'save_dir' (", dir, "): cannot lock ", path, ": ", std::strerror(err)));
  }
  // Who holds it, for the next job's message; best effort (the flock is what excludes).
  std::string me = str("host ", host_name(), " pid ", ::getpid(), "\n");
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] ssize_t w = ::pwrite(fd_, me.data(), me.size(), 0);
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::vector<StepDir> complete_steps(const std::string& dir) {
  std::vector<StepDir> out;
  for (const auto& name : list_names(dir))
    if (is_complete_step(dir, name)) out.push_back({parse_step_name(name), name});
  std::sort(out.begin(), out.end(),
            [](const StepDir& a, const StepDir& b) { return a.step < b.step; });
  return out;
}

bool holds_run(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir + "/latest", ec)) return true;
  for (const auto& name : list_names(dir))
    if (parse_step_name(name) >= 0) return true;
  return false;
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& name : list_names(dir)) {
    // (Not ".probe-*": other ranks may be probing the folder right now.)
    bool stale = name.rfind("latest.tmp-", 0) == 0;
    if (!stale && name.rfind("step-", 0) == 0) {
      if (ends_with(name, ".staging")) stale = true;
      // A crash between StagedDirectory's two renames leaves the previous copy as ".old" and
      // possibly no step-N: then it is the only copy, and stays.
      if (ends_with(name, ".old"))
        stale = fs::exists(dir + "/" + name.substr(0, name.size() - 4), ec);
    }
    if (!stale) continue;
    std::string err;
    if (checkpoint::remove_tree(dir + "/" + name, &err))
      removed.push_back(name);
    else
      log_warn("cannot remove the leftover ", dir, "/", name, ": ", err);
  }
  return removed;
}

std::string resolve_checkpoint(const std::string& path, std::string* why) {
  std::error_code ec;
  if (fs::exists(path + "/trainer_state.json", ec)) return path;
  const std::string latest = read_latest(path);
  const bool has_latest = fs::exists(path + "/latest", ec);
  std::vector<StepDir> steps = complete_steps(path);
  if (steps.empty()) {
    if (has_latest)
      throw InputError(str("resume: ", path, "/latest names ", latest,
                           ", which is not a complete checkpoint (no trainer_state.json), and ",
                           path, " holds no other"));
    throw InputError(str("resume: ", path,
                         " is not a training checkpoint (no trainer_state.json, no latest and no "
                         "complete step-N folder)"));
  }
  const StepDir& newest = steps.back();
  if (latest == newest.name) return path + "/" + newest.name;
  std::string reason;
  if (!has_latest) {
    reason = str(path, " has no latest file");
  } else if (!is_complete_step(path, latest)) {
    reason = str(path, "/latest names '", latest, "', which is not a complete checkpoint");
  } else {
    // A complete step newer than `latest`: the save was killed after committing it, before
    // `latest` was rewritten.
    reason = str(path, "/latest names ", latest, " but ", newest.name,
                 " is newer and complete (a save was stopped before updating latest)");
  }
  if (why) *why = str(reason, "; resuming from the newest complete checkpoint, ", newest.name);
  return path + "/" + newest.name;
}

std::vector<std::string> prune_steps(const std::string& dir, int64_t keep) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  std::vector<StepDir> steps = complete_steps(dir);
  const std::string latest = read_latest(dir);
  int64_t n = static_cast<int64_t>(steps.size());
  for (int64_t i = 0; i + keep < n; ++i) {
    if (steps[static_cast<size_t>(i)].name == latest) continue;
    std::string err;
    const std::string p = dir + "/" + steps[static_cast<size_t>(i)].name;
    if (checkpoint::remove_tree(p, &err))
      removed.push_back(steps[static_cast<size_t>(i)].name);
    else
      log_warn("keep_last: cannot remove the old checkpoint ", p, ": ", err);
  }
  return removed;
}

}  // namespace colossal::app
