#include <gtest/gtest.h>

#include "colossal/core/error.h"
#include "colossal/core/json.h"

using colossal::json::parse;
using colossal::json::Value;

TEST(Json, RoundTrip) {
  std::string text =
      R"({"a": 1, "b": [true, false, null, -2.5e3, "x\"y\u00e9"], "c": {"d": 18446744073709551615}})";
  Value v = parse(text);
  EXPECT_EQ(v.at("a").as_int(), 1);
  EXPECT_EQ(v.at("b").as_array().size(), 5u);
  EXPECT_DOUBLE_EQ(v.at("b").as_array()[3].as_double(), -2500.0);
  EXPECT_EQ(v.at("b").as_array()[4].as_string(), "x\"y\xc3\xa9");
  EXPECT_TRUE(v.at("c").at("d").is_number());
  EXPECT_EQ(parse(v.dump()), v);
  EXPECT_EQ(parse(v.dump(2)), v);
}

TEST(Json, ErrorsNamePosition) {
  try {
    parse("{\n  \"a\": [1, 2,]\n}", "config.json");
    FAIL();
  } catch (const colossal::InputError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("config.json"), std::string::npos) << m;
    EXPECT_NE(m.find("line 2"), std::string::npos) << m;
  }
  EXPECT_THROW(parse("{\"a\":1,\"a\":2}"), colossal::InputError);
  EXPECT_THROW(parse("[1] x"), colossal::InputError);
  EXPECT_THROW(parse("\"abc"), colossal::InputError);
  EXPECT_THROW(parse(std::string(1000, '[')), colossal::InputError);
  EXPECT_THROW(parse("{\"a\":1}").at("b"), colossal::InputError);
  EXPECT_THROW(parse("{\"a\":1.5}").at("a").as_int("a"), colossal::InputError);
}
