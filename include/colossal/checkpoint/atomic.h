// Crash-safe writing of checkpoint files and folders. A file is written under a temporary
// sibling name, fsynced and renamed over the target; a whole folder is staged under a sibling
// name and swapped into place. Either way a crash mid-save leaves the previous checkpoint intact
// (plus, at worst, a stale temporary that the next save of the same target removes).
#pragma once

#include <functional>
#include <string>

namespace colossal::checkpoint {

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
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  void write(const void* data, size_t size);
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
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

}  // namespace colossal::checkpoint
