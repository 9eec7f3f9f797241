// The tokenizer's C++ API on a hand-written tokenizer.json (merges worked out by hand), its
// concurrency, and the named errors of malformed files. Identity with the `tokenizers` package
// on trained files is test_tokenizer_hf.py's.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <thread>

#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/data/tokenizer.h"
#include "common/temp_dir.h"

using namespace colossal;
using colossal::data::Tokenizer;

namespace {

// Byte-level: a=0 b=1 c=2 Ġ(space)=3 ab=4 abc=5 Ġa=6; <|bos|>=10 special, <x>=11 not special.
const char* kTiny = R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 10, "content": "<|bos|>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 11, "content": "<x>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": false}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
               {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [],
    "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [10], "tokens": ["<|bos|>"]}}},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false,
            "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "abc": 5, "Ġa": 6},
            "merges": ["a b", ["ab", "c"], "Ġ a"]}
})";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

json::Value tiny() {
  return json::parse(kTiny);
}

}  // namespace

TEST(Tokenizer, EncodesDecodesByHand) {
  auto t = Tokenizer::from_json(kTiny, "tiny.json");
  // "abc" merges fully; in "Ġab" the lower-ranked a+b wins over Ġ+a, and Ġ+ab is no merge.
  EXPECT_EQ(t.encode("abc ab"), (std::vector<int32_t>{10, 5, 3, 4}));
  EXPECT_EQ(t.encode("abc ab", false), (std::vector<int32_t>{5, 3, 4}));
  EXPECT_EQ(t.encode("", false), std::vector<int32_t>{});
  EXPECT_EQ(t.encode(""), std::vector<int32_t>{10});
  EXPECT_EQ(t.encode("a<x>a<|bos|>", false), (std::vector<int32_t>{0, 11, 0, 10}));
  EXPECT_EQ(t.decode({10, 5, 3, 4}), "<|bos|>abc ab");
  EXPECT_EQ(t.decode({10, 5, 3, 4, 11}, true), "abc ab<x>");
  EXPECT_EQ(t.decode({5, 999, -1}), "abc");  // unknown ids are dropped, as the package does
  EXPECT_EQ(t.vocab_size(), 12);
  EXPECT_EQ(t.token_to_id("abc"), 5);
  EXPECT_EQ(t.token_to_id("<|bos|>"), 10);
  EXPECT_FALSE(t.token_to_id("zzz").has_value());
  EXPECT_EQ(t.id_to_token(6), "Ġa");
  EXPECT_EQ(t.id_to_token(7), "");
  EXPECT_TRUE(t.is_special(10));
  EXPECT_FALSE(t.is_special(11));
  EXPECT_EQ(t.bos_id(), 10);
  EXPECT_FALSE(t.eos_id().has_value());
  // A character outside the vocabulary with no unk_token is dropped (the package's BPE).
  EXPECT_EQ(t.encode("adz", false), (std::vector<int32_t>{0}));
}

TEST(Tokenizer, InvalidUtf8IsANamedError) {
  auto t = Tokenizer::from_json(kTiny, "tiny.json");
  std::string e = error_of([&] { t.encode(std::string("ab\xC3(", 4)); });
  EXPECT_NE(e.find("not valid UTF-8"), std::string::npos) << e;
  EXPECT_NE(e.find("byte offset 2"), std::string::npos) << e;
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  auto t = Tokenizer::from_json(kTiny, "tiny.json");
  std::vector<std::string> texts;
  uint64_t x = 12345;
  for (int i = 0; i < 2000; ++i) {
    std::string s;
    for (int k = 0; k < 1 + i % 17; ++k) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      s.push_back("abc  ab"[(x >> 33) % 7]);
    }
    texts.push_back(s);
  }
  std::vector<std::vector<int32_t>> want;
  for (const auto& s : texts) want.push_back(t.encode(s));
  std::vector<std::thread> threads;
  std::vector<int> bad(8, 0);
  for (int w = 0; w < 8; ++w)
    threads.emplace_back([&, w] {
      for (size_t i = 0; i < texts.size(); ++i)
        if (t.encode(texts[(i + w * 97) % texts.size()]) != want[(i + w * 97) % texts.size()])
          ++bad[w];
    });
  for (auto& th : threads) th.join();
  for (int w = 0; w < 8; ++w) EXPECT_EQ(bad[w], 0) << "thread " << w;
}

