// Crash-safe writing of checkpoint files and folders. A file is written under a temporary
// sibling name, fsynced and renamed over the target; a whole folder is staged under a sibling
// name and swapped into place. Either way a crash mid-save leaves the previous checkpoint intact
// (plus, at worst, a stale temporary that the next save of the same target removes).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace at {
class Tensor;
}

namespace colossal::checkpoint {

class AsyncWriter;

// fsyncs a file or directory (opened read-only); Error naming the path on failure.
void fsync_path(const std::string& path);

// Writes `path` atomically: `write(fd)` fills "<path>.tmp-<pid>", which is fsynced, renamed over
// `path`, and the parent directory fsynced. If `write` throws, the temporary is removed and the
// exception propagates; `path` is untouched.
void write_file_atomic(const std::string& path, const std::function<void(int fd)>& write);

// A file written atomically piece by piece (write_file_atomic without the callback, for writers
// that produce their bytes over time): the data goes to "<path>.tmp-<pid>"; commit() fsyncs it,
// renames it over `path` and fsyncs the parent folder. Destroyed without commit() (an exception
// while writing), the temporary is removed and `path` is untouched.
// Under a WriteCapture (asynchronous saves, below) the bytes are staged instead (host memory, or
// device memory for write_tensor of a CUDA tensor) and commit() queues the file on the capture's
// AsyncWriter.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  void write(const void* data, size_t size);
  // Appends the bytes of `tensor` (any device and strides; written in contiguous order). Under a
  // capture, a CUDA tensor is copied into device memory (a snapshot taken on the current stream,
  // so later kernels may change the tensor at once) when the AsyncWriter's device budget has
  // room, else into host memory; the writer's thread moves a device snapshot to the host.
  void write_tensor(const at::Tensor& tensor);
  void commit();

  struct Staged;  // the bytes of a captured file: host ranges and device snapshots, in order

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
  std::shared_ptr<Staged> staged_;  // set under a capture; fd_ is then its in-memory file
  bool discarded_ = false;          // fd_ is /dev/null (DiscardWrites)
};

// write(2) all of `size` bytes, retrying short writes and EINTR; Error naming `path` on failure.
void write_all(int fd, const void* data, size_t size, const std::string& path);

// Removes a file or a folder tree (like `rm -rf`; a missing path is fine); returns false and
// fills `error` on failure. Use it instead of std::filesystem::remove_all: the copy of that
// function that libtorch.so 2.11 exports shadows libstdc++'s and crashes (jumps to address 0).
bool remove_tree(const std::string& path, std::string* error = nullptr);

// A checkpoint folder written as a whole: files go into path() ("<target>.staging", cleared
// first if a crashed save left it); commit() fsyncs them and swaps the folder into `target` (an
// existing target is replaced: renameat2(RENAME_EXCHANGE) where the file system supports it, else
// two renames via "<target>.old"), then deletes the previous contents. Without commit() (an
// exception while writing) the destructor removes the staging folder and `target` is untouched.
// Multi-rank saves: one rank owns the StagedDirectory and commits after a barrier; the others
// write into the same, deterministic path() without constructing one.
class StagedDirectory {
 public:
  explicit StagedDirectory(std::string target);
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  const std::string& path() const { return staging_; }
  const std::string& target() const { return target_; }
  void commit();
  bool committed() const { return committed_; }

 private:
  std::string target_;
  std::string staging_;
  bool committed_ = false;
};

