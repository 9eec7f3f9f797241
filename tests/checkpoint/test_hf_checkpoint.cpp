// HF checkpoint layout: sharded save and reload, index content, stale shards, loading into a
// module (strict errors name every offending tensor), atomic files and staged folders.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>

#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "common/temp_dir.h"

namespace fs = std::filesystem;
using namespace colossal;
using namespace colossal::checkpoint;

namespace {

using colossal::tests::TempDir;

std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

void expect_same(const TensorList& a, const TensorList& b) {
  ASSERT_EQ(a.size(), b.size());
  std::map<std::string, at::Tensor> mb(b.begin(), b.end());
  for (const auto& [n, t] : a) {
    ASSERT_TRUE(mb.count(n)) << n;
    EXPECT_TRUE(at::equal(t, mb[n])) << n;
  }
}

struct Block : torch::nn::Module {
  Block() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    scale = register_parameter("scale", at::ones({3}));
    steps = register_buffer("steps", at::zeros({1}, at::kLong));
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor scale, steps;
};

struct Net : torch::nn::Module {
  Net() {
    embed = register_parameter("embed", at::zeros({10, 4}));
    block = register_module("block", std::make_shared<Block>());
  }
  at::Tensor embed;
  std::shared_ptr<Block> block;
};

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

}  // namespace

TEST(HfCheckpoint, SingleFileRoundTrip) {
  TempDir dir;
  TensorList in = {{"a", at::randn({8, 8})},
                   {"b", at::arange(10, at::kLong)},
                   {"c", at::randn({3}).to(at::kBFloat16)}};
  save_state_dict(dir.file("ck"), in);
  EXPECT_EQ(files_in(dir.file("ck")), (std::set<std::string>{"model.safetensors"}));
  expect_same(load_state_dict(dir.file("ck")), in);
  expect_same(load_state_dict(dir.file("ck/model.safetensors")), in);
  Metadata md;
  load_safetensors(dir.file("ck/model.safetensors"), &md);
  EXPECT_EQ(md.at("format"), "pt");  // transformers refuses files without it
}

TEST(HfCheckpoint, ShardedRoundTripAndIndex) {
  TempDir dir;
  // 1 MB shards: 600 KB tensors give one tensor per shard; a 2 MB tensor gets its own shard and
  // the small ones after it start the next.
  TensorList in;
  for (int i = 0; i < 5; ++i) in.emplace_back("layer" + std::to_string(i), at::randn({150 * 1024}));
  in.emplace_back("big", at::randn({512 * 1024}));
  in.emplace_back("tiny1", at::randn({10}));
  in.emplace_back("tiny2", at::arange(3, at::kInt));
  SaveOptions opts;
  opts.size_per_shard_mb = 1;
  std::string ck = dir.file("ck");
  save_state_dict(ck, in, opts);
  std::set<std::string> expected = {"model.safetensors.index.json"};
  for (int k = 1; k <= 7; ++k)
    expected.insert("model-0000" + std::to_string(k) + "-of-00007.safetensors");
  EXPECT_EQ(files_in(ck), expected);

  json::Value index = json::parse_file(ck + "/model.safetensors.index.json");
  uint64_t total = 0, params = 0;
  for (const auto& [n, t] : in) {
    total += t.numel() * t.element_size();
    params += t.numel();
  }
  EXPECT_EQ(index.at("metadata").at("total_size").as_int(), static_cast<int64_t>(total));
  EXPECT_EQ(index.at("metadata").at("total_parameters").as_int(), static_cast<int64_t>(params));
  EXPECT_EQ(index.at("weight_map").at("layer0").as_string(), "model-00001-of-00007.safetensors");
  EXPECT_EQ(index.at("weight_map").at("big").as_string(), "model-00006-of-00007.safetensors");
  EXPECT_EQ(index.at("weight_map").at("tiny1").as_string(), "model-00007-of-00007.safetensors");
  EXPECT_EQ(index.at("weight_map").at("tiny2").as_string(), "model-00007-of-00007.safetensors");
  // No shard exceeds the limit unless it is a single tensor larger than it.
  for (const auto& f : expected) {
    if (f.find("-of-") == std::string::npos) continue;
    TensorList shard = load_safetensors(ck + "/" + f);
    ASSERT_FALSE(shard.empty()) << f;
    uint64_t bytes = 0;
    for (const auto& [n, t] : shard) bytes += t.numel() * t.element_size();
    EXPECT_TRUE(bytes <= 1024 * 1024 || shard.size() == 1 || shard[0].first == "big") << f;
  }

  expect_same(load_state_dict(ck), in);
  expect_same(load_state_dict(ck + "/model.safetensors.index.json"), in);

  // Saving again unsharded removes the shards and the index, after writing the new file, and
  // leaves files that are not this prefix's checkpoint alone.
  for (const char* keep : {"config.json", "other-00001-of-00002.safetensors",
                           "model-00001-of-00007.safetensors.bak"}) {
    std::ofstream(ck + "/" + keep) << "x";
  }
  opts.shard = false;
  save_state_dict(ck, in, opts);
  EXPECT_EQ(files_in(ck), (std::set<std::string>{"model.safetensors", "config.json",
                                                 "other-00001-of-00002.safetensors",
                                                 "model-00001-of-00007.safetensors.bak"}));
  for (const char* keep : {"config.json", "other-00001-of-00002.safetensors",
                           "model-00001-of-00007.safetensors.bak"}) {
    fs::remove(ck + "/" + keep);
  }
  expect_same(load_state_dict(ck), in);
  // And sharded again with fewer shards: the old single file goes.
  opts.shard = true;
  opts.size_per_shard_mb = 3;
  save_state_dict(ck, in, opts);
  EXPECT_EQ(files_in(ck).count("model.safetensors"), 0u);
  expect_same(load_state_dict(ck), in);
}

