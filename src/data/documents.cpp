// The document index and loss mask files (see colossal/data/documents.h).
#include "colossal/data/documents.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "colossal/core/error.h"

namespace colossal::data {
namespace {

constexpr size_t kHeaderBytes = 256 * 4;

std::string read_whole(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  COLOSSAL_CHECK_INPUT(f.good(), "cannot read ", path, ": ", std::strerror(errno));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  COLOSSAL_CHECK_INPUT(!f.bad(), "error while reading ", path);
  return s;
}

}  // namespace

std::vector<uint64_t> read_doc_index(const std::string& path) {
  const std::string s = read_whole(path);
  COLOSSAL_CHECK_INPUT(s.size() >= kHeaderBytes, "document index ", path,
                       " is shorter than its header");
  int32_t h[4];
  std::memcpy(h, s.data(), sizeof h);
  COLOSSAL_CHECK_INPUT(h[0] == kDocIndexMagic && h[1] == 1, "document index ", path, " has magic ",
                       h[0], " version ", h[1], "; expected ", kDocIndexMagic, " version 1");
  const uint64_t count = static_cast<uint32_t>(h[2]) | (static_cast<uint64_t>(h[3]) << 32);
  COLOSSAL_CHECK_INPUT(count < (uint64_t{1} << 40), "document index ", path, " claims ", count,
                       " documents");
  const uint64_t want = kHeaderBytes + (count + 1) * 8;
  COLOSSAL_CHECK_INPUT(s.size() == want, "document index ", path, " holds ", s.size(), " bytes; ",
                       count, " documents need ", want);
  std::vector<uint64_t> off(count + 1);
  std::memcpy(off.data(), s.data() + kHeaderBytes, off.size() * 8);
  COLOSSAL_CHECK_INPUT(off[0] == 0, "document index ", path, ": the first offset is not 0");
  for (size_t i = 1; i < off.size(); ++i) {
    COLOSSAL_CHECK_INPUT(off[i] >= off[i - 1], "document index ", path,
                         ": offsets decrease at document ", i - 1);
  }
  return off;
}

LossMaskFile::LossMaskFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  COLOSSAL_CHECK_INPUT(fd >= 0, "cannot open loss mask ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw InputError(str("cannot stat loss mask ", path, ": ", std::strerror(e)));
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes < kHeaderBytes) {
    ::close(fd);
    throw InputError(str("loss mask ", path, " is shorter than its header (", bytes, " bytes)"));
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  COLOSSAL_CHECK_INPUT(map != MAP_FAILED, "cannot map loss mask ", path, ": ", std::strerror(e));
  map_ = map;
  map_bytes_ = bytes;
  int32_t h[5];
  std::memcpy(h, map, sizeof h);
  auto fail = [&](const std::string& what) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw InputError(str("loss mask ", path, ": ", what));
  };
  if (h[0] != kLossMaskMagic || h[1] != 1)
    fail(str("magic ", h[0], " version ", h[1], "; expected ", kLossMaskMagic, " version 1"));
  const uint64_t count = static_cast<uint32_t>(h[2]) | (static_cast<uint64_t>(h[3]) << 32);
  if (bytes - kHeaderBytes != count)
    fail(str("the header counts ", count, " tokens but the file holds ", bytes - kHeaderBytes,
             " mask bytes"));
  if (h[4] < 0) fail(str("packed sequence length ", h[4], " is negative"));
  count_ = static_cast<int64_t>(count);
  packed_seq_len_ = h[4];
  data_ = static_cast<const uint8_t*>(map) + kHeaderBytes;
  for (int64_t i = 0; i < count_; ++i) {
    ones_ += data_[i];
    if (data_[i] > 1)
      fail(str("byte ", static_cast<int>(data_[i]), " at token ", i,
               " (only 0 and 1 mean anything)"));
  }
}

LossMaskFile::~LossMaskFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

}  // namespace colossal::data
