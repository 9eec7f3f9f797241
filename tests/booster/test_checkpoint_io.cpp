// Checkpoint IO belongs to the plugin: a plugin that controls its checkpoint IO gets every
// Booster save/load routed to its own CheckpointIO (a recording one here: nothing reaches the
// disk), one that does not gets DataParallelCheckpointIO, and the built-in plugins (none, ddp,
// low_level_zero, gemini) all control theirs. execute_pipeline reads support_pipeline(). One rank.
// (Temporary folders go through checkpoint::remove_tree: std::filesystem::remove_all crashes
// when linked against this LibTorch, see tests/data/test_data.cpp.)
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "colossal/booster/booster.h"
#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugins/factory.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/lr_scheduler.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;
namespace fs = std::filesystem;

struct NetImpl : torch::nn::Module {
  NetImpl() { fc = register_module("fc", torch::nn::Linear(4, 3)); }
  torch::nn::Linear fc{nullptr};
};

std::shared_ptr<optim::AdamW> make_adamw(torch::nn::Module& m) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> ps;
  for (auto& item : m.named_parameters(true)) ps.push_back({item.key(), item.value()});
  opt->add_param_group(ps, optim::GroupOptions{});
  return opt;
}

// Records every call with its arguments; writes nothing.
class RecordingIO : public booster::CheckpointIO {
 public:
  void save_model(booster::ModelWrapper&, const std::string& dir, bool shard,
                  int64_t size_per_shard_mb) override {
    calls.push_back("save_model " + dir + " " + std::to_string(shard) + " " +
                    std::to_string(size_per_shard_mb));
  }
  void load_model(booster::ModelWrapper&, const std::string& path, bool strict,
                  booster::OptimizerWrapper* optimizer) override {
    calls.push_back("load_model " + path + " " + std::to_string(strict) + " " +
                    std::to_string(optimizer != nullptr));
  }
  void save_optimizer(booster::OptimizerWrapper&, const std::string& dir) override {
    calls.push_back("save_optimizer " + dir);
  }
  void load_optimizer(booster::OptimizerWrapper&, const std::string& dir) override {
    calls.push_back("load_optimizer " + dir);
  }
  void save_lr_scheduler(optim::LRScheduler&, const std::string& file) override {
    calls.push_back("save_lr_scheduler " + file);
  }
  void load_lr_scheduler(optim::LRScheduler&, const std::string& file) override {
    calls.push_back("load_lr_scheduler " + file);
  }
  std::vector<std::string> calls;
};

// The none plugin, with the checkpoint IO and pipeline answers chosen by the test.
class TestPlugin : public booster::NonePlugin {
 public:
  TestPlugin(bool control, bool pipeline) : control_(control), pipeline_(pipeline) {}
  bool control_checkpoint_io() const override { return control_; }
  std::shared_ptr<booster::CheckpointIO> checkpoint_io() override { return io; }
  bool support_pipeline() const override { return pipeline_; }
  std::shared_ptr<RecordingIO> io = std::make_shared<RecordingIO>();

 private:
  bool control_, pipeline_;
};

fs::path fresh_dir(const std::string& name) {
  fs::path d =
      fs::temp_directory_path() / ("colossal_ckpt_io_" + name + "_" + std::to_string(::getpid()));
  checkpoint::remove_tree(d.string());
  fs::create_directories(d);
  return d;
}

TEST(CheckpointIO, BoosterCallsThePluginsOwn) {
  auto plugin = std::make_shared<TestPlugin>(/*control=*/true, /*pipeline=*/false);
  booster::Booster b(plugin);
  EXPECT_EQ(&b.checkpoint_io(), plugin->io.get());
  auto net = std::make_shared<NetImpl>();
  auto adamw = make_adamw(*net);
  optim::LRScheduler scheduler(*adamw, optim::LRScheduleOptions{});
  auto boosted = b.boost(net, adamw);
  const fs::path d = fresh_dir("own");
  const std::string dir = d.string();
  b.save_model(*boosted.model, dir + "/model", /*shard=*/true, 7);
  b.save_optimizer(*boosted.optimizer, dir);
  b.save_lr_scheduler(scheduler, dir + "/scheduler.json");
  b.load_model(*boosted.model, dir + "/model", /*strict=*/false, boosted.optimizer.get());
  b.load_optimizer(*boosted.optimizer, dir);
  b.load_lr_scheduler(scheduler, dir + "/scheduler.json");
  const std::vector<std::string> expected{"save_model " + dir + "/model 1 7",
                                          "save_optimizer " + dir,
                                          "save_lr_scheduler " + dir + "/scheduler.json",
                                          "load_model " + dir + "/model 0 1",
                                          "load_optimizer " + dir,
                                          "load_lr_scheduler " + dir + "/scheduler.json"};
  EXPECT_EQ(plugin->io->calls, expected);
  EXPECT_TRUE(fs::is_empty(d)) << "the default IO wrote files although the plugin owns its IO";
  // The Booster still checks its own arguments before delegating.
  EXPECT_THROW(b.save_model(*boosted.model, dir, false, 0), InputError);
  EXPECT_EQ(plugin->io->calls.size(), expected.size());
  checkpoint::remove_tree(d.string());
}