TEST(HfCheckpoint, IndexErrorsNameTheShard) {
  TempDir dir;
  TensorList in = {{"a", at::randn({300 * 1024})}, {"b", at::randn({300 * 1024})}};
  SaveOptions opts;
  opts.size_per_shard_mb = 1;
  std::string ck = dir.file("ck");
  save_state_dict(ck, in, opts);
  fs::remove(ck + "/model-00002-of-00002.safetensors");
  std::string msg = message_of([&] { load_state_dict(ck); });
  EXPECT_NE(msg.find("model-00002-of-00002.safetensors"), std::string::npos) << msg;
  EXPECT_NE(message_of([&] { load_state_dict(dir.file("nothing")); }).find("does not exist"),
            std::string::npos);
  fs::create_directories(dir.file("empty"));
  EXPECT_NE(message_of([&] { load_state_dict(dir.file("empty")); }).find("model.safetensors"),
            std::string::npos);
  // An index that escapes the folder is refused.
  std::ofstream(dir.file("evil.json")) << R"({"weight_map": {"a": "../../etc/passwd"}})";
  EXPECT_NE(
      message_of([&] { load_state_dict(dir.file("evil.json")); }).find("not a plain relative path"),
      std::string::npos);
}

TEST(HfCheckpoint, SaveRejectsBadListBeforeWriting) {
  TempDir dir;
  std::string ck = dir.file("ck");
  TensorList good = {{"a", at::ones({4})}};
  save_state_dict(ck, good);
  TensorList bad = {{"a", at::zeros({4})}, {"z", at::ones({2}, at::kComplexDouble)}};
  EXPECT_THROW(save_state_dict(ck, bad), Error);
  expect_same(load_state_dict(ck), good);
  EXPECT_EQ(files_in(ck), (std::set<std::string>{"model.safetensors"}));
}

TEST(HfCheckpoint, ModuleStateAndLoad) {
  Net src, dst;
  TensorList state = module_state(src);
  std::vector<std::string> names;
  for (const auto& [n, t] : state) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"embed", "block.scale", "block.steps",
                                             "block.fc.weight", "block.fc.bias"}));
  {
    at::NoGradGuard g;
    src.embed.normal_();
    src.block->steps.fill_(7);
  }
  TempDir dir;
  // Saved as bf16: loading converts to the module's dtype.
  TensorList to_save;
  for (const auto& [n, t] : module_state(src)) to_save.emplace_back(n, t.detach());
  save_state_dict(dir.file("ck"), to_save);
  load_into_module(dst, load_state_dict(dir.file("ck")));
  for (const auto& [n, t] : module_state(dst)) {
    bool found = false;
    for (const auto& [m, u] : module_state(src)) {
      if (m == n) {
        EXPECT_TRUE(at::equal(t, u)) << n;
        found = true;
      }
    }
    EXPECT_TRUE(found) << n;
  }
  // Converting dtype on load.
  TensorList half;
  for (const auto& [n, t] : to_save)
    half.emplace_back(n, t.is_floating_point() ? t.to(at::kDouble) : t);
  Net third;
  load_into_module(third, half);
  EXPECT_TRUE(at::equal(third.embed, src.embed));
  EXPECT_EQ(third.embed.scalar_type(), at::kFloat);
}

