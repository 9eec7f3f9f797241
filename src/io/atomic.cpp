// Crash-safe file and folder writes (see colossal/checkpoint/atomic.h).
#include "colossal/checkpoint/atomic.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <utility>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/core/logging.h"

namespace fs = std::filesystem;

namespace colossal::checkpoint {
namespace {

std::string parent_of(const std::string& path) {
  fs::path p = fs::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

std::string errno_text() {
  return std::strerror(errno);
}

// Test-only: COLOSSAL_TEST_SLOW_WRITES_MS=<ms> sleeps that long after a checkpoint file's bytes
// are in its temporary and before the rename publishes it (synchronous and background writes
// alike), so a save's write window stays open long enough for the crash tests
// (tests/booster/test_kill_saves.py) to kill inside it on purpose rather than by luck. Not an
// option of any command; unset, it costs one getenv per process.
void test_slow_write() {
  static const long ms = [] {
    const char* v = std::getenv("COLOSSAL_TEST_SLOW_WRITES_MS");
    return v ? std::strtol(v, nullptr, 10) : 0L;
  }();
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace

bool remove_tree(const std::string& path, std::string* error) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return true;
    if (error) *error = str("cannot stat ", path, ": ", errno_text());
    return false;
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* d = ::opendir(path.c_str());
    if (!d) {
      if (error) *error = str("cannot open folder ", path, ": ", errno_text());
      return false;
    }
    std::vector<std::string> children;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") children.push_back(path + "/" + name);
    }
    ::closedir(d);
    for (const auto& c : children) {
      if (!remove_tree(c, error)) return false;
    }
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
      if (error) *error = str("cannot remove folder ", path, ": ", errno_text());
      return false;
    }
    return true;
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    if (error) *error = str("cannot remove ", path, ": ", errno_text());
    return false;
  }
  return true;
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(str("cannot open ", path, " to fsync it: ", errno_text()));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some file systems refuse fsync on directories (EINVAL); the data files were synced anyway.
  if (rc != 0 && err != EINVAL) throw Error(str("fsync ", path, " failed: ", std::strerror(err)));
}

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux caps one write at about 2 GB; stay below it.
    size_t chunk = size < (size_t{1} << 30) ? size : (size_t{1} << 30);
    ssize_t n = ::write(fd, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(str("cannot write ", path, ": ", errno_text(),
                      " (check free disk space and permissions)"));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

namespace {
thread_local AsyncWriter* t_capture = nullptr;
thread_local bool t_discard = false;

// Writes the in-memory file `mem` (its whole contents) to `path` atomically.
void write_captured(int mem, const std::string& path, const std::string& tmp) {
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error(str("cannot create ", tmp, ": ", errno_text(),
                    " (does the folder exist and is it writable?)"));
  }
  try {
    std::vector<char> buf(size_t{8} << 20);
    off_t off = 0;
    while (true) {
      ssize_t n = ::pread(mem, buf.data(), buf.size(), off);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(str("cannot read the staged bytes of ", path, ": ", errno_text()));
      if (n == 0) break;
      write_all(fd, buf.data(), static_cast<size_t>(n), tmp);
      off += n;
    }
    if (::fsync(fd) != 0) throw Error(str("fsync ", tmp, " failed: ", errno_text()));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error(str("cannot close ", tmp, ": ", errno_text()));
  }
  test_slow_write();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw Error(str("cannot rename ", tmp, " to ", path, ": ", std::strerror(err)));
  }
  fsync_path(parent_of(path));
}
}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_ = str(path_, ".tmp-", ::getpid());
  if (t_capture) {
    captured_ = true;
    fd_ = ::memfd_create("colossal-async-save", MFD_CLOEXEC);
    if (fd_ < 0) throw Error(str("cannot stage ", path_, " in memory: ", errno_text()));
    return;
  }
  if (t_discard) {
    discarded_ = true;
    fd_ = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd_ < 0) throw Error(str("cannot open /dev/null: ", errno_text()));
    return;
  }
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw Error(str("cannot create ", tmp_, ": ", errno_text(),
                    " (does the folder exist and is it writable?)"));
  }
}

AtomicFile::~AtomicFile() {
  if (committed_) return;
  if (fd_ >= 0) ::close(fd_);
  if (!captured_ && !discarded_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  COLOSSAL_CHECK(fd_ >= 0 && !committed_, "AtomicFile ", path_, ": write after commit");
  write_all(fd_, data, size, tmp_);
}

void AtomicFile::commit() {
  COLOSSAL_CHECK(fd_ >= 0 && !committed_, "AtomicFile ", path_, ": committed twice");
  if (captured_) {
    COLOSSAL_CHECK(t_capture, "AtomicFile ", path_, ": committed outside the capture it began in");
    // The job owns the staged bytes: they are freed when it has run, or is dropped unrun (an
    // earlier file of the save failed).
    std::shared_ptr<int> mem(new int(fd_), [](int* fd) {
      ::close(*fd);
      delete fd;
    });
    fd_ = -1;
    committed_ = true;
    t_capture->enqueue([mem, path = path_, tmp = tmp_] { write_captured(*mem, path, tmp); });
    return;
  }
  if (discarded_) {
    ::close(fd_);
    fd_ = -1;
    committed_ = true;
    return;
  }
  if (::fsync(fd_) != 0) throw Error(str("fsync ", tmp_, " failed: ", errno_text()));
  test_slow_write();
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) throw Error(str("cannot close ", tmp_, ": ", errno_text()));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    throw Error(str("cannot rename ", tmp_, " to ", path_, ": ", errno_text()));
  }
  committed_ = true;
  fsync_path(parent_of(path_));
}

