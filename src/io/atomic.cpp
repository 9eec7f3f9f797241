// Crash-safe file and folder writes (see colossal/checkpoint/atomic.h).
#include "colossal/checkpoint/atomic.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "colossal/core/accelerator.h"
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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A staged file is written in buffers of kBufferBytes, by kWriteThreads threads at once, each
// buffer with one pwrite at its own offset. O_DIRECT (where the file system takes it) needs
// buffers, offsets and lengths aligned to the logical block size: kAlign covers 512 and 4096.
constexpr size_t kBufferBytes = size_t{32} << 20;
constexpr int kBuffers = 8;
constexpr int kWriteThreads = 4;
constexpr size_t kAlign = 4096;

// pread(2) all of `size` bytes at `offset`; Error naming `path` on failure.
void pread_all(int fd, char* out, size_t size, int64_t offset, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::pread(fd, out, size, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(str("cannot read the staged bytes of ", path, ": ",
                      n < 0 ? errno_text() : std::string("unexpected end")));
    }
    out += n;
    offset += n;
    size -= static_cast<size_t>(n);
  }
}

// One file written by kWriteThreads threads: acquire() a free buffer, fill it, submit() it at
// its offset; finish() waits for the writes, cuts the file to its size (the last buffer is
// padded to kAlign), fsyncs and closes it. An error of any write is rethrown by the next
// acquire/submit/finish; the destructor stops the threads (the caller removes the file).
class ParallelWrite {
 public:
  ParallelWrite(const std::string& path, const std::vector<char*>& buffers)
      : path_(path), free_(buffers) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    direct_ = fd_ >= 0;
    if (fd_ < 0 && errno == EINVAL)  // no O_DIRECT here (tmpfs, some network file systems)
      fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      throw Error(str("cannot create ", path, ": ", errno_text(),
                      " (does the folder exist and is it writable?)"));
    }
    for (int i = 0; i < kWriteThreads; ++i) threads_.emplace_back([this] { work(); });
  }
  ~ParallelWrite() {
    stop();
    if (fd_ >= 0) ::close(fd_);
  }
  ParallelWrite(const ParallelWrite&) = delete;
  ParallelWrite& operator=(const ParallelWrite&) = delete;

  char* acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty() || error_; });
    if (error_) std::rethrow_exception(error_);
    char* b = free_.back();
    free_.pop_back();
    return b;
  }
  void release(char* b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(b);
    cv_.notify_all();
  }
  void submit(char* b, uint64_t offset, size_t size) {
    size_t padded = (size + kAlign - 1) / kAlign * kAlign;
    std::memset(b + size, 0, padded - size);
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) {
      free_.push_back(b);
      std::rethrow_exception(error_);
    }
    jobs_.push_back({b, offset, padded});
    cv_.notify_all();
  }
  void finish(uint64_t size) {
    stop();
    if (error_) std::rethrow_exception(error_);
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
      throw Error(str("cannot set the size of ", path_, ": ", errno_text()));
    if (::fsync(fd_) != 0) throw Error(str("fsync ", path_, " failed: ", errno_text()));
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw Error(str("cannot close ", path_, ": ", errno_text()));
  }

 private:
  struct Job {
    char* buffer;
    uint64_t offset;
    size_t size;
  };
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return done_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      Job job = jobs_.front();
      jobs_.pop_front();
      const bool skip = static_cast<bool>(error_);
      lock.unlock();
      std::exception_ptr err;
      if (!skip) {
        try {
          write_at(job);
        } catch (...) {
          err = std::current_exception();
        }
      }
      lock.lock();
      if (err && !error_) error_ = err;
      free_.push_back(job.buffer);
      cv_.notify_all();
    }
  }
  void write_at(const Job& job) {
    const char* p = job.buffer;
    size_t size = job.size;
    off_t offset = static_cast<off_t>(job.offset);
    while (size > 0) {
      ssize_t n = ::pwrite(fd_, p, size, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EINVAL && direct_.exchange(false)) {
        // The file system opened the file with O_DIRECT but refuses this write: go on buffered.
        int flags = ::fcntl(fd_, F_GETFL);
        if (flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0) continue;
        errno = EINVAL;
      }
      if (n < 0) {
        throw Error(str("cannot write ", path_, ": ", errno_text(),
                        " (check free disk space and permissions)"));
      }
      p += n;
      offset += n;
      size -= static_cast<size_t>(n);
    }
  }

  std::string path_;
  int fd_ = -1;
  std::atomic<bool> direct_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char*> free_;
  std::deque<Job> jobs_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};
}  // namespace

