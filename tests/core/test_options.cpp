#include <gtest/gtest.h>

#include "colossal/core/error.h"
#include "colossal/core/options.h"

namespace {
struct Cfg {
  int64_t steps = 10;
  double lr = 3e-4;
  bool shuffle = false;
  std::string plugin = "ddp";
  int bucket = 25;
  colossal::OptionSet options() {
    colossal::OptionSet o;
    o.add("train", "steps", &steps, "optimizer steps")
        .add("optim", "lr", &lr, "learning rate")
        .add("data", "shuffle", &shuffle, "shuffle samples")
        .add("plugin", "plugin", &plugin, "plugin", {"none", "ddp"})
        .add("plugin", "bucket_cap_mb", &bucket, "bucket size");
    o.min("steps", 1).min("lr", 0);
    return o;
  }
};
}  // namespace

TEST(Options, FileThenFlags) {
  Cfg c;
  auto o = c.options();
  auto cfg = colossal::json::parse(R"({"steps": 5, "optim": {"lr": 0.1}, "plugin": {"bucket_cap_mb": 4}})");
  o.apply(cfg, "run.toml");
  o.apply_flags({"--lr=0.5", "--shuffle", "--bucket-cap-mb", "8"});
  o.validate();
  EXPECT_EQ(c.steps, 5);
  EXPECT_DOUBLE_EQ(c.lr, 0.5);
  EXPECT_TRUE(c.shuffle);
  EXPECT_EQ(c.bucket, 8);
  EXPECT_TRUE(o.was_set("lr"));
  EXPECT_FALSE(o.was_set("plugin"));
  EXPECT_EQ(o.to_json().at("optim").at("lr").as_double(), 0.5);
}

TEST(Options, ErrorsNameTheOption) {
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected one mentioning " << needle;
    } catch (const colossal::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Cfg c;
  auto o = c.options();
  expect_error([&] { o.apply(colossal::json::parse(R"({"stepz": 1})"), "run.toml"); }, "stepz");
  expect_error([&] { o.apply(colossal::json::parse(R"({"steps": "x"})"), "run.toml"); }, "steps");
  expect_error([&] { o.apply(colossal::json::parse(R"({"optim": {"steps": 1}})"), "run.toml"); }, "steps");
  expect_error([&] { o.apply_flags({"--nope", "1"}); }, "--nope");
  expect_error([&] { o.apply_flags({"--steps", "1.5"}); }, "steps");
  expect_error([&] { o.apply_flags({"--steps"}); }, "steps");
  Cfg c2;
  auto o2 = c2.options();
  o2.apply_flags({"--steps", "0"});
  expect_error([&] { o2.validate(); }, "steps");
  Cfg c3;
  auto o3 = c3.options();
  o3.apply_flags({"--plugin", "gemini"});
  expect_error([&] { o3.validate(); }, "gemini");
}
