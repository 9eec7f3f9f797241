// The document index and loss mask readers (data/documents.h): files as `colossal prepare`
// writes them read back, and corrupt ones (short, bad magic or version, sizes that disagree with
// the count, decreasing offsets, mask bytes other than 0 and 1) refused with an InputError
// naming the path.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/data/documents.h"
#include "common/document_files.h"
#include "common/temp_dir.h"

using namespace colossal;
using namespace colossal::data;
using colossal::tests::TempDir;

namespace {

std::vector<int32_t> header(int32_t magic, uint64_t count, int32_t seq = 0) {
  return tests::document_file_header(magic, count, seq);
}

void write(const std::string& path, const std::vector<int32_t>& h, const void* body, size_t bytes) {
  tests::write_document_file(path, h, body, bytes);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(DocIndex, ReadsOffsets) {
  TempDir d;
  const std::string p = (d.path() / "t.bin.docs").string();
  std::vector<uint64_t> off{0, 3, 3, 10};
  write(p, header(kDocIndexMagic, 3), off.data(), off.size() * 8);
  EXPECT_EQ(read_doc_index(p), off);
}

TEST(DocIndex, RejectsCorruptFiles) {
  TempDir d;
  const std::string p = (d.path() / "t.bin.docs").string();
  std::vector<uint64_t> off{0, 3, 10};
  write(p, header(kDocIndexMagic, 2), off.data(), off.size() * 8 - 1);  // truncated
  EXPECT_NE(error_of([&] { read_doc_index(p); }).find(p), std::string::npos);
  EXPECT_NE(error_of([&] { read_doc_index(p); }).find("documents need"), std::string::npos);
  write(p, header(kLossMaskMagic, 2), off.data(), off.size() * 8);  // a mask's magic
  EXPECT_NE(error_of([&] { read_doc_index(p); }).find("magic 20241205"), std::string::npos);
  std::vector<uint64_t> down{0, 5, 4};
  write(p, header(kDocIndexMagic, 2), down.data(), down.size() * 8);
  EXPECT_NE(error_of([&] { read_doc_index(p); }).find("decrease"), std::string::npos);
  std::vector<uint64_t> late{1, 5, 6};
  write(p, header(kDocIndexMagic, 2), late.data(), late.size() * 8);
  EXPECT_NE(error_of([&] { read_doc_index(p); }).find("first offset"), std::string::npos);
  write(p, std::vector<int32_t>(10, 0), nullptr, 0);  // shorter than the header
  EXPECT_NE(error_of([&] { read_doc_index(p); }).find("shorter than its header"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_doc_index((d.path() / "missing").string()); }).find("missing"),
            std::string::npos);
}

TEST(LossMask, ReadsBytesAndSeqLen) {
  TempDir d;
  const std::string p = (d.path() / "t.bin.mask").string();
  std::vector<uint8_t> m{0, 0, 1, 1, 0, 1};
  write(p, header(kLossMaskMagic, m.size(), 4), m.data(), m.size());
  LossMaskFile f(p);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.size(), 6);
  EXPECT_EQ(f.packed_seq_len(), 4);
  EXPECT_EQ(std::vector<uint8_t>(f.data(), f.data() + f.size()), m);
}

TEST(LossMask, RejectsCorruptFiles) {
  TempDir d;
  const std::string p = (d.path() / "t.bin.mask").string();
  std::vector<uint8_t> m{0, 0, 1, 1, 0, 1};
  auto err = [&] { return error_of([&] { LossMaskFile f(p); }); };
  write(p, header(kLossMaskMagic, m.size()), m.data(), m.size() - 2);  // truncated
  EXPECT_NE(err().find(p), std::string::npos);
  EXPECT_NE(err().find("counts 6 tokens but the file holds 4"), std::string::npos);
  write(p, header(kDocIndexMagic, m.size()), m.data(), m.size());  // an index's magic
  EXPECT_NE(err().find("magic 20241204"), std::string::npos);
  auto bad = m;
  bad[3] = 2;
  write(p, header(kLossMaskMagic, bad.size()), bad.data(), bad.size());
  EXPECT_NE(err().find("byte 2 at token 3"), std::string::npos);
  write(p, header(kLossMaskMagic, m.size(), -1), m.data(), m.size());
  EXPECT_NE(err().find("negative"), std::string::npos);
  write(p, std::vector<int32_t>(3, 0), nullptr, 0);
  EXPECT_NE(err().find("shorter than its header"), std::string::npos);
  EXPECT_NE(error_of([&] { LossMaskFile f((d.path() / "missing").string()); }).find("missing"),
            std::string::npos);
}
