// TensorBoard event files: CRC-32C against published vectors (RFC 3720 B.4 and the "123456789"
// check value), the TFRecord framing byte by byte, and the writer's files and named errors.
// tests/app/test_tensorboard.py reads what `colossal train` writes with TensorBoard itself.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "colossal/app/tensorboard.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"

namespace fs = std::filesystem;
using namespace colossal;
using namespace colossal::app;

namespace {

uint64_t get_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::string temp_dir(const std::string& name) {
  const std::string d =
      (fs::temp_directory_path() / ("colossal_tb_" + name + "_" + std::to_string(::getpid())))
          .string();
  checkpoint::remove_tree(d);
  return d;
}

// The records of a TFRecord file, each checked against its two CRCs.
std::vector<std::string> read_records(const std::string& bytes) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_LE(at + 12, bytes.size());
    const uint64_t n = get_le(bytes, at, 8);
    EXPECT_EQ(get_le(bytes, at + 8, 4), masked_crc32c(bytes.substr(at, 8)));
    EXPECT_LE(at + 12 + n + 4, bytes.size());
    std::string data = bytes.substr(at + 12, n);
    EXPECT_EQ(get_le(bytes, at + 12 + n, 4), masked_crc32c(data));
    out.push_back(std::move(data));
    at += 12 + n + 4;
  }
  return out;
}

}  // namespace

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  // RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down), 0x113FDB5Cu);
  // Continuing from a previous value is the CRC of the concatenation.
  EXPECT_EQ(crc32c("56789", crc32c("1234")), 0xE3069283u);
}

TEST(Crc32c, Mask) {
  // TensorFlow's crc32c::Mask: rotate right by 15, add a constant.
  EXPECT_EQ(masked_crc32c(""), 0xA282EAD8u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xA282EAD8u);
}

TEST(TfRecord, Framing) {
  const std::string data = "hello, tensorboard";
  const std::string r = tfrecord_frame(data);
  ASSERT_EQ(r.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(get_le(r, 0, 8), data.size());
  EXPECT_EQ(get_le(r, 8, 4), masked_crc32c(r.substr(0, 8)));
  EXPECT_EQ(r.substr(12, data.size()), data);
  EXPECT_EQ(get_le(r, 12 + data.size(), 4), masked_crc32c(data));
  const auto recs = read_records(tfrecord_frame("") + r);
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0], "");
  EXPECT_EQ(recs[1], data);
}

TEST(TensorBoardWriter, WritesFramedEvents) {
  const std::string dir = temp_dir("write") + "/a/b";
  if (!tensorboard_available()) {
    try {
      TensorBoardWriter w(dir);
      FAIL() << "expected an InputError";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("no protobuf"), std::string::npos) << e.what();
    }
    return;
  }
  std::string path;
  {
    TensorBoardWriter w(dir, 1700000000.5);
    path = w.path();
    const std::string name = fs::path(path).filename().string();
    EXPECT_EQ(fs::path(path).parent_path(), fs::path(dir));
    EXPECT_EQ(name.rfind("events.out.tfevents.1700000000.", 0), 0u) << name;
    EXPECT_NE(name.find("." + std::to_string(::getpid()) + "."), std::string::npos) << name;
    // The file_version event is on disk as soon as the writer exists.
    auto recs = read_records(read_all(path));
    ASSERT_EQ(recs.size(), 1u);
    EXPECT_NE(recs[0].find("brain.Event:2"), std::string::npos);
    w.add_scalar("train/loss", 2.5, 1);
    w.add_scalar("train/loss", 2.25, 2);
    w.flush();
    EXPECT_EQ(read_records(read_all(path)).size(), 3u);
    w.add_scalar("train/lr", 0.001, 2);  // written by close() (the destructor)
    // A second writer in the same folder and second gets a file of its own.
    TensorBoardWriter w2(dir, 1700000000.5);
    EXPECT_NE(w2.path(), path);
  }
  const auto recs = read_records(read_all(path));
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_NE(recs[1].find("train/loss"), std::string::npos);
  EXPECT_NE(recs[1].find("scalars"), std::string::npos);  // the first point's plugin metadata
  EXPECT_EQ(recs[2].find("scalars"), std::string::npos);  // not repeated
  EXPECT_NE(recs[3].find("train/lr"), std::string::npos);
  checkpoint::remove_tree(temp_dir("write"));
}

TEST(TensorBoardWriter, NamedErrors) {
  const std::string base = temp_dir("errors");
  fs::create_directories(base);
  std::ofstream(base + "/file") << "x";
  for (const std::string& dir : {base + "/file", base + "/file/sub"}) {
    try {
      TensorBoardWriter w(dir);
      FAIL() << "expected an InputError for " << dir;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
    }
  }
  checkpoint::remove_tree(base);
}