// ---- Asynchronous saves (ColossalAI's use_async) ----
// While a WriteCapture is active on a thread, every AtomicFile opened there (so
// write_file_atomic, SafetensorsStreamWriter, save_safetensors, save_state_dict,
// save_pretrained) stages its bytes, and its commit() queues the file on the capture's
// AsyncWriter, whose thread writes it to "<path>.tmp-<pid>", fsyncs and renames it, in queue
// order, while training goes on.
// Staging: the tensors of a CUDA run are copied on the device (a few milliseconds for a 1b
// model's 15 GB) as long as the device budget allows, and the writer's thread copies them to
// the host through pinned buffers on a side stream; everything else (CPU tensors, headers,
// tensors beyond the budget) is copied into host memory (an anonymous in-memory file) before the
// save returns. The budget: the device's memory less the training's peak reservation when the
// first snapshot is taken, less a margin (10 %, at least 4 GiB); `device_stage_limit` >= 0
// replaces it. Each file is written by several threads at once (pwrite at disjoint offsets,
// O_DIRECT where the file system takes it): one stream reaches 0.93 GB/s on the H200 machine's
// virtual disk, four 1.7 GB/s.
// The price is memory for every byte this rank writes in one save, held until written (a
// synchronous save holds one tensor). A StagedDirectory committed under a capture is not swapped
// then: a folder may hold files that other ranks write in their own background threads, so the
// swap is deferred to take_deferred_commits(), for the caller to run once every rank's files are
// written (see Booster::wait_async_save, Trainer). A crash before that leaves the previous
// checkpoint intact.
class AsyncWriter {
 public:
  explicit AsyncWriter(int64_t device_stage_limit = -1);
  ~AsyncWriter();  // finishes the queue; an error left unreported is logged
  AsyncWriter(const AsyncWriter&) = delete;
  AsyncWriter& operator=(const AsyncWriter&) = delete;

  // Runs `job` on the writer's thread after the jobs queued before it. After a job failed, the
  // following ones are skipped until wait() has reported the error.
  void enqueue(std::function<void()> job);
  // Blocks until every queued job has run; rethrows the first error since the last wait().
  void wait();
  bool idle() const;
  // Folder swaps deferred by StagedDirectory::commit() under a capture, oldest first.
  void defer_commit(std::function<void()> commit);
  std::vector<std::function<void()>> take_deferred_commits();

  // What the saves since the last take_stats() cost: bytes staged on the device and in host
  // memory, seconds the saving thread spent staging, bytes written and seconds spent writing.
  struct Stats {
    int64_t device_bytes = 0, host_bytes = 0, written_bytes = 0;
    double stage_seconds = 0, write_seconds = 0;
    std::string describe() const;  // "15.4 GB staged (15.4 on the device) in 0.04 s, ..."
  };
  Stats take_stats();

  // For AtomicFile: room for `bytes` of device snapshots on `device` (false: stage on the host);
  // release_device gives it back once the snapshot is on the host.
  bool reserve_device(int64_t bytes, int device);
  void release_device(int64_t bytes);
  void add_staged(int64_t device_bytes, int64_t host_bytes, double seconds);
  // The writer thread's state for writing a staged file (pinned buffers, side streams).
  struct WriteState;
  WriteState& write_state();  // writer thread only
  void add_written(int64_t bytes, double seconds);

 private:
  void loop();
  int64_t device_limit_;  // -1 until the first device snapshot sets it
  int64_t device_held_ = 0;
  Stats stats_;
  std::unique_ptr<WriteState> write_state_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool running_ = false, stop_ = false;
  std::exception_ptr error_;
  std::vector<std::function<void()>> deferred_;
  std::thread thread_;
};

// Benchmark-only: while a DiscardWrites is active on a thread (and no WriteCapture), every
// AtomicFile opened there writes to /dev/null and its commit() renames nothing. `colossal bench
// --checkpoint_test discard` uses it to measure a save's gathers, copies, time and memory
// without the disk (the GPU machine's 64 GiB disk holds no 7b checkpoint with its optimizer).
class DiscardWrites {
 public:
  DiscardWrites();
  ~DiscardWrites();
  DiscardWrites(const DiscardWrites&) = delete;
  DiscardWrites& operator=(const DiscardWrites&) = delete;
  static bool active();

 private:
  bool previous_;
};

// Routes this thread's checkpoint writes to `writer` for its lifetime (nestable).
class WriteCapture {
 public:
  explicit WriteCapture(AsyncWriter& writer);
  ~WriteCapture();
  WriteCapture(const WriteCapture&) = delete;
  WriteCapture& operator=(const WriteCapture&) = delete;
  static AsyncWriter* active();  // this thread's, or null

 private:
  AsyncWriter* previous_;
};

}  // namespace colossal::checkpoint