TEST(HfCheckpoint, StrictErrorsNameEveryTensor) {
  Net net;
  TensorList state;
  for (const auto& [n, t] : module_state(net)) state.emplace_back(n, t.detach().clone());
  at::Tensor before = net.embed.detach().clone();

  TensorList bad;
  for (const auto& [n, t] : state) {
    if (n == "block.scale" || n == "block.steps") continue;  // two missing
    if (n == "embed") {
      bad.emplace_back(n, at::ones({11, 4}));  // wrong shape
    } else if (n == "block.fc.bias") {
      bad.emplace_back(n, at::ones({4}));  // wrong shape
    } else {
      bad.emplace_back(n, t);
    }
  }
  bad.emplace_back("extra.one", at::ones({1}));
  bad.emplace_back("extra.two", at::ones({1}));
  std::string msg = message_of([&] { load_into_module(net, bad); });
  for (const char* n : {"block.scale", "block.steps", "embed", "block.fc.bias", "extra.one",
                        "extra.two", "[11, 4]"}) {
    EXPECT_NE(msg.find(n), std::string::npos) << n << " not named in: " << msg;
  }
  EXPECT_TRUE(at::equal(net.embed, before));  // nothing copied on failure

  // Non-strict: missing and unexpected are tolerated, shape mismatches are not.
  TensorList partial = {{"embed", at::full({10, 4}, 2.0)}, {"unknown", at::ones({1})}};
  load_into_module(net, partial, /*strict=*/false);
  EXPECT_TRUE(at::equal(net.embed, at::full({10, 4}, 2.0)));
  EXPECT_THROW(load_into_module(net, {{"embed", at::ones({3})}}, false), InputError);
}

TEST(AtomicWrites, FailedWriteKeepsOldFile) {
  TempDir dir;
  std::string p = dir.file("f.txt");
  write_file_atomic(p, [&](int fd) { write_all(fd, "old", 3, p); });
  EXPECT_THROW(write_file_atomic(p,
                                 [&](int fd) {
                                   write_all(fd, "new-partial", 11, p);
                                   throw Error("simulated crash mid-write");
                                 }),
               Error);
  std::ifstream f(p);
  std::string s((std::istreambuf_iterator<char>(f)), {});
  EXPECT_EQ(s, "old");
  EXPECT_EQ(files_in(dir.file("")), (std::set<std::string>{"f.txt"}));
}

TEST(AtomicWrites, StagedDirectorySwapsWholeFolder) {
  TempDir dir;
  std::string target = dir.file("ckpt");
  // The leftover of a crashed save is cleared, not published.
  fs::create_directories(target + ".staging");
  std::ofstream(target + ".staging/junk.txt") << "x";
  {
    StagedDirectory s(target);
    EXPECT_EQ(s.path(), target + ".staging");
    save_state_dict(s.path(), {{"v", at::full({2}, 1.0)}});
    EXPECT_FALSE(fs::exists(target));
    s.commit();
  }
  EXPECT_TRUE(at::equal(load_state_dict(target)[0].second, at::full({2}, 1.0)));
  EXPECT_FALSE(fs::exists(target + "/junk.txt"));
  // A save that fails midway leaves the previous folder as it was, and no staging folder.
  try {
    StagedDirectory s(target);
    save_state_dict(s.path(), {{"v", at::full({2}, 2.0)}});
    throw Error("simulated failure before commit");
  } catch (const Error&) {
  }
  EXPECT_TRUE(at::equal(load_state_dict(target)[0].second, at::full({2}, 1.0)));
  EXPECT_EQ(files_in(dir.file("")), (std::set<std::string>{"ckpt"}));
  // A committed second save replaces it completely (old files do not survive).
  std::ofstream(target + "/stale.txt") << "x";
  {
    StagedDirectory s(target);
    save_state_dict(s.path(), {{"v", at::full({2}, 3.0)}});
    s.commit();
  }
  EXPECT_TRUE(at::equal(load_state_dict(target)[0].second, at::full({2}, 3.0)));
  EXPECT_FALSE(fs::exists(target + "/stale.txt"));
  EXPECT_EQ(files_in(dir.file("")), (std::set<std::string>{"ckpt"}));
}