TEST(CheckpointIO, PluginWithoutControlGetsTheDataParallelFormats) {
  auto plugin = std::make_shared<TestPlugin>(/*control=*/false, /*pipeline=*/false);
  booster::Booster b(plugin);
  EXPECT_NE(dynamic_cast<booster::DataParallelCheckpointIO*>(&b.checkpoint_io()), nullptr);
  auto net = std::make_shared<NetImpl>();
  auto adamw = make_adamw(*net);
  auto boosted = b.boost(net, adamw);
  const fs::path d = fresh_dir("general");
  b.save_model(*boosted.model, (d / "model").string());
  b.save_optimizer(*boosted.optimizer, d.string());
  EXPECT_TRUE(plugin->io->calls.empty());
  EXPECT_TRUE(fs::exists(d / "model" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(d / "optimizer.safetensors"));
  EXPECT_TRUE(fs::exists(d / "optimizer.json"));
  checkpoint::remove_tree(d.string());
}

TEST(CheckpointIO, BuiltInPluginsControlTheirs) {
  for (const std::string name : {"none", "ddp", "low_level_zero", "gemini"}) {
    booster::PluginOptions o;
    o.name = name;
    auto plugin = booster::make_plugin(o, "cpu");
    EXPECT_TRUE(plugin->control_checkpoint_io()) << name;
    booster::Booster b(plugin);
    EXPECT_NE(dynamic_cast<booster::DataParallelCheckpointIO*>(&b.checkpoint_io()), nullptr)
        << name;
  }
}

TEST(CheckpointIO, ExecutePipelineReadsSupportPipeline) {
  auto iter = [] {
    return std::make_pair(at::zeros({1, 2}, at::kLong), at::zeros({1, 2}, at::kLong));
  };
  auto model = std::make_shared<booster::ModelWrapper>(std::make_shared<torch::nn::Module>());
  booster::Booster plain(std::make_shared<TestPlugin>(true, /*pipeline=*/false));
  try {
    plain.execute_pipeline(iter, *model);
    ADD_FAILURE() << "execute_pipeline ran on a plugin without pipeline support";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a pipeline plugin"), std::string::npos)
        << e.what();
  }
  // A plugin that says it supports pipelines is handed the call (the base class refuses it with
  // its own message when it has no stages).
  booster::Booster piped(std::make_shared<TestPlugin>(true, /*pipeline=*/true));
  try {
    piped.execute_pipeline(iter, *model);
    ADD_FAILURE() << "execute_pipeline returned without pipeline stages";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("has no pipeline stages"), std::string::npos) << e.what();
  }
}

TEST(PluginFactory, UnknownNameListsTheValidOnes) {
  booster::PluginOptions o;
  o.name = "fsdp";
  try {
    booster::make_plugin(o, "cpu");
    ADD_FAILURE() << "plugin 'fsdp' was built";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "'fsdp' is not a plugin of colossal.cpp: use none, ddp, low_level_zero, "
                  "zero1, zero2, gemini, gemini_auto, hybrid or 3d"),
              std::string::npos)
        << e.what();
  }
  o.name = "zero1";
  o.zero.stage = 2;
  EXPECT_THROW(booster::make_plugin(o, "cpu"), InputError);
}

TEST(PluginFactory, NamesPickTheStageAndPlacement) {
  booster::PluginOptions o;
  o.name = "zero2";
  auto z = std::dynamic_pointer_cast<booster::LowLevelZeroPlugin>(booster::make_plugin(o, "cpu"));
  ASSERT_TRUE(z);
  EXPECT_EQ(z->options().stage, 2);
  EXPECT_EQ(z->options().precision, "fp32");  // ddp's precision field, not zero's fp16 default
  o.name = "gemini_auto";
  auto g = std::dynamic_pointer_cast<booster::GeminiPlugin>(booster::make_plugin(o, "cpu"));
  ASSERT_TRUE(g);
  EXPECT_EQ(g->options().placement_policy, "auto");
  o.name = "gemini";
  g = std::dynamic_pointer_cast<booster::GeminiPlugin>(booster::make_plugin(o, "cpu"));
  ASSERT_TRUE(g);
  EXPECT_EQ(g->options().placement_policy, "static");
}

}  // namespace
