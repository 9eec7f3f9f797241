// ParallelDims at world 4: a table of impossible degree / model combinations, each rejected with
// an InputError naming the degrees and the offending values; the valid layouts' axis groups hold
// the members of ColossalAI's C-order (dp, pp, tp, sp) grid, computed here independently, and a
// collective over each group sums exactly its members.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/parallel_dims.h"
#include "dist_test_env.h"

namespace colossal::dist {
namespace {

using SP = SequenceParallel;

struct Bad {
  const char* why;
  ParallelDegrees d;
  int world;
  ModelFacts model;
  std::vector<std::string> must_name;  // substrings of the message
};

ParallelDegrees deg(int dp, int pp, int tp, int sp, int ep, SP mode = SP::Off) {
  ParallelDegrees d;
  d.dp = dp;
  d.pp = pp;
  d.tp = tp;
  d.sp = sp;
  d.ep = ep;
  d.sequence_parallel = mode;
  return d;
}

ModelFacts facts(int64_t heads, int64_t kv, int64_t layers, int64_t vocab) {
  ModelFacts m;
  m.num_attention_heads = heads;
  m.num_key_value_heads = kv;
  m.num_layers = layers;
  m.vocab_size = vocab;
  return m;
}

TEST(ParallelDims, RejectsEveryImpossibleCombinationNamingTheDegrees) {
  const std::vector<Bad> table = {
      {"dp zero", deg(0, 1, 4, 1, 1), 4, {}, {"dp=0", "dp is 0"}},
      {"pp negative", deg(4, -1, 1, 1, 1), 4, {}, {"pp=-1", "pp is -1"}},
      {"tp zero", deg(4, 1, 0, 1, 1), 4, {}, {"tp=0", "tp is 0"}},
      {"sp zero", deg(4, 1, 1, 0, 1), 4, {}, {"sp=0", "sp is 0"}},
      {"ep zero", deg(4, 1, 1, 1, 0), 4, {}, {"ep=0", "ep is 0"}},
      {"product too small", deg(2, 1, 1, 1, 1), 4, {}, {"dp=2", "= 2", "4 ranks"}},
      {"product too large", deg(2, 2, 2, 1, 1), 4, {}, {"2*2*2*1", "= 8", "4 ranks"}},
      {"ep does not divide dp*sp", deg(2, 1, 2, 1, 4), 4, {}, {"ep=4", "dp*sp = 2"}},
      {"ep 3 of dp 4", deg(4, 1, 1, 1, 3), 4, {}, {"ep=3", "dp*sp = 4"}},
      {"sp without a mode", deg(2, 1, 1, 2, 1), 4, {}, {"sp=2", "sequence parallelism"}},
      {"split_gather without tp",
       deg(4, 1, 1, 1, 1, SP::SplitGather),
       4,
       {},
       {"split_gather", "tp > 1", "tp=1"}},
      {"ring without tp", deg(4, 1, 1, 1, 1, SP::Ring), 4, {}, {"ring", "tp=1"}},
      {"split_gather with sp",
       deg(1, 1, 2, 2, 1, SP::SplitGather),
       4,
       {},
       {"split_gather", "sp=2"}},
      {"all_to_all without sp",
       deg(2, 1, 2, 1, 1, SP::AllToAll),
       4,
       {},
       {"all_to_all", "sp > 1", "sp=1"}},
      {"ring_attn without sp", deg(4, 1, 1, 1, 1, SP::RingAttn), 4, {}, {"ring_attn", "sp=1"}},
      {"heads % tp", deg(1, 1, 4, 1, 1), 4, facts(6, 6, 4, 64), {"tp=4", "num_attention_heads=6"}},
      {"kv heads and tp do not divide one another",
       deg(1, 1, 4, 1, 1),
       4,
       facts(8, 6, 4, 64),
       {"tp=4", "num_key_value_heads=6"}},
      {"fewer layers than stages",
       deg(1, 4, 1, 1, 1),
       4,
       facts(8, 8, 3, 64),
       {"pp=4", "num_hidden_layers=3"}},
      {"all_to_all heads % tp*sp",
       deg(1, 1, 2, 2, 1, SP::AllToAll),
       4,
       facts(6, 2, 4, 64),
       {"tp*sp = 4", "num_attention_heads=6"}},
  };
  for (const Bad& b : table) {
    try {
      ParallelDims::validate(b.d, b.world, b.model);
      ADD_FAILURE() << b.why << ": accepted " << b.d.describe();
    } catch (const InputError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(b.d.describe()), std::string::npos) << b.why << ": " << m;
      for (const auto& s : b.must_name)
        EXPECT_NE(m.find(s), std::string::npos) << b.why << ": '" << s << "' missing in " << m;
    }
  }
  // The constructor validates too (nothing is built from bad degrees).
  EXPECT_THROW(ParallelDims(deg(2, 1, 1, 1, 1)), InputError);
  EXPECT_THROW(parse_sequence_parallel("ulysses"), InputError);
  EXPECT_EQ(parse_sequence_parallel("all_to_all"), SP::AllToAll);
}

TEST(ParallelDims, AcceptsTheBoundaryCases) {
  ParallelDims::validate(deg(4, 1, 1, 1, 4), 4, {});                  // ep = dp
  ParallelDims::validate(deg(1, 4, 1, 1, 1), 4, facts(8, 8, 4, 64));  // one layer per stage
  ParallelDims::validate(deg(1, 1, 4, 1, 1), 4, facts(8, 4, 2, 64));
  ParallelDims::validate(deg(2, 1, 2, 1, 1, SP::SplitGather), 4, facts(4, 2, 2, 64));
  ParallelDims::validate(deg(1, 1, 2, 2, 2, SP::AllToAll), 4, facts(8, 2, 2, 64));
  ParallelDims::validate(deg(2, 1, 1, 2, 4, SP::RingAttn), 4, {});    // ep over dp*sp
  ParallelDims::validate(deg(1, 1, 4, 1, 1), 4, facts(8, 2, 2, 64));  // kv heads replicated
  ParallelDims::validate(deg(1, 1, 4, 1, 1), 4, facts(8, 1, 2, 64));  // multi-query
  ParallelDims::validate(deg(2, 1, 2, 1, 1), 4, facts(8, 8, 4, 65));  // vocabulary padded
}

// Global ranks of the (dp, pp, tp, sp) grid agreeing with `me` on every axis not in `free`.
std::vector<int> members(const ParallelDegrees& d, const std::vector<int>& free, int me) {
  const std::vector<int> shape = {d.dp, d.pp, d.tp, d.sp};
  auto coord = [&](int r) {
    std::vector<int> c(4);
    for (int i = 3; i >= 0; --i) {
      c[i] = r % shape[i];
      r /= shape[i];
    }
    return c;
  };
  std::vector<int> out;
  for (int q = 0; q < d.dp * d.pp * d.tp * d.sp; ++q) {
    bool same = true;
    for (int i = 0; i < 4; ++i) {
      bool is_free = false;
      for (int f : free) is_free |= f == i;
      if (!is_free && coord(q)[i] != coord(me)[i]) same = false;
    }
    if (same) out.push_back(q);
  }
  return out;
}

void expect_group(Communicator& g, const std::vector<int>& want, const std::string& what) {
  EXPECT_EQ(g.ranks(), want) << what;
  ASSERT_EQ(g.size(), static_cast<int>(want.size())) << what;
  auto x = at::full({2}, static_cast<double>(rank() + 1), at::kDouble);
  g.all_reduce(x);
  double sum = 0;
  for (int r : want) sum += r + 1;
  EXPECT_EQ(x[0].item<double>(), sum) << what;
}

TEST(ParallelDims, AxisGroupsHoldTheirMembers) {
  ASSERT_EQ(world_size(), 4);
  const int me = rank();
  for (const ParallelDegrees& d :
       {deg(2, 1, 2, 1, 1), deg(1, 2, 2, 1, 1), deg(2, 2, 1, 1, 2),
        deg(1, 1, 2, 2, 1, SP::AllToAll), deg(2, 1, 1, 2, 2, SP::AllToAll)}) {
    ParallelDims pd(d);
    const std::string what = d.describe();
    expect_group(pd.dp(), members(d, {0}, me), what + " dp");
    expect_group(pd.pp(), members(d, {1}, me), what + " pp");
    expect_group(pd.tp(), members(d, {2}, me), what + " tp");
    expect_group(pd.sp(), members(d, {3}, me), what + " sp");
    expect_group(pd.dp_sp(), members(d, {0, 3}, me), what + " dp x sp");
    expect_group(pd.group({Axis::PP, Axis::TP}), members(d, {1, 2}, me), what + " pp x tp");
    // Expert groups: blocks of ep consecutive members of dp x sp, and the strided rest.
    const auto dsp = members(d, {0, 3}, me);
    const int i = static_cast<int>(std::find(dsp.begin(), dsp.end(), me) - dsp.begin());
    std::vector<int> ep(dsp.begin() + i / d.ep * d.ep, dsp.begin() + i / d.ep * d.ep + d.ep), edp;
    for (int k = i % d.ep; k < static_cast<int>(dsp.size()); k += d.ep) edp.push_back(dsp[k]);
    expect_group(pd.ep(), ep, what + " ep");
    expect_group(pd.ep_dp(), edp, what + " ep_dp");
  }
}

TEST(ParallelDims, TensorParallelPeersAreNeighbours) {
  ParallelDims pd(deg(2, 1, 2, 1, 1));
  const int me = rank();
  EXPECT_EQ(pd.tp().ranks(), (std::vector<int>{me / 2 * 2, me / 2 * 2 + 1}));
  EXPECT_EQ(pd.dp().ranks(), (std::vector<int>{me % 2, me % 2 + 2}));
  EXPECT_EQ(pd.mesh().num_axes(), 4);
}

}  // namespace
}  // namespace colossal::dist
