// Asynchronous checkpoint writes (checkpoint::AsyncWriter): a file staged under a WriteCapture and
// written in the background by several threads is byte for byte the file a synchronous save
// writes, whatever mix of buffer-crossing tensors, direct fd writes and device snapshots it
// holds; a device snapshot holds the values of the moment of the save, not of the write.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "common/temp_dir.h"

namespace fs = std::filesystem;
using namespace colossal;
using namespace colossal::checkpoint;
using colossal::tests::TempDir;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Sizes around the writer's 32 MiB buffers and 4 KiB alignment: one tensor spans two buffers
// and ends off any block boundary, small ones share a buffer, one is empty.
TensorList sample_tensors(const at::Device& device) {
  at::manual_seed(7);
  auto opts = at::TensorOptions().device(device);
  TensorList list;
  list.emplace_back("big", at::randn({(int64_t{40} << 20) / 4 + 3}, opts.dtype(at::kFloat)));
  list.emplace_back("half", at::randn({1001, 77}, opts.dtype(at::kBFloat16)));
  list.emplace_back("ids", at::arange(12345, opts.dtype(at::kLong)));
  list.emplace_back("empty", at::empty({0, 5}, opts.dtype(at::kFloat)));
  // Not contiguous: written in contiguous order.
  list.emplace_back("transposed", at::randn({300, 513}, opts.dtype(at::kFloat)).t());
  list.emplace_back("flags", at::rand({999}, opts.dtype(at::kFloat)).gt(0.5));
  return list;
}

// The same tensors on the host, for the synchronous reference file.
TensorList on_host(const TensorList& list) {
  TensorList out;
  for (const auto& [n, t] : list) out.emplace_back(n, t.to(at::kCPU, false, /*copy=*/true));
  return out;
}

void save_captured(AsyncWriter& writer, const std::string& path, const TensorList& tensors) {
  WriteCapture capture(writer);
  save_safetensors(path, tensors, {{"format", "test"}});
  // A file written through the fd directly, as write_text_atomic does, between two others.
  write_file_atomic(path + ".txt", [](int fd) {
    const char text[] = "written through the fd\n";
    write_all(fd, text, sizeof text - 1, "text");
  });
}

}  // namespace

TEST(AsyncWriter, StagedFilesEqualSynchronousOnes) {
  TempDir dir("async_writer");
  const std::string root = dir.path().string();
  TensorList tensors = sample_tensors(at::kCPU);
  save_safetensors(root + "/sync.safetensors", tensors, {{"format", "test"}});
  AsyncWriter writer;
  const std::string async_path = root + "/async.safetensors";
  save_captured(writer, async_path, tensors);
  // Nothing is published before the writer has run, and then everything is.
  writer.wait();
  EXPECT_EQ(read_bytes(async_path), read_bytes(root + "/sync.safetensors"));
  EXPECT_EQ(read_bytes(async_path + ".txt"), "written through the fd\n");
  const AsyncWriter::Stats st = writer.take_stats();
  EXPECT_EQ(st.device_bytes, 0);
  EXPECT_EQ(st.written_bytes, static_cast<int64_t>(fs::file_size(async_path) + 23));
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().string().find(".tmp-"), std::string::npos) << e.path();
}

TEST(AsyncWriter, WriteErrorIsReportedAndNothingPublished) {
  TempDir dir("async_writer_err");
  const std::string root = dir.path().string();
  AsyncWriter writer;
  const std::string path = root + "/gone/x.safetensors";
  {
    WriteCapture capture(writer);
    save_safetensors(path, {{"a", at::ones({1 << 20})}});
  }
  try {
    writer.wait();
    FAIL() << "expected the background write to fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(path));
  // The writer goes on after the error was reported.
  const std::string ok = root + "/ok.safetensors";
  {
    WriteCapture capture(writer);
    save_safetensors(ok, {{"a", at::ones({3})}});
  }
  writer.wait();
  EXPECT_TRUE(fs::exists(ok));
}

// On the GPU: snapshots on the device (budget permitting) or on the host (limit 0, or a limit
// smaller than the save), each time equal to the synchronous file, and holding the values of
// the moment of the save although the tensors change right after it.
TEST(AsyncWriterCuda, DeviceSnapshotsHoldTheValuesAtSaveTime) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  TempDir dir("async_writer_cuda");
  const std::string root = dir.path().string();
  TensorList tensors = sample_tensors(at::Device(at::kCUDA, 0));
  const TensorList before = on_host(tensors);
  save_safetensors(root + "/sync.safetensors", before, {{"format", "test"}});
  const std::string expected = read_bytes(root + "/sync.safetensors");
  int64_t total = 0;
  for (const auto& [n, t] : tensors) total += t.numel() * t.element_size();

  for (int64_t limit : {int64_t{-1}, int64_t{0}, int64_t{8} << 20}) {
    SCOPED_TRACE("device_stage_limit " + std::to_string(limit));
    AsyncWriter writer(limit);
    const std::string path = root + "/async" + std::to_string(limit) + ".safetensors";
    TensorList live = sample_tensors(at::Device(at::kCUDA, 0));
    save_captured(writer, path, live);
    // Training goes on: the saved tensors change in place, on the same stream, at once.
    for (auto& [n, t] : live) {
      if (t.scalar_type() == at::kBool) {
        t.logical_not_();
      } else if (t.numel() > 0) {
        t.add_(1);
      }
    }
    writer.wait();
    EXPECT_EQ(read_bytes(path), expected);
    const AsyncWriter::Stats st = writer.take_stats();
    if (limit < 0) {
      EXPECT_EQ(st.device_bytes, total);
    } else if (limit == 0) {
      EXPECT_EQ(st.device_bytes, 0);
    } else {
      EXPECT_GT(st.device_bytes, 0);
      EXPECT_LE(st.device_bytes, limit);
    }
  }
}
