// safetensors reader/writer: round trips for every dtype against ATen, and hostile files (corrupt
// headers, a fuzz loop) that must end in an InputError, never a crash.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "common/temp_dir.h"

namespace fs = std::filesystem;
using namespace colossal;
using namespace colossal::checkpoint;

namespace {

using colossal::tests::TempDir;

std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Byte-exact comparison (NaN-safe, works for every dtype incl. float8 and bool).
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  if (a.numel() == 0) return true;
  at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

at::Tensor random_tensor(at::ScalarType t, at::IntArrayRef shape, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (t == at::kBool) return at::randint(0, 2, shape, gen, at::kLong).to(at::kBool);
  if (at::isIntegralType(t, false)) return at::randint(-100, 100, shape, gen, at::kLong).to(t);
  if (t == at::kByte) return at::randint(0, 255, shape, gen, at::kLong).to(t);
  return (at::randn(shape, gen, at::kFloat) * 10).to(t);
}

const std::vector<std::pair<at::ScalarType, std::string>> kAll = {{at::kDouble, "F64"},
                                                                  {at::kFloat, "F32"},
                                                                  {at::kHalf, "F16"},
                                                                  {at::kBFloat16, "BF16"},
                                                                  {at::kFloat8_e4m3fn, "F8_E4M3"},
                                                                  {at::kFloat8_e5m2, "F8_E5M2"},
                                                                  {at::kLong, "I64"},
                                                                  {at::kInt, "I32"},
                                                                  {at::kShort, "I16"},
                                                                  {at::kChar, "I8"},
                                                                  {at::kByte, "U8"},
                                                                  {at::kBool, "BOOL"}};

void expect_input_error(const std::string& path, const std::string& needle) {
  try {
    SafetensorsReader r(path);
    ADD_FAILURE() << "expected an InputError containing '" << needle << "' for " << path;
  } catch (const InputError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
  }
}

}  // namespace

TEST(Safetensors, DtypeNames) {
  for (const auto& [t, n] : kAll) {
    EXPECT_EQ(dtype_to_safetensors(t), n);
    EXPECT_EQ(dtype_from_safetensors(n), t);
  }
  EXPECT_THROW(dtype_from_safetensors("F7"), InputError);
  EXPECT_THROW(dtype_to_safetensors(at::kComplexFloat), Error);
}

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  TensorList in;
  int64_t seed = 1;
  for (const auto& [t, n] : kAll) {
    in.emplace_back(n + ".matrix", random_tensor(t, {3, 5}, seed++));
    // Non-contiguous: a transposed view and a strided slice.
    in.emplace_back(n + ".transposed", random_tensor(t, {4, 6}, seed++).t());
    in.emplace_back(n + ".strided", random_tensor(t, {7, 8}, seed++).slice(1, 0, 8, 3));
    in.emplace_back(n + ".scalar", random_tensor(t, {}, seed++));
    in.emplace_back(n + ".empty", at::empty({0, 4}, at::TensorOptions().dtype(t)));
  }
  Metadata md{{"format", "pt"}, {"note", "quote \" and \\ and unicode \xc3\xa9"}};
  std::string path = dir.file("all.safetensors");
  save_safetensors(path, in, md);

  Metadata got_md;
  TensorList out = load_safetensors(path, &got_md);
  EXPECT_EQ(got_md, md);
  ASSERT_EQ(out.size(), in.size());
  std::map<std::string, at::Tensor> by_name(out.begin(), out.end());
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_TRUE(same_bytes(by_name[name], t)) << name;
    EXPECT_EQ(by_name[name].dim(), t.dim()) << name;
  }
  // The copying loader gives the same bytes.
  TensorList copied = load_safetensors_copy(path);
  ASSERT_EQ(copied.size(), out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(copied[i].first, out[i].first);
    EXPECT_TRUE(same_bytes(copied[i].second, out[i].second)) << out[i].first;
  }
  // Every tensor in the file is naturally aligned (the writer groups by element size).
  SafetensorsReader r(path);
  for (const auto& info : r.tensors()) {
    EXPECT_EQ(info.begin % c10::elementSize(info.dtype), 0u) << info.name;
  }
  // Header is padded with spaces to 8 bytes.
  std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, MappedTensorsOutliveReaderAndAreCopyOnWrite) {
  TempDir dir;
  std::string path = dir.file("a.safetensors");
  at::Tensor x = at::arange(16, at::kFloat);
  save_safetensors(path, {{"x", x}});
  at::Tensor y;
  {
    SafetensorsReader r(path);
    y = r.get("x");
    EXPECT_THROW(r.get("nope"), InputError);
  }
  EXPECT_TRUE(at::equal(y, x));
  y.add_(1);  // private mapping: writable, but the file is unchanged
  EXPECT_TRUE(at::equal(load_safetensors(path)[0].second, x));
}

