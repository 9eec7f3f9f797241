// Token files (round trips, corrupt and short files) and the sampler (formula, epochs,
// shuffle invariance across data-parallel sizes, resume).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>

#include "colossal/core/error.h"
#include "colossal/data/sampler.h"
#include "colossal/data/token_file.h"
#include "colossal/data/utf8.h"
#include "common/temp_dir.h"

using namespace colossal;
using namespace colossal::data;

namespace {
using colossal::tests::TempDir;

std::vector<int64_t> tokens(int64_t n, int64_t max) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back((i * 2654435761LL) % (max + 1));
  return t;
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

TEST(TokenFile, RoundTripsEveryFormat) {
  TempDir d;
  struct Case {
    std::string name;
    TokenFormat write, expect;
    int64_t max;
  };
  for (auto c : {Case{"a.bin", TokenFormat::RawU16, TokenFormat::RawU16, 65535},
                 Case{"a.u32.bin", TokenFormat::RawU32, TokenFormat::RawU32, 4294967295LL},
                 Case{"a.u32", TokenFormat::RawU32, TokenFormat::RawU32, 200000},
                 Case{"g.bin", TokenFormat::LlmcGpt2, TokenFormat::LlmcGpt2, 65535},
                 Case{"l.bin", TokenFormat::LlmcLlama3, TokenFormat::LlmcLlama3, 4294967295LL}}) {
    auto t = tokens(501, c.max);
    write_token_file(d.file(c.name), t, c.write);
    TokenFile f(d.file(c.name));
    EXPECT_EQ(f.format(), c.expect) << c.name;
    ASSERT_EQ(f.size(), 501) << c.name;
    for (int64_t i = 0; i < 501; ++i) ASSERT_EQ(f.token(i), t[i]) << c.name << " " << i;
    at::Tensor s = f.slice(100, 50);
    for (int64_t i = 0; i < 50; ++i) ASSERT_EQ(s[i].item<int64_t>(), t[100 + i]);
  }
  EXPECT_FALSE(
      error_of([&] { write_token_file(d.file("x.bin"), {70000}, TokenFormat::RawU16); }).empty());
}

TEST(TokenFile, CorruptAndShortFilesAreClearErrors) {
  TempDir d;
  write_token_file(d.file("g.bin"), tokens(100, 1000), TokenFormat::LlmcGpt2);
  ASSERT_EQ(::truncate(d.file("g.bin").c_str(), 1024 + 150), 0);
  std::string e = error_of([&] { TokenFile f(d.file("g.bin")); });
  EXPECT_NE(e.find(d.file("g.bin")), std::string::npos) << e;
  EXPECT_NE(e.find("100 tokens"), std::string::npos) << e;
  EXPECT_NE(e.find("1174 bytes"), std::string::npos) << e;
  // Shorter than the header, when the format is forced.
  { std::ofstream(d.file("h.bin"), std::ios::binary) << "abcd"; }
  e = error_of([&] { TokenFile f(d.file("h.bin"), TokenFormat::LlmcGpt2); });
  EXPECT_NE(e.find("shorter than the llm.c header"), std::string::npos) << e;
  // Wrong version.
  write_token_file(d.file("v.bin"), tokens(10, 1000), TokenFormat::LlmcGpt2);
  {
    std::fstream f(d.file("v.bin"), std::ios::in | std::ios::out | std::ios::binary);
    int32_t v = 3;
    f.seekp(4);
    f.write(reinterpret_cast<char*>(&v), 4);
  }
  e = error_of([&] { TokenFile f(d.file("v.bin")); });
  EXPECT_NE(e.find("unsupported llm.c version 3"), std::string::npos) << e;
  // Odd byte count for uint16, missing file.
  { std::ofstream(d.file("odd.bin"), std::ios::binary) << "abc"; }
  e = error_of([&] { TokenFile f(d.file("odd.bin")); });
  EXPECT_NE(e.find("not a multiple of the token width 2"), std::string::npos) << e;
  e = error_of([&] { TokenFile f(d.file("missing.bin")); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
  // Too short for one sample.
  write_token_file(d.file("s.bin"), tokens(8, 100), TokenFormat::RawU16);
  e = error_of([&] { TokenDataset ds(std::make_shared<TokenFile>(d.file("s.bin")), 8); });
  EXPECT_NE(e.find("fewer than one sample"), std::string::npos) << e;
  EXPECT_THROW(token_format_from_string("u8"), InputError);
}

// The load-time vocabulary check: the first position of an id >= the limit, in every format,
// across chunk boundaries, at the first and last token; -1 when all fit.
TEST(TokenFile, FirstAtOrAboveFindsTheFirstBadPosition) {
  TempDir d;
  const int64_t n = 200003;  // several scan chunks and a ragged tail
  for (auto fmt :
       {TokenFormat::RawU16, TokenFormat::RawU32, TokenFormat::LlmcGpt2, TokenFormat::LlmcLlama3}) {
    const bool wide = fmt == TokenFormat::RawU32 || fmt == TokenFormat::LlmcLlama3;
    for (int64_t pos : {int64_t{0}, int64_t{65535}, int64_t{65536}, int64_t{131077}, n - 1}) {
      std::vector<int64_t> t = tokens(n, 999);
      t[pos] = 1000;
      if (pos + 7 < n) t[pos + 7] = 60000;  // a later, larger one is not the first
      const std::string path = d.file("v" + std::to_string(pos) + ".bin");
      write_token_file(path, t, fmt);
      TokenFile f(path, fmt);
      EXPECT_EQ(f.first_at_or_above(1000), pos) << to_string(fmt) << " at " << pos;
      EXPECT_EQ(f.token(pos), 1000);
      EXPECT_EQ(f.first_at_or_above(60001), -1);
      EXPECT_EQ(f.first_at_or_above(wide ? 70000 : 65536), -1);
      EXPECT_EQ(f.first_at_or_above(0), 0);
    }
  }
  write_token_file(d.file("big.u32"), {5, 4294967295LL, 7}, TokenFormat::RawU32);
  TokenFile big(d.file("big.u32"), TokenFormat::RawU32);
  EXPECT_EQ(big.first_at_or_above(128256), 1);
  EXPECT_EQ(big.first_at_or_above(int64_t{1} << 40), -1);
}

TEST(TokenDataset, SamplesAreShiftedWindows) {
  TempDir d;
  auto t = tokens(1001, 60000);
  write_token_file(d.file("t.bin"), t, TokenFormat::RawU16);
  TokenDataset ds(std::make_shared<TokenFile>(d.file("t.bin")), 16);
  EXPECT_EQ(ds.num_samples(), 1000 / 16);
  for (int64_t k : {0L, 7L, ds.num_samples() - 1}) {
    auto [x, y] = ds.sample(k);
    for (int64_t j = 0; j < 16; ++j) {
      EXPECT_EQ(x[j].item<int64_t>(), t[k * 16 + j]);
      EXPECT_EQ(y[j].item<int64_t>(), t[k * 16 + j + 1]);
    }
  }
  auto [bx, by] = ds.batch({3, 1});
  EXPECT_TRUE(at::equal(bx[0], ds.sample(3).first));
  EXPECT_TRUE(at::equal(by[1], ds.sample(1).second));
}

TEST(Sampler, FormulaMatchesIndependentComputation) {
  const int64_t N = 97;
  struct Layout {
    int64_t B, D, A;
  };
  for (auto L :
       {Layout{1, 1, 1}, Layout{4, 2, 1}, Layout{2, 4, 3}, Layout{3, 3, 2}, Layout{5, 1, 4}}) {
    for (int64_t r = 0; r < L.D; ++r) {
      DistributedSampler s({N, L.B, L.D, r, L.A, false, 0});
      // Independent: enumerate the global stream in (step, micro, rank, row) order.
      int64_t p = 0;
      for (int64_t step = 0; step < 12; ++step)
        for (int64_t a = 0; a < L.A; ++a)
          for (int64_t rr = 0; rr < L.D; ++rr) {
            std::vector<int64_t> want;
            for (int64_t i = 0; i < L.B; ++i) want.push_back((p++) % N);
            if (rr == r) {
              EXPECT_EQ(s.indices(step, a), want) << L.B << " " << L.D << " " << L.A;
              EXPECT_EQ(s.next(), want);
            }
          }
    }
  }
}

TEST(Sampler, ShuffleInvariantAcrossWorldSizes) {
  const int64_t N = 50, G = 8;                 // global batch 8 per step
  for (int64_t step = 0; step < 20; ++step) {  // crosses several epochs
    std::multiset<int64_t> ref;
    for (int64_t D : {1, 2, 4}) {
      int64_t B = G / D;
      std::multiset<int64_t> seen;
      for (int64_t r = 0; r < D; ++r) {
        DistributedSampler s({N, B, D, r, 1, true, 1234});
        for (auto k : s.indices(step, 0)) seen.insert(k);
      }
      if (D == 1)
        ref = seen;
      else
        EXPECT_EQ(seen, ref) << "step " << step << " D " << D;
    }
    // The same with accumulation: D=2, B=2, accum=2 covers the same 8 positions.
    std::multiset<int64_t> acc;
    for (int64_t r = 0; r < 2; ++r) {
      DistributedSampler s({N, 2, 2, r, 2, true, 1234});
      for (int64_t a = 0; a < 2; ++a)
        for (auto k : s.indices(step, a)) acc.insert(k);
    }
    EXPECT_EQ(acc, ref) << "step " << step;
  }
  // Each epoch is a permutation; different epochs and seeds differ.
  auto p0 = seeded_permutation(N, 1234, 0), p1 = seeded_permutation(N, 1234, 1),
       q = seeded_permutation(N, 99, 0);
  auto sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_NE(p0, p1);
  EXPECT_NE(p0, q);
  DistributedSampler s({N, 10, 1, 0, 1, true, 1234});
  EXPECT_EQ(s.indices(5, 0)[0], p1[0]);  // position 50 = epoch 1, index 0
}

TEST(Sampler, ResumeFromState) {
  DistributedSampler a({40, 3, 2, 1, 2, true, 7});
  for (int i = 0; i < 5; ++i) a.next();
  DistributedSampler b({40, 3, 2, 1, 2, true, 7});
  b.load_state_dict(json::parse(a.state_dict().dump()));
  EXPECT_EQ(b.step(), 2);
  EXPECT_EQ(b.micro_step(), 1);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.next(), b.next());
  DistributedSampler c({40, 3, 2, 1, 2, true, 8});
  EXPECT_THROW(c.load_state_dict(a.state_dict()), InputError);               // different seed
  EXPECT_THROW(DistributedSampler({40, 3, 2, 2, 1, false, 0}), InputError);  // rank out of range
}

// The one UTF-8 validator of prepare and the tokenizers: maximal-subpart rules.
TEST(Utf8, FirstInvalidByteAndLossyReplacement) {
  using colossal::data::first_invalid_utf8;
  constexpr size_t npos = std::string_view::npos;
  EXPECT_EQ(first_invalid_utf8("plain ascii"), npos);
  EXPECT_EQ(first_invalid_utf8("caf\xC3\xA9 \xE6\x9D\xB1 \xF0\x9F\x98\x80"), npos);
  EXPECT_EQ(first_invalid_utf8("ab\xC0\xAF"), 2u);        // overlong '/'
  EXPECT_EQ(first_invalid_utf8("x\xED\xA0\x80"), 1u);     // a surrogate (U+D800)
  EXPECT_EQ(first_invalid_utf8("\xF4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(first_invalid_utf8("ok\xE6\x9D"), 2u);        // cut short
  EXPECT_EQ(first_invalid_utf8(std::string("a\0b", 3)), npos);
  EXPECT_EQ(colossal::data::utf8_lossy("a\xE6\x9D"
                                       "b\xFF"),
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD");
}