struct AtomicFile::Staged {
  struct Segment {
    int64_t size = 0;
    int64_t mem_offset = -1;       // >= 0: these bytes are in `mem` at that offset
    at::Tensor device;             // else: a contiguous snapshot on the device
    std::unique_ptr<Event> ready;  // recorded after the snapshot's copy
  };
  explicit Staged(AsyncWriter* w) : writer(w) {}
  ~Staged() {
    for (const auto& s : segments)
      if (s.device.defined()) writer->release_device(s.size);
    if (mem >= 0) ::close(mem);
  }
  // Bytes written straight to fd() (write_file_atomic's callers) since the last segment.
  void catch_up() {
    off_t end = ::lseek(mem, 0, SEEK_CUR);
    if (end < 0) throw Error(str("cannot query the staged bytes: ", errno_text()));
    if (end > mem_size) add_host(end - mem_size);
  }
  void add_host(int64_t n) {
    if (segments.empty() || segments.back().mem_offset < 0) {
      segments.emplace_back();
      segments.back().mem_offset = mem_size;
    }
    segments.back().size += n;
    mem_size += n;
    size += n;
  }

  AsyncWriter* writer;
  int mem = -1;  // the in-memory file holding the host bytes
  int64_t mem_size = 0;
  int64_t size = 0;  // of the whole file
  std::vector<Segment> segments;
};

struct AsyncWriter::WriteState {
  ~WriteState() {
    for (char* b : plain) std::free(b);
  }
  // kBuffers aligned buffers of kBufferBytes; pinned (page-locked, for device copies at full
  // link speed) when `pinned`.
  const std::vector<char*>& buffers(bool pinned) {
    if (pinned && pinned_buffers.empty()) {
      for (int i = 0; i < kBuffers; ++i) {
        at::Tensor t = empty_pinned({static_cast<int64_t>(kBufferBytes)}, at::kByte);
        char* p = static_cast<char*>(t.data_ptr());
        COLOSSAL_CHECK(reinterpret_cast<uintptr_t>(p) % kAlign == 0,
                       "pinned write buffer is not aligned to ", kAlign, " bytes");
        pinned_keep.push_back(std::move(t));
        pinned_buffers.push_back(p);
      }
    }
    if (!pinned && plain.empty()) {
      for (int i = 0; i < kBuffers; ++i) {
        void* p = std::aligned_alloc(kAlign, kBufferBytes);
        if (!p) throw Error(str("cannot allocate ", kBufferBytes, " bytes for checkpoint writes"));
        plain.push_back(static_cast<char*>(p));
      }
    }
    return pinned ? pinned_buffers : plain;
  }
  // This thread's copy stream on `device` (made current), and an event to wait for it.
  c10::Stream stream(int device) {
    Accelerator& acc = Accelerator::cuda();
    auto it = streams.find(device);
    if (it == streams.end()) it = streams.emplace(device, acc.new_stream(device)).first;
    acc.set_device(device);
    acc.set_stream(it->second);
    if (!copied) copied = acc.new_event();
    return it->second;
  }

  std::vector<char*> plain, pinned_buffers;
  std::vector<at::Tensor> pinned_keep;
  std::map<int, c10::Stream> streams;
  std::unique_ptr<Event> copied;
};