void write_file_atomic(const std::string& path, const std::function<void(int fd)>& write) {
  AtomicFile f(path);
  write(f.fd());
  f.commit();
}

StagedDirectory::StagedDirectory(std::string target) : target_(std::move(target)) {
  while (target_.size() > 1 && target_.back() == '/') target_.pop_back();
  COLOSSAL_CHECK_INPUT(!target_.empty(), "StagedDirectory: empty target folder name");
  // A fixed name, not a per-process one: every rank of a job computes the same folder, and the
  // leftover of a crashed save is found and cleared by the next one.
  staging_ = target_ + ".staging";
  std::string err;
  if (!remove_tree(staging_, &err)) throw Error(str("cannot clear old staging folder: ", err));
  std::error_code ec;
  fs::create_directories(staging_, ec);
  if (ec) throw Error(str("cannot create staging folder ", staging_, ": ", ec.message()));
}

StagedDirectory::~StagedDirectory() {
  if (committed_) return;
  std::string err;
  if (!remove_tree(staging_, &err)) log_warn("could not remove staging folder: ", err);
}

namespace {
void commit_staged(const std::string& staging_, const std::string& target_);
}

void StagedDirectory::commit() {
  COLOSSAL_CHECK(!committed_, "StagedDirectory::commit called twice for ", target_);
  if (t_capture) {
    committed_ = true;  // the AsyncWriter owns the swap now: the destructor keeps the folder
    t_capture->defer_commit(
        [staging = staging_, target = target_] { commit_staged(staging, target); });
    return;
  }
  commit_staged(staging_, target_);
  committed_ = true;
}

namespace {
void commit_staged(const std::string& staging_, const std::string& target_) {
  // Make every staged file durable before the swap publishes them.
  for (const auto& e : fs::recursive_directory_iterator(staging_)) {
    if (e.is_regular_file() || e.is_directory()) fsync_path(e.path().string());
  }
  fsync_path(staging_);
  std::error_code ec;
  bool exists = fs::exists(target_, ec);
  std::string old;
  if (!exists) {
    if (::rename(staging_.c_str(), target_.c_str()) != 0) {
      throw Error(str("cannot rename ", staging_, " to ", target_, ": ", errno_text()));
    }
  } else {
    COLOSSAL_CHECK_INPUT(fs::is_directory(target_, ec), "checkpoint target ", target_,
                         " exists and is not a folder; remove it or choose another path");
    // Atomic swap: after it, staging_ names the previous contents.
    if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) == 0) {
      old = staging_;
    } else {
      // No RENAME_EXCHANGE here: move the old folder aside first; a crash between the two
      // renames leaves it complete under "<target>.old-<pid>".
      old = target_ + ".old";
      std::string err;
      if (!remove_tree(old, &err)) throw Error(str("cannot clear ", old, ": ", err));
      if (::rename(target_.c_str(), old.c_str()) != 0) {
        throw Error(str("cannot move ", target_, " aside to ", old, ": ", errno_text()));
      }
      if (::rename(staging_.c_str(), target_.c_str()) != 0) {
        int err = errno;
        ::rename(old.c_str(), target_.c_str());  // put the previous checkpoint back
        throw Error(str("cannot rename ", staging_, " to ", target_, ": ", std::strerror(err)));
      }
    }
  }
  fsync_path(parent_of(target_));
  if (!old.empty()) {
    std::string err;
    if (!remove_tree(old, &err)) log_warn("could not remove previous checkpoint folder: ", err);
  }
}
}  // namespace

// ---- AsyncWriter ----

AsyncWriter::AsyncWriter() : thread_([this] { loop(); }) {}

AsyncWriter::~AsyncWriter() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !running_; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      log_error("asynchronous checkpoint save failed (nothing committed): ", e.what());
    }
  }
}

void AsyncWriter::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = static_cast<bool>(error_);
    running_ = true;
    lock.unlock();
    std::exception_ptr err;
    if (!skip) {
      try {
        job();
      } catch (...) {
        err = std::current_exception();
      }
    }
    job = nullptr;  // its staged bytes are freed before the next job
    lock.lock();
    running_ = false;
    if (err && !error_) error_ = err;
    cv_.notify_all();
  }
}

void AsyncWriter::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void AsyncWriter::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !running_; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    deferred_.clear();  // a folder missing a file must never be published
    std::rethrow_exception(e);
  }
}

bool AsyncWriter::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && !running_;
}

void AsyncWriter::defer_commit(std::function<void()> commit) {
  std::lock_guard<std::mutex> lock(mu_);
  deferred_.push_back(std::move(commit));
}

std::vector<std::function<void()>> AsyncWriter::take_deferred_commits() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(deferred_, {});
}

DiscardWrites::DiscardWrites() : previous_(t_discard) {
  t_discard = true;
}

DiscardWrites::~DiscardWrites() {
  t_discard = previous_;
}

bool DiscardWrites::active() {
  return t_discard;
}

WriteCapture::WriteCapture(AsyncWriter& writer) : previous_(t_capture) {
  t_capture = &writer;
}

WriteCapture::~WriteCapture() {
  t_capture = previous_;
}

AsyncWriter* WriteCapture::active() {
  return t_capture;
}

}  // namespace colossal::checkpoint