TEST(Safetensors, OneDtypeKeepsCallerOrder) {
  TempDir dir;
  std::string path = dir.file("o.safetensors");
  TensorList in = {{"z", at::ones({2})}, {"a", at::ones({3})}, {"m", at::ones({1})}};
  save_safetensors(path, in);
  TensorList out = load_safetensors(path);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].first, "z");
  EXPECT_EQ(out[1].first, "a");
  EXPECT_EQ(out[2].first, "m");
}

TEST(Safetensors, EmptyFile) {
  TempDir dir;
  std::string path = dir.file("e.safetensors");
  save_safetensors(path, {});
  EXPECT_TRUE(load_safetensors(path).empty());
}

TEST(Safetensors, WriterRejectsBadListsAndKeepsOldFile) {
  TempDir dir;
  std::string path = dir.file("keep.safetensors");
  save_safetensors(path, {{"old", at::ones({4})}});
  std::string before = read_bytes(path);
  TensorList bad = {
      {"a", at::ones({1000})}, {"b", at::ones({2}, at::kComplexFloat)}, {"c", at::ones({3})}};
  EXPECT_THROW(save_safetensors(path, bad), Error);
  TensorList dup = {{"a", at::ones({1})}, {"a", at::ones({1})}};
  EXPECT_THROW(save_safetensors(path, dup), InputError);
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", at::ones({1})}}), InputError);
  EXPECT_EQ(read_bytes(path), before);
  // No temporary left behind.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  // A folder that does not exist: a clear error, nothing created.
  EXPECT_THROW(save_safetensors(dir.file("no/such/dir/x.safetensors"), {{"a", at::ones({1})}}),
               Error);
}

TEST(Safetensors, AcceptsWhatTheReferenceAccepts) {
  TempDir dir;
  // A misaligned F32 after one byte (legal; the reader copies it into aligned memory), a null
  // __metadata__, leading whitespace and unknown extra fields, as Python safetensors accepts.
  float v = 1.5f;
  std::string data(1, '\x07');
  data.append(reinterpret_cast<const char*>(&v), 4);
  std::string header =
      R"( {"__metadata__":null,"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("f":{"dtype":"F32","shape":[],"data_offsets":[1,5],"extra":true}})";
  std::string path = dir.file("odd.safetensors");
  write_bytes(path, raw_file(header, data));
  for (const TensorList& got : {load_safetensors(path), load_safetensors_copy(path)}) {
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].first, "u");
    EXPECT_EQ(got[0].second.item<uint8_t>(), 7);
    EXPECT_EQ(got[1].first, "f");
    EXPECT_EQ(got[1].second.item<float>(), 1.5f);
  }
  EXPECT_EQ(reinterpret_cast<uintptr_t>(load_safetensors(path)[1].second.data_ptr()) % 4, 0u);
}

// ---- hostile files
// -------------------------------------------------------------------------------