namespace {
// Writes the staged file `s` to `path` atomically (through "<tmp>", in parallel), moving device
// snapshots to the host on the way and freeing each once it is there.
void write_staged(AtomicFile::Staged& s, const std::string& path, const std::string& tmp) {
  const auto t0 = std::chrono::steady_clock::now();
  AsyncWriter::WriteState& ws = s.writer->write_state();
  bool on_device = false;
  for (const auto& seg : s.segments) on_device = on_device || seg.device.defined();
  try {
    ParallelWrite out(tmp, ws.buffers(on_device));
    uint64_t offset = 0;
    size_t fill = 0;
    char* b = out.acquire();
    auto next_buffer = [&] {
      out.submit(b, offset, fill);
      offset += fill;
      fill = 0;
      b = out.acquire();
    };
    for (auto& seg : s.segments) {
      int64_t done = 0;
      if (seg.mem_offset >= 0) {
        while (done < seg.size) {
          size_t n = std::min(static_cast<size_t>(seg.size - done), kBufferBytes - fill);
          pread_all(s.mem, b + fill, n, seg.mem_offset + done, path);
          fill += n;
          done += static_cast<int64_t>(n);
          if (fill == kBufferBytes) next_buffer();
        }
        continue;
      }
      c10::Stream stream = ws.stream(seg.device.device().index());
      seg.ready->block(stream);  // the snapshot's copy on the training stream comes first
      at::Tensor bytes = seg.device.reshape({-1}).view(at::kByte);
      while (done < seg.size) {
        size_t n = std::min(static_cast<size_t>(seg.size - done), kBufferBytes - fill);
        at::from_blob(b + fill, {static_cast<int64_t>(n)}, at::kByte)
            .copy_(bytes.narrow(0, done, static_cast<int64_t>(n)), /*non_blocking=*/true);
        fill += n;
        done += static_cast<int64_t>(n);
        if (fill == kBufferBytes || done == seg.size) {
          ws.copied->record(stream);
          ws.copied->synchronize();
        }
        if (fill == kBufferBytes) next_buffer();
      }
      // On the host now: the device memory goes back (the copies that read it are done).
      bytes = at::Tensor();
      seg.device = at::Tensor();
      seg.ready.reset();
      s.writer->release_device(seg.size);
    }
    if (fill > 0) {
      out.submit(b, offset, fill);
    } else {
      out.release(b);
    }
    out.finish(static_cast<uint64_t>(s.size));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  test_slow_write();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw Error(str("cannot rename ", tmp, " to ", path, ": ", std::strerror(err)));
  }
  fsync_path(parent_of(path));
  s.writer->add_written(s.size, seconds_since(t0));
}
}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_ = str(path_, ".tmp-", ::getpid());
  if (t_capture) {
    staged_ = std::make_shared<Staged>(t_capture);
    fd_ = ::memfd_create("colossal-async-save", MFD_CLOEXEC);
    if (fd_ < 0) throw Error(str("cannot stage ", path_, " in memory: ", errno_text()));
    staged_->mem = fd_;  // owned by staged_
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
  if (staged_) return;  // its destructor frees the staged bytes
  if (fd_ >= 0) ::close(fd_);
  if (!discarded_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  COLOSSAL_CHECK(fd_ >= 0 && !committed_, "AtomicFile ", path_, ": write after commit");
  const auto t0 = std::chrono::steady_clock::now();
  if (staged_) staged_->catch_up();
  write_all(fd_, data, size, tmp_);
  if (staged_) {
    staged_->add_host(static_cast<int64_t>(size));
    staged_->writer->add_staged(0, static_cast<int64_t>(size), seconds_since(t0));
  }
}

void AtomicFile::write_tensor(const at::Tensor& tensor) {
  COLOSSAL_CHECK(fd_ >= 0 && !committed_, "AtomicFile ", path_, ": write after commit");
  const int64_t n = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  if (n == 0) return;
  if (staged_ && tensor.is_cuda() && staged_->writer->reserve_device(n, tensor.device().index())) {
    const auto t0 = std::chrono::steady_clock::now();
    staged_->catch_up();
    Staged::Segment seg;
    seg.size = n;
    seg.device = tensor.detach().clone(at::MemoryFormat::Contiguous);
    seg.ready = Accelerator::cuda().new_event();
    seg.ready->record(Accelerator::cuda().current_stream(tensor.device().index()));
    staged_->segments.push_back(std::move(seg));
    staged_->size += n;
    staged_->writer->add_staged(n, 0, seconds_since(t0));
    return;
  }
  at::Tensor c = tensor.device().is_cpu() ? tensor.contiguous() : tensor.to(at::kCPU).contiguous();
  write(c.data_ptr(), static_cast<size_t>(n));
}

void AtomicFile::commit() {
  COLOSSAL_CHECK(fd_ >= 0 && !committed_, "AtomicFile ", path_, ": committed twice");
  if (staged_) {
    COLOSSAL_CHECK(t_capture == staged_->writer, "AtomicFile ", path_,
                   ": committed outside the capture it began in");
    staged_->catch_up();
    // The job owns the staged bytes: they are freed when it has run, or is dropped unrun (an
    // earlier file of the save failed).
    std::shared_ptr<Staged> staged = std::move(staged_);
    fd_ = -1;
    committed_ = true;
    t_capture->enqueue([staged, path = path_, tmp = tmp_] { write_staged(*staged, path, tmp); });
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

AsyncWriter::AsyncWriter(int64_t device_stage_limit)
    : device_limit_(device_stage_limit), thread_([this] { loop(); }) {}

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

namespace {
std::string gb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GB", static_cast<double>(bytes) / 1e9);
  return buf;
}
std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}
}  // namespace

bool AsyncWriter::reserve_device(int64_t bytes, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_limit_ < 0) {
    // The first snapshot: what the training has reserved at its peak so far stays its own.
    const MemoryStats m = Accelerator::cuda().memory_stats(device);
    int64_t total = 0;
    for (const auto& d : cuda_devices())
      if (d.index == device) total = d.total_memory;
    const int64_t margin = std::max<int64_t>(int64_t{4} << 30, total / 10);
    const int64_t peak = std::max(m.peak_reserved, m.reserved);
    device_limit_ = std::max<int64_t>(0, total - peak - margin);
    log_info("asynchronous saves stage up to ", gib(device_limit_), " on cuda:", device, " (",
             gib(total), " less the training's peak reservation ", gib(peak), " and a margin of ",
             gib(margin), "); the rest in host memory");
  }
  if (device_held_ + bytes > device_limit_) return false;
  device_held_ += bytes;
  return true;
}

