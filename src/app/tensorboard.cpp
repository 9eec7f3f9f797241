// TensorBoard event files (see colossal/app/tensorboard.h).
#include "colossal/app/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <set>
#include <system_error>

#include "colossal/core/error.h"

#ifdef COLOSSAL_WITH_PROTOBUF
#include "proto/tensorboard_events.h"
#endif

namespace colossal::app {

namespace fs = std::filesystem;

namespace {

// The reflected table of the Castagnoli polynomial, built at compile time.
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

#ifdef COLOSSAL_WITH_PROTOBUF
std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  // A path component: no separators (a host name has none, but a file name must not).
  for (char* p = buf; *p; ++p)
    if (*p == '/') *p = '_';
  return buf;
}

// Distinguishes the files of writers opened by this process in the same second (TensorFlow's
// global uid, the last part of the file name).
std::atomic<int64_t> g_file_counter{0};
#endif

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  crc = ~crc;
  for (unsigned char ch : data) crc = kCrc32cTable[(crc ^ ch) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

bool tensorboard_available() {
#ifdef COLOSSAL_WITH_PROTOBUF
  return true;
#else
  return false;
#endif
}

struct TensorBoardWriter::Impl {
  int fd = -1;
  std::string pending;         // framed records not yet written
  std::set<std::string> tags;  // tags whose metadata was written
};

double TensorBoardWriter::now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, double wall_time) {
#ifndef COLOSSAL_WITH_PROTOBUF
  (void)wall_time;
  throw InputError(str("TensorBoard folder ", dir,
                       ": this build has no protobuf support, so it cannot write event files "
                       "(install libprotobuf-dev and protobuf-compiler, then rebuild)"));
#else
  COLOSSAL_CHECK_INPUT(!dir.empty(), "TensorBoard folder: the path is empty");
  std::error_code ec;
  COLOSSAL_CHECK_INPUT(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "TensorBoard folder ",
                       dir, ": it exists and is not a folder");
  fs::create_directories(dir, ec);
  COLOSSAL_CHECK_INPUT(!ec && fs::is_directory(dir, ec), "TensorBoard folder ", dir,
                       ": cannot create it: ", ec ? ec.message() : std::string("unknown error"));
  // Encoded before any file is made: a protobuf runtime that fails its version check (see
  // CMakeLists.txt on libsentencepiece's copy) leaves nothing behind.
  std::string first;
  try {
    first = tfrecord_frame(tensorboard_proto::file_version_event(wall_time, "brain.Event:2"));
  } catch (const std::exception& e) {
    throw Error(str("TensorBoard folder ", dir, ": cannot encode an event: ", e.what()));
  }
  impl_ = std::make_unique<Impl>();
  const std::string prefix = str("events.out.tfevents.", static_cast<int64_t>(wall_time), ".",
                                 host_name(), ".", ::getpid(), ".");
  // A new file, never one already there (O_EXCL): the next number when the name is taken.
  for (int attempt = 0;; ++attempt) {
    path_ = (fs::path(dir) / (prefix + std::to_string(g_file_counter++))).string();
    impl_->fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (impl_->fd >= 0) break;
    COLOSSAL_CHECK_INPUT(errno == EEXIST && attempt < 1000, "TensorBoard event file ", path_,
                         ": cannot create it: ", std::strerror(errno));
  }
  impl_->pending = std::move(first);
  flush();
#endif
}

TensorBoardWriter::~TensorBoardWriter() {
  try {
    close();
  } catch (...) {
    // close() is called explicitly where an error matters; a destructor never throws.
  }
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step,
                                   double wall_time) {
  COLOSSAL_CHECK(impl_ && impl_->fd >= 0, "TensorBoard event file ", path_, " is closed");
#ifdef COLOSSAL_WITH_PROTOBUF
  // As TensorFlow's writers do: the plugin metadata travels with a tag's first point only.
  const bool first = impl_->tags.insert(tag).second;
  impl_->pending += tfrecord_frame(
      tensorboard_proto::scalar_event(wall_time, step, tag, static_cast<float>(value), first));
#else
  (void)tag, (void)value, (void)step, (void)wall_time;
#endif
}

void TensorBoardWriter::session_start(int64_t step, double wall_time) {
  COLOSSAL_CHECK(impl_ && impl_->fd >= 0, "TensorBoard event file ", path_, " is closed");
#ifdef COLOSSAL_WITH_PROTOBUF
  impl_->pending += tfrecord_frame(tensorboard_proto::session_start_event(wall_time, step));
#else
  (void)step, (void)wall_time;
#endif
}

// Every byte written, or an InputError naming the file (a full disk stops the run rather than
// leaving a file silently cut short).
void TensorBoardWriter::flush() {
  if (!impl_ || impl_->fd < 0) return;
  const std::string& buf = impl_->pending;
  size_t done = 0;
  while (done < buf.size()) {
    const ssize_t n = ::write(impl_->fd, buf.data() + done, buf.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      impl_->pending.erase(0, done);
      throw InputError(
          str("TensorBoard event file ", path_, ": cannot write it: ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  impl_->pending.clear();
}

void TensorBoardWriter::close() {
  if (!impl_ || impl_->fd < 0) return;
  try {
    flush();
  } catch (...) {
    ::close(impl_->fd);
    impl_->fd = -1;
    throw;
  }
  const int rc = ::close(impl_->fd);
  impl_->fd = -1;
  COLOSSAL_CHECK_INPUT(rc == 0, "TensorBoard event file ", path_,
                       ": cannot write it: ", std::strerror(errno));
}

}  // namespace colossal::app