TEST(SafetensorsCorrupt, EachViolationIsAnInputError) {
  TempDir dir;
  auto put = [&](const std::string& name, const std::string& bytes) {
    std::string p = dir.file(name);
    write_bytes(p, bytes);
    return p;
  };
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data(8, '\x01');
  // The valid one loads.
  EXPECT_EQ(load_safetensors(put("good", raw_file(good, data))).size(), 1u);

  expect_input_error(put("short", std::string("\x05\0\0", 3)), "shorter than the 8-byte");
  expect_input_error(put("truncated", raw_file(good, data).substr(0, 8 + good.size() + 3)),
                     "truncated");
  expect_input_error(put("len_past_end", raw_file(good, data).replace(0, 1, "\xff")),
                     "past the end");
  {
    std::string huge = raw_file(good, data);
    for (int i = 0; i < 8; ++i) huge[i] = '\x7f';
    expect_input_error(put("huge", huge), "exceeds the limit");
  }
  expect_input_error(put("bad_json", raw_file(R"({"a":{"dtype":"F32",)", data)), "header");
  expect_input_error(put("trailing_junk", raw_file(good + "x", data)), "trailing");
  expect_input_error(put("not_object", raw_file("[1,2]", "")), "must be a JSON object");
  expect_input_error(
      put("unknown_dtype",
          raw_file(R"({"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", data)),
      "\"F7\"");
  expect_input_error(
      put("wrong_size",
          raw_file(R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,8]}})", data)),
      "needs 4");
  expect_input_error(
      put("overlap", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                              data)),
      "overlaps");
  expect_input_error(
      put("gap", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data)),
      "gap");
  expect_input_error(
      put("not_covering",
          raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data)),
      "trailing bytes");
  expect_input_error(
      put("past_data",
          raw_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data)),
      "truncated");
  expect_input_error(
      put("reversed", raw_file(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", data)),
      "end before");
  expect_input_error(
      put("neg_shape",
          raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data)),
      "non-negative");
  expect_input_error(
      put("float_offset",
          raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}})", data)),
      "non-negative integer");
  expect_input_error(
      put("three_offsets",
          raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", data)),
      "[begin, end]");
  expect_input_error(
      put("missing_dtype", raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", data)),
      "needs dtype");
  expect_input_error(
      put("overflow",
          raw_file(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                   data)),
      "too many elements");
  expect_input_error(
      put("meta_int",
          raw_file(
              R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
              data)),
      "__metadata__");
  expect_input_error(put("dup", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                         R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                         data)),
                     "duplicate");
  expect_input_error(
      put("bad_utf8",
          raw_file("{\"\xff\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data)),
      "UTF-8");
  expect_input_error(put("deep", raw_file(std::string(100000, '[') + std::string(100000, ']'), "")),
                     "deeper");
  // Not a file at all.
  EXPECT_THROW(SafetensorsReader(dir.file("missing")), InputError);
  EXPECT_THROW(SafetensorsReader(dir.path().string()), InputError);
}

TEST(SafetensorsCorrupt, FuzzNeverCrashes) {
  TempDir dir;
  std::string path = dir.file("fuzz.safetensors");
  TensorList in = {
      {"w", at::randn({3, 4})}, {"b", at::arange(5, at::kShort)}, {"m", at::ones({2}, at::kBool)}};
  save_safetensors(path, in, {{"format", "pt"}});
  const std::string valid = read_bytes(path);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<unsigned char>(valid[i]);
  const std::string alphabet = "{}[]\",:0123456789-.eE \\abcdefnrstu_FIUBLO8";
  std::mt19937_64 rng(12345);
  int ok = 0, rejected = 0;
  uint64_t checksum = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = valid;
    int kind = static_cast<int>(rng() % 5);
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      if (kind == 0) {  // the length field
        bytes[rng() % 8] = static_cast<char>(rng());
      } else if (kind == 1) {  // a random byte of the header
        bytes[8 + rng() % hlen] = static_cast<char>(rng());
      } else if (kind == 2) {  // a JSON-ish character of the header
        bytes[8 + rng() % hlen] = alphabet[rng() % alphabet.size()];
      } else if (kind == 3) {  // a digit of the header (offsets, shapes)
        size_t pos = 8 + rng() % hlen;
        if (bytes[pos] >= '0' && bytes[pos] <= '9')
          bytes[pos] = static_cast<char>('0' + rng() % 10);
      } else {  // truncate or extend the file
        if (rng() % 2) {
          bytes.resize(rng() % (bytes.size() + 1));
        } else {
          bytes.append(1 + rng() % 16, '\0');
        }
      }
    }
    // A fresh name per case: ext4 flushes a file that is truncated and rewritten on close.
    const std::string case_path = dir.file("case" + std::to_string(iter));
    write_bytes(case_path, bytes);
    try {
      TensorList got = load_safetensors(case_path);
      for (auto& [n, t] : got) {  // touch every byte the views claim
        const unsigned char* p = static_cast<const unsigned char*>(t.data_ptr());
        for (int64_t i = 0; i < t.numel() * static_cast<int64_t>(t.element_size()); ++i)
          checksum += p[i];
      }
      TensorList copied = load_safetensors_copy(case_path);
      ASSERT_EQ(copied.size(), got.size());
      ++ok;
    } catch (const InputError&) {
      ++rejected;
    }
    fs::remove(case_path);
  }
  EXPECT_GT(rejected, 1000);
  EXPECT_GT(ok, 0);
  EXPECT_GE(checksum, 0u);
}
