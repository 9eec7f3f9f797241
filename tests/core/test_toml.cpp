// TOML subset parser: valid documents map to the expected JSON, and each error kind names
// the source, line and key.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "colossal/core/error.h"
#include "colossal/core/toml.h"

using namespace colossal;

TEST(Toml, ValidDocument) {
  const char* text = R"(# run config
name = "llama-tiny"   # trailing comment
steps = 1_000
lr = 3e-4
neg = -17
hex = 0xff
ok = true
off = false
ratio = 0.5
big = +inf
path = 'C:\raw\path'
esc = "tab\tquote\" \u00e9"

[plugin]
kind = "gemini"
shard.frac = 1.0
sizes = [1, 2,
  3, # comment inside
]
nested = [[1, 2], ["a"]]
inline = { a = 1, b.c = "x" }

[plugin.amp]
initial_scale = 65536
"quoted key" = 1
)";
  json::Value v = toml::parse(text, "run.toml");
  EXPECT_EQ(v.at("name").as_string(), "llama-tiny");
  EXPECT_EQ(v.at("steps").as_int(), 1000);
  EXPECT_TRUE(v.at("lr").is_number() && !v.at("lr").is_int());
  EXPECT_DOUBLE_EQ(v.at("lr").as_double(), 3e-4);
  EXPECT_EQ(v.at("neg").as_int(), -17);
  EXPECT_EQ(v.at("hex").as_int(), 255);
  EXPECT_TRUE(v.at("ok").as_bool());
  EXPECT_FALSE(v.at("off").as_bool());
  EXPECT_TRUE(std::isinf(v.at("big").as_double()));
  EXPECT_EQ(v.at("path").as_string(), "C:\\raw\\path");
  EXPECT_EQ(v.at("esc").as_string(), "tab\tquote\" \xc3\xa9");
  const auto& p = v.at("plugin");
  EXPECT_EQ(p.at("kind").as_string(), "gemini");
  EXPECT_DOUBLE_EQ(p.at("shard").at("frac").as_double(), 1.0);
  ASSERT_EQ(p.at("sizes").size(), 3u);
  EXPECT_EQ(p.at("sizes").as_array()[2].as_int(), 3);
  EXPECT_EQ(p.at("nested").as_array()[1].as_array()[0].as_string(), "a");
  EXPECT_EQ(p.at("inline").at("b").at("c").as_string(), "x");
  EXPECT_EQ(p.at("amp").at("initial_scale").as_int(), 65536);
  EXPECT_EQ(p.at("amp").at("quoted key").as_int(), 1);
  EXPECT_TRUE(toml::parse("").is_object());
  EXPECT_TRUE(toml::parse("# only a comment\n\n").as_object().empty());
  EXPECT_EQ(toml::parse("a = 1\r\nb = 2\r\n").at("b").as_int(), 2);
  EXPECT_EQ(toml::parse("[a.b]\nx = 1\n[a]\ny = 2\n").at("a").at("b").at("x").as_int(), 1);
}

namespace {
std::string err(const std::string& text) {
  try {
    toml::parse(text, "cfg.toml");
  } catch (const InputError& e) {
    return e.what();
  }
  return "<no error>";
}
void expect_err(const std::string& text, const std::string& line, const std::string& part) {
  std::string e = err(text);
  EXPECT_NE(e.find("cfg.toml:" + line + ":"), std::string::npos) << text << " -> " << e;
  EXPECT_NE(e.find(part), std::string::npos) << text << " -> " << e;
}
}  // namespace

TEST(Toml, ErrorsNameFileLineAndKey) {
  expect_err("a = 1\nb = 2\na = 3\n", "3", "key 'a' is defined twice");
  expect_err("[t]\nx = 1\n[t]\n", "3", "table [t] is defined twice");
  expect_err("a = 1\n[a]\n", "2", "'a' is already a value of type integer");
  expect_err("x = hello\n", "1", "strings need quotes");
  expect_err("x = hello\n", "1", "(key 'x')");
  expect_err("\n\nname = \"open\n", "3", "unterminated string");
  expect_err("x = \"bad \\q\"\n", "1", "unknown escape");
  expect_err("x = [1, 2\n", "2", "unterminated array");
  expect_err("x = 1 2\n", "1", "after the value");
  expect_err("x =\n", "1", "missing value");
  expect_err("[[servers]]\n", "1", "arrays of tables");
  expect_err("x = \"\"\"multi\"\"\"\n", "1", "multi-line strings");
  expect_err("x = 012\n", "1", "leading zeros");
  expect_err("x = 1__0\n", "1", "invalid value");
  expect_err("x = 99999999999999999999\n", "1", "64-bit range");
  expect_err("x = 1.\n", "1", "a digit must follow");
  expect_err("x = 1979-05-27\n", "1", "dates and times are not supported");
  expect_err("t = { a = 1 }\n[t]\n", "2", "inline table 't' cannot be extended");
  expect_err("= 1\n", "1", "where a key was expected");
  expect_err("a b = 1\n", "1", "expected '='");
  expect_err("x = { a = 1, a = 2 }\n", "1", "defined twice in an inline table");
  std::string e;
  try {
    toml::parse_file("/nonexistent/run.toml");
  } catch (const InputError& ex) {
    e = ex.what();
  }
  EXPECT_NE(e.find("/nonexistent/run.toml"), std::string::npos) << e;
}