void AsyncWriter::release_device(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  device_held_ -= bytes;
}

void AsyncWriter::add_staged(int64_t device_bytes, int64_t host_bytes, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.device_bytes += device_bytes;
  stats_.host_bytes += host_bytes;
  stats_.stage_seconds += seconds;
}

void AsyncWriter::add_written(int64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.written_bytes += bytes;
  stats_.write_seconds += seconds;
}

AsyncWriter::Stats AsyncWriter::take_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(stats_, Stats{});
}

AsyncWriter::WriteState& AsyncWriter::write_state() {
  COLOSSAL_CHECK(std::this_thread::get_id() == thread_.get_id(),
                 "AsyncWriter::write_state is the writer thread's");
  if (!write_state_) write_state_ = std::make_unique<WriteState>();
  return *write_state_;
}

std::string AsyncWriter::Stats::describe() const {
  char rate[48] = "";
  if (write_seconds > 0) {
    std::snprintf(rate, sizeof rate, ", %.2f GB/s",
                  static_cast<double>(written_bytes) / 1e9 / write_seconds);
  }
  char secs[96];
  std::snprintf(secs, sizeof secs, " in %.2f s; written in %.1f s", stage_seconds, write_seconds);
  return str(gb(device_bytes + host_bytes), " staged (", gb(device_bytes), " on the device, ",
             gb(host_bytes), " in host memory)", secs, rate);
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