TEST(Tokenizer, MalformedFilesNameFileAndField) {
  auto expect = [](const json::Value& v, std::vector<std::string> parts) {
    std::string e = error_of([&] { Tokenizer::from_json(v.dump(), "bad.json"); });
    ASSERT_FALSE(e.empty()) << v.dump();
    EXPECT_NE(e.find("bad.json"), std::string::npos) << e;
    for (const auto& p : parts) EXPECT_NE(e.find(p), std::string::npos) << e << " lacks " << p;
  };
  auto edit = [](const std::function<void(json::Value&)>& f) {
    json::Value v = tiny();
    f(v);
    return v;
  };
  auto model = [](json::Value& v) -> json::Value& {
    for (auto& [k, x] : v.as_object_mut())
      if (k == "model") return x;
    throw std::logic_error("no model");
  };
  EXPECT_NE(error_of([] { Tokenizer::from_json("{not json", "bad.json"); }).find("bad.json"),
            std::string::npos);
  expect(json::Value::object(), {"model", "missing"});
  expect(edit([&](json::Value& v) { model(v).set("type", "WordPiece"); }),
         {"model.type", "WordPiece"});
  expect(edit([&](json::Value& v) { model(v).set("merges", json::parse(R"(["a q"])")); }),
         {"model.merges[0]", "'q'"});
  expect(edit([&](json::Value& v) { model(v).set("merges", json::parse(R"(["a b c"])")); }),
         {"model.merges[0]", "two tokens"});
  expect(edit([&](json::Value& v) { model(v).set("merges", json::parse(R"(["b c"])")); }),
         {"model.merges[0]", "'bc'"});
  expect(edit([&](json::Value& v) { model(v).set("vocab", json::parse(R"({"a": -3})")); }),
         {"model.vocab", "-3"});
  expect(edit([&](json::Value& v) { model(v).set("dropout", 0.1); }), {"model.dropout"});
  expect(edit([&](json::Value& v) {
           model(v).set("vocab", json::Value(json::Value::Object{{"a\xff", json::Value(0)}}));
         }),
         {"model.vocab", "UTF-8"});
  expect(edit([&](json::Value& v) { model(v).set("unk_token", "<unk>"); }),
         {"model.unk_token", "<unk>"});
  expect(edit([](json::Value& v) { v.set("normalizer", json::parse(R"({"type": "Bert"})")); }),
         {"normalizer", "'Bert'"});
  expect(edit([](json::Value& v) {
           v.set("pre_tokenizer", json::parse(R"({"type": "Sequence", "pretokenizers":
                   [{"type": "ByteLevel"}, {"type": "Whitespace"}]})"));
         }),
         {"pre_tokenizer.pretokenizers[1]", "'Whitespace'"});
  expect(edit([](json::Value& v) {
           v.set("pre_tokenizer", json::parse(R"({"type": "Split", "behavior": "Isolated",
                   "pattern": {"Regex": "(unclosed"}})"));
         }),
         {"pre_tokenizer.pattern", "does not compile"});
  expect(edit([](json::Value& v) {
           v.set("pre_tokenizer", json::parse(R"({"type": "Split", "behavior": "Sideways",
                   "pattern": {"String": " "}})"));
         }),
         {"pre_tokenizer", "Sideways"});
  expect(edit([](json::Value& v) { v.set("decoder", json::parse(R"({"type": "CTC"})")); }),
         {"decoder", "'CTC'"});
  expect(edit([](json::Value& v) {
           v.set("post_processor", json::parse(R"({"type": "TemplateProcessing",
                   "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                              {"Sequence": {"id": "A", "type_id": 0}}],
                   "special_tokens": {}})"));
         }),
         {"post_processor.special_tokens", "<s>"});
  expect(edit([](json::Value& v) {
           v.set("added_tokens", json::parse(R"([{"id": -1, "content": "<q>"}])"));
         }),
         {"added_tokens[0].id"});
}

TEST(Tokenizer, FromFileNamesMissingFile) {
  colossal::tests::TempDir d;
  std::string e = error_of([&] { Tokenizer::from_file(d.file("absent.json")); });
  EXPECT_NE(e.find("absent.json"), std::string::npos) << e;
  std::ofstream(d.file("t.json")) << kTiny;
  EXPECT_EQ(Tokenizer::from_file(d.file("t.json")).encode("ab", false), std::vector<int32_t>{4});
}
