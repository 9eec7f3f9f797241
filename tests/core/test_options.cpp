#include <gtest/gtest.h>

#include <functional>

#include "colossal/core/error.h"
#include "colossal/core/options.h"
#include "colossal/core/toml.h"
#include "common/temp_dir.h"

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
  auto cfg = colossal::json::parse(
      R"({"steps": 5, "optim": {"lr": 0.1}, "plugin": {"bucket_cap_mb": 4}})");
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
  expect_error([&] { o.apply(colossal::json::parse(R"({"optim": {"steps": 1}})"), "run.toml"); },
               "steps");
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

// Aliases: a short flag and a second long name reach the same field, in flags and files; help
// lists them; range errors name every spelling; a bool flag's bad value names the flag.
TEST(Options, AliasesReachTheSameField) {
  Cfg c;
  auto o = c.options();
  o.alias("steps", "-s").alias("steps", "num_steps").alias("shuffle", "-x");
  o.default_text("lr", "decided later");
  o.apply_flags({"-s", "7", "-x"});
  EXPECT_EQ(c.steps, 7);
  EXPECT_TRUE(c.shuffle);
  EXPECT_TRUE(o.was_set("num_steps"));
  o.apply_flags({"--num-steps=9", "-x", "false"});
  EXPECT_EQ(c.steps, 9);
  EXPECT_FALSE(c.shuffle);
  o.apply(colossal::json::parse(R"({"train": {"num_steps": 11}})"), "run.toml");
  EXPECT_EQ(c.steps, 11);
  const std::string help = o.help();
  EXPECT_NE(help.find("-s, --steps, --num_steps"), std::string::npos) << help;
  EXPECT_NE(help.find("[decided later]"), std::string::npos) << help;
  o.apply_flags({"-s", "0"});
  try {
    o.validate();
    ADD_FAILURE() << "steps 0 accepted";
  } catch (const colossal::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'steps' (-s, --num_steps) must be >= 1"),
              std::string::npos)
        << e.what();
  }
  try {
    o.apply_flags({"--shuffle", "maybe"});
    ADD_FAILURE() << "--shuffle maybe accepted";
  } catch (const colossal::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--shuffle takes true or false, got 'maybe'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(o.apply_flags({"-q", "1"}), colossal::InputError);
  EXPECT_THROW(o.alias("lr", "-s"), colossal::Error);  // taken by steps
}

namespace {
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const colossal::InputError& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

// A file passes exactly the checks a flag does: TOML's inf and nan are refused for every
// floating option, naming the option and the file (and so are flags); validate() names where a
// value out of range came from.
TEST(Options, NonFiniteRefusedFromFileAndFlags) {
  for (const char* value : {"inf", "-inf", "nan", "+inf"}) {
    Cfg c;
    auto o = c.options();
    const std::string toml = std::string("[optim]\nlr = ") + value + "\n";
    const std::string msg =
        error_of([&] { o.apply(colossal::toml::parse(toml, "run.toml"), "run.toml"); });
    EXPECT_NE(msg.find("run.toml [optim]: option 'lr' must be a finite number"), std::string::npos)
        << value << ": " << msg;
    EXPECT_DOUBLE_EQ(c.lr, 3e-4);
    const std::string top = std::string("lr = ") + value + "\n";
    EXPECT_NE(error_of([&] {
                o.apply(colossal::toml::parse(top, "top.toml"), "top.toml");
              }).find("top.toml: option 'lr' must be a finite number"),
              std::string::npos);
    const std::string flag = error_of([&] { o.apply_flags({"--lr", value}); });
    EXPECT_NE(flag.find("flag --lr must be a finite number"), std::string::npos) << flag;
  }
  Cfg c;
  auto o = c.options();
  o.apply(colossal::toml::parse("[optim]\nlr = -1.0\n", "run.toml"), "run.toml");
  const std::string msg = error_of([&] { o.validate(); });
  EXPECT_NE(msg.find("'lr' must be >= 0, got -1 (from run.toml [optim])"), std::string::npos)
      << msg;
}

// The same option at top level and in its [section] (or under two of its names) of one file is
// an error naming both places, not resolved by the order the parser reads them.
TEST(Options, OptionGivenTwiceInOneFileIsAnError) {
  Cfg c;
  auto o = c.options();
  std::string msg = error_of([&] {
    o.apply(colossal::toml::parse("lr = 0.1\n[optim]\nlr = 0.2\n", "run.toml"), "run.toml");
  });
  EXPECT_NE(msg.find("run.toml: option 'lr' is given twice, at top level and in [optim]"),
            std::string::npos)
      << msg;
  Cfg c2;
  auto o2 = c2.options();
  o2.alias("steps", "num_steps");
  msg = error_of([&] {
    o2.apply(colossal::toml::parse("num_steps = 3\n[train]\nsteps = 4\n", "run.toml"), "run.toml");
  });
  EXPECT_NE(msg.find("is given twice, at top level as 'num_steps' and in [train]"),
            std::string::npos)
      << msg;
  // Two files (or a file and a flag) still layer: the later one wins.
  Cfg c3;
  auto o3 = c3.options();
  o3.apply(colossal::toml::parse("lr = 0.1\n", "a.toml"), "a.toml");
  o3.apply(colossal::toml::parse("[optim]\nlr = 0.2\n", "b.toml"), "b.toml");
  o3.apply_flags({"--lr", "0.3"});
  EXPECT_DOUBLE_EQ(c3.lr, 0.3);
}

// --config <folder> is a named error, not an empty config (every option its default).
TEST(Options, ConfigFolderIsAnError) {
  colossal::tests::TempDir tmp;
  const std::string dir = tmp.path().string();
  const std::string msg = error_of([&] { colossal::toml::parse_file(dir); });
  EXPECT_NE(msg.find(dir + " is a folder, not a file"), std::string::npos) << msg;
  const std::string missing = error_of([&] { colossal::toml::parse_file(dir + "/none.toml"); });
  EXPECT_NE(missing.find("cannot open TOML file"), std::string::npos) << missing;
}
