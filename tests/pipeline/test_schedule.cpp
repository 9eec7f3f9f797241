// Pipeline schedules: every generator over a grid of stages / micro-batches validates and holds
// the known memory bounds (1F1B: min(S - r, M) per rank, Megatron; GPipe: M; interleaved:
// Megatron's warm-up + 1), the simulator reproduces the analytic 1F1B bubble (S - 1)/(M + S - 1)
// exactly, zero-bubble styles beat 1F1B, broken tables fail with their own message, tables
// round-trip through CSV and JSON.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <string>
#include <tuple>

#include "colossal/core/error.h"
#include "colossal/pipeline/schedule.h"

namespace pp = colossal::pipeline;
using pp::Instr;
using pp::Op;

namespace {

pp::Schedule make(const std::string& style, int S, int M, int C = 1) {
  pp::ScheduleOptions o;
  o.style = style;
  o.stages = S;
  o.microbatches = M;
  o.chunks = C;
  return pp::make_schedule(o);
}

// The styles and sizes of the brief's grid: S in 2..8, M in S..4S (interleaved: multiples of S).
std::vector<std::tuple<std::string, int, int, int>> grid() {
  std::vector<std::tuple<std::string, int, int, int>> out;
  for (int S = 2; S <= 8; ++S)
    for (int M = S; M <= 4 * S; ++M) {
      for (const char* st : {"1f1b", "gpipe", "zbh1"}) out.push_back({st, S, M, 1});
      out.push_back({"zbv", S, M, 2});
      if (M % S == 0)
        for (int C : {2, 3}) out.push_back({"interleaved", S, M, C});
    }
  return out;
}

std::string expect_invalid(const pp::Schedule& s) {
  try {
    pp::validate(s);
  } catch (const colossal::InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "validate() accepted:\n" << pp::describe(s);
  return "";
}

// Position of an instruction in a rank's list (fails the test when absent).
size_t find(const pp::Schedule& s, int r, Instr in) {
  const auto& l = s.ranks[r];
  auto it = std::find(l.begin(), l.end(), in);
  EXPECT_NE(it, l.end()) << "rank " << r << " has no " << pp::to_string(in);
  return static_cast<size_t>(it - l.begin());
}

void move_before(pp::Schedule& s, int r, Instr what, Instr before) {
  auto& l = s.ranks[r];
  l.erase(l.begin() + static_cast<long>(find(s, r, what)));
  l.insert(l.begin() + static_cast<long>(find(s, r, before)), what);
}

}  // namespace

TEST(Schedule, EveryGeneratorValidatesOverTheGrid) {
  for (const auto& [st, S, M, C] : grid()) {
    SCOPED_TRACE(st + " S=" + std::to_string(S) + " M=" + std::to_string(M) +
                 " C=" + std::to_string(C));
    const pp::Schedule s = make(st, S, M, C);
    ASSERT_NO_THROW(pp::validate(s));
    ASSERT_EQ(static_cast<int>(s.ranks.size()), S);
    // Every (m, c) has its forward and backward on every rank, in the right kind.
    const bool split = st == "zbh1" || st == "zbv";
    EXPECT_EQ(s.splits_backward(), split);
    for (int r = 0; r < S; ++r) {
      std::map<std::pair<int, int>, std::string> seen;
      for (const Instr& in : s.ranks[r])
        if (pp::is_compute(in.op))
          seen[{in.mb, in.chunk}] += std::string(pp::to_string(in.op)) + ",";
      ASSERT_EQ(static_cast<int>(seen.size()), M * C);
      for (const auto& [mc, ops] : seen) EXPECT_EQ(ops, split ? "F,B,W," : "F,BW,") << r;
    }
    const auto sim = pp::simulate(s, {});
    for (int r = 0; r < S; ++r) {
      const int peak = sim.peak_activations[r];
      if (st == "1f1b") {
        EXPECT_EQ(peak, std::min(S - r, M)) << "rank " << r;  // Megatron
      } else if (st == "gpipe") {
        EXPECT_EQ(peak, M) << "rank " << r;
      } else if (st == "zbh1") {
        EXPECT_LE(peak, S) << "rank " << r;  // 1F1B's peak (rank 0's)
      } else if (st == "zbv") {
        EXPECT_LE(peak, 2 * S) << "rank " << r;  // in half-stage chunks
      } else {
        // Megatron: 2 (S - r - 1) + (C - 1) S warm-up forwards, + 1 in the steady phase.
        const int warm = 2 * (S - r - 1) + (C - 1) * S;
        EXPECT_EQ(peak, std::min(warm + 1, M * C)) << "rank " << r;
      }
    }
    if (st == "zbh1") {
      EXPECT_EQ(*std::max_element(sim.peak_activations.begin(), sim.peak_activations.end()), S);
    }
  }
}

TEST(Schedule, SameRankHandOffsHaveNoSendRecv) {
  // zbv: the turn (rank S-1, chunk 0 -> 1) and the loss on rank 0 chunk 1 are local.
  const int S = 4;
  const pp::Schedule s = make("zbv", S, 8, 2);
  EXPECT_EQ(s.virtual_stage(S - 1, 0) + 1, s.virtual_stage(S - 1, 1));
  EXPECT_EQ(s.holder(2 * S - 1), std::make_pair(0, 1));
  for (const Instr& in : s.ranks[S - 1]) {
    EXPECT_FALSE(in.op == Op::SendF && in.chunk == 0) << pp::to_string(in);
    EXPECT_FALSE(in.op == Op::RecvF && in.chunk == 1) << pp::to_string(in);
    EXPECT_FALSE(in.op == Op::SendB && in.chunk == 1) << pp::to_string(in);
    EXPECT_FALSE(in.op == Op::RecvB && in.chunk == 0) << pp::to_string(in);
  }
  for (const Instr& in : s.ranks[0]) {
    EXPECT_FALSE((in.op == Op::SendF || in.op == Op::RecvB) && in.chunk == 1);
    EXPECT_FALSE((in.op == Op::RecvF || in.op == Op::SendB) && in.chunk == 0);
  }
}

TEST(Schedule, OneFOneBMatchesTheAnalyticBubble) {
  // comm 0: step = (M + S - 1)(f + b + w), bubble = (S - 1)/(M + S - 1), for any f and b + w.
  for (auto [f, b, w] : {std::tuple{1.0, 1.0, 1.0}, std::tuple{1.0, 1.5, 0.5},
                         std::tuple{0.37, 0.5, 0.61}, std::tuple{2.5, 0.25, 0.5}})
    for (int S = 1; S <= 8; ++S)
      for (int M : {S, S + 1, 2 * S, 3 * S + 1, 4 * S, 32}) {
        if (M < S) continue;
        const auto r = pp::simulate(make("1f1b", S, M), {f, b, w, 0.0, {}, {}, {}});
        const double step = (M + S - 1) * (f + b + w);
        EXPECT_NEAR(r.step_time, step, 1e-12 * step) << "S=" << S << " M=" << M << " f=" << f;
        EXPECT_NEAR(r.bubble_fraction, double(S - 1) / (M + S - 1), 1e-12)
            << "S=" << S << " M=" << M;
        for (int k = 0; k < S; ++k) EXPECT_NEAR(r.busy[k], M * (f + b + w), 1e-12 * step);
      }
}

TEST(Schedule, GpipeMatchesTheAnalyticBubble) {
  // GPipe: (M + S - 1) f forward + (M + S - 1)(b + w) backward, the same bubble as 1F1B.
  for (int S = 1; S <= 6; ++S)
    for (int M : {1, 2, S, 3 * S}) {
      const auto r = pp::simulate(make("gpipe", S, M), {1.0, 0.75, 1.25, 0.0, {}, {}, {}});
      EXPECT_NEAR(r.step_time, (M + S - 1) * 3.0, 1e-12) << "S=" << S << " M=" << M;
    }
}

TEST(Schedule, CommCostDelaysTheCriticalPath) {
  // 1F1B, comm c: the first micro-batch crosses S - 1 links forward and S - 1 back, each c.
  for (int S = 2; S <= 6; ++S) {
    const int M = 2 * S;
    const auto r0 = pp::simulate(make("1f1b", S, M), {1, 1, 1, 0.0, {}, {}, {}});
    const auto r1 = pp::simulate(make("1f1b", S, M), {1, 1, 1, 0.1, {}, {}, {}});
    EXPECT_GE(r1.step_time, r0.step_time + 2 * (S - 1) * 0.1 - 1e-12) << S;
  }
}

TEST(Schedule, InterleavedAndZeroBubbleBeatOneFOneB) {
  for (int S = 2; S <= 8; ++S)
    for (int M = S; M <= 4 * S; M += S) {
      SCOPED_TRACE("S=" + std::to_string(S) + " M=" + std::to_string(M));
      const pp::Costs c;  // f = b = w = 1
      const double one = pp::simulate(make("1f1b", S, M), c).bubble_fraction;
      const double zbh1 = pp::simulate(make("zbh1", S, M), c).bubble_fraction;
      const double zbv = pp::simulate(make("zbv", S, M, 2), c).bubble_fraction;
      EXPECT_LT(zbh1, one);
      EXPECT_LT(zbv, one);
      // ZB-H1 (Qi et al.): the bubble shrinks from (S - 1)(f + b + w) to (S - 1)(f + b - w),
      // i.e. the step is 3 M + S - 1 at f = b = w = 1.
      EXPECT_NEAR(zbh1, double(S - 1) / (3 * M + S - 1), 1e-12);
      const double il = pp::simulate(make("interleaved", S, M, 2), c).bubble_fraction;
      EXPECT_LT(il, one);
    }
}

TEST(Schedule, ZbvIsCloseToItsLowerBound) {
  // f = b = w = 1: each rank has 6 M units of work and rank S - 1 cannot start before S - 1, so
  // no V schedule beats 6 M + S - 1; ours stays within 4 units of it.
  for (int S = 2; S <= 8; ++S)
    for (int M = S; M <= 4 * S; ++M) {
      const auto r = pp::simulate(make("zbv", S, M, 2), {});
      EXPECT_GE(r.step_time, 6 * M + S - 1) << "S=" << S << " M=" << M;
      EXPECT_LE(r.step_time, 6 * M + S + 3) << "S=" << S << " M=" << M;
    }
}

TEST(Schedule, InterleavedMatchesMegatronsBubble) {
  // Megatron (Narayanan et al. 2021): with C chunks the bubble time is (S - 1)(F + B) / C for a
  // whole stage's F and B, i.e. (S - 1)(f + b + w) in per-chunk costs: step = (M C + S - 1)(f +
  // b + w), for any costs.
  for (auto [f, b, w] :
       {std::tuple{1.0, 1.0, 1.0}, std::tuple{1.0, 0.25, 1.5}, std::tuple{2.0, 1.0, 0.5}})
    for (int S = 2; S <= 8; ++S)
      for (int C : {2, 3, 4})
        for (int M = S; M <= 4 * S; M += S) {
          const auto r = pp::simulate(make("interleaved", S, M, C), {f, b, w, 0.0, {}, {}, {}});
          const double step = (M * C + S - 1) * (f + b + w);
          EXPECT_NEAR(r.step_time, step, 1e-12 * step) << "S=" << S << " C=" << C << " M=" << M;
        }
}

TEST(Schedule, PerRankCostsAndEvents) {
  pp::Costs c;
  c.f_rank = {1, 2};
  c.b_rank = {1, 2};
  c.w_rank = {1, 2};
  const auto r = pp::simulate(make("1f1b", 2, 4), c);
  EXPECT_DOUBLE_EQ(r.busy[0], 12);
  EXPECT_DOUBLE_EQ(r.busy[1], 24);
  // Events: one per instruction, none overlapping on a rank among computes.
  size_t n = 0;
  for (const auto& l : make("1f1b", 2, 4).ranks) n += l.size();
  EXPECT_EQ(r.events.size(), n);
  c.f_rank = {1};
  EXPECT_THROW(pp::simulate(make("1f1b", 2, 4), c), colossal::InputError);
}

TEST(Validate, RejectsBrokenTables) {
  auto check = [](const pp::Schedule& s, const std::string& fragment) {
    const std::string msg = expect_invalid(s);
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank "), std::string::npos) << msg;
    return msg;
  };
  {  // A BW before its F.
    auto s = make("1f1b", 2, 2);
    move_before(s, 1, {Op::BW, 1, 0}, {Op::F, 1, 0});
    const auto msg = check(s, "BW before its F");
    EXPECT_NE(msg.find("rank 1, instruction"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(BW1.0)"), std::string::npos) << msg;
  }
  {  // A missing W.
    auto s = make("zbh1", 2, 2);
    s.ranks[0].erase(s.ranks[0].begin() + static_cast<long>(find(s, 0, {Op::W, 0, 0})));
    check(s, "no W0.0 follows");
  }
  {  // A W before its B.
    auto s = make("zbh1", 3, 3);
    move_before(s, 0, {Op::W, 1, 0}, {Op::B, 1, 0});
    check(s, "W before its B");
  }
  {  // A send to a rank that does not hold the next stage (the last stage sends forward).
    auto s = make("1f1b", 3, 3);
    auto& l = s.ranks[2];
    l.insert(l.begin() + static_cast<long>(find(s, 2, {Op::F, 0, 0})) + 1, {Op::SendF, 0, 0});
    check(s, "no next virtual stage to send to");
  }
  {  // Two sends of one pair swapped.
    auto s = make("1f1b", 3, 3);
    move_before(s, 0, {Op::SendF, 0, 0}, {Op::F, 2, 0});  // F0 F1 SendF1 SendF0 F2 ...
    check(s, "FIFO order violated");
  }
  {  // Deadlock: both ranks receive first.
    pp::Schedule s;
    s.name = "dead";
    s.stages = 2;
    s.microbatches = 1;
    s.ranks = {{{Op::RecvB, 0, 0}, {Op::F, 0, 0}, {Op::SendF, 0, 0}, {Op::BW, 0, 0}},
               {{Op::RecvF, 0, 0}, {Op::F, 0, 0}, {Op::BW, 0, 0}, {Op::SendB, 0, 0}}};
    const auto msg = check(s, "deadlock");
    EXPECT_NE(msg.find("rank 0, instruction 0 (RecvB0.0)"), std::string::npos) << msg;
    // The same table with rank 0 receiving last runs.
    s.ranks[0] = {{Op::F, 0, 0}, {Op::SendF, 0, 0}, {Op::RecvB, 0, 0}, {Op::BW, 0, 0}};
    EXPECT_NO_THROW(pp::validate(s));
  }
  {  // Send/Recv for a same-rank hand-off (the V's turn on rank S-1).
    auto s = make("zbv", 2, 2, 2);
    auto& l = s.ranks[1];
    l.insert(l.begin() + static_cast<long>(find(s, 1, {Op::F, 0, 0})) + 1, {Op::SendF, 0, 0});
    l.insert(l.begin() + static_cast<long>(find(s, 1, {Op::F, 0, 1})), {Op::RecvF, 0, 1});
    check(s, "same-rank hand-off");
  }
  {  // Micro-batch out of range.
    auto s = make("1f1b", 2, 2);
    s.ranks[1][3].mb = 2;
    check(s, "micro-batch 2 out of range");
  }
  {  // Chunk out of range, missing F, a missing SendF.
    auto s = make("1f1b", 2, 2);
    s.ranks[0][0].chunk = 1;
    check(s, "chunk 1 out of range");
    s = make("gpipe", 2, 2);
    s.ranks[0].erase(s.ranks[0].begin() + static_cast<long>(find(s, 0, {Op::SendF, 1, 0})));
    check(s, "no SendF1.0 follows");
  }
}

TEST(MakeSchedule, NamedErrors) {
  auto err = [](const std::string& st, int S, int M, int C) {
    try {
      make(st, S, M, C);
    } catch (const colossal::InputError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << st << " accepted";
    return std::string();
  };
  EXPECT_NE(err("1f1b", 4, 2, 1).find("microbatches (2) must be >= stages (4)"), std::string::npos);
  EXPECT_NE(err("zbv", 4, 8, 1).find("zbv needs chunks (num_model_chunks) == 2, got 1"),
            std::string::npos);
  EXPECT_NE(err("interleaved", 4, 8, 1).find("interleaved needs chunks"), std::string::npos);
  EXPECT_NE(err("interleaved", 4, 6, 2).find("multiple of stages"), std::string::npos);
  EXPECT_NE(err("1f1b", 4, 8, 2).find("1f1b needs chunks (num_model_chunks) == 1, got 2"),
            std::string::npos);
  EXPECT_NE(err("pipedream", 4, 8, 1).find("unknown pipeline style 'pipedream'"),
            std::string::npos);
  EXPECT_NE(err("1f1b", 0, 8, 1).find("stages"), std::string::npos);
  EXPECT_NO_THROW(make("gpipe", 4, 2, 1));  // GPipe needs no full pipeline
  EXPECT_NE(err("gpipe", 2, 1 << 21, 1).find("microbatches * chunks must be <= "),
            std::string::npos);
  pp::Schedule huge;
  huge.stages = 1;
  huge.microbatches = 1 << 20;
  huge.chunks = 1024;
  huge.ranks.resize(1);
  EXPECT_NE(expect_invalid(huge).find("microbatches * chunks (1073741824) above"),
            std::string::npos);
}

TEST(Tables, RoundTrips) {
  for (const auto& [st, S, M, C] :
       std::vector<std::tuple<std::string, int, int, int>>{{"1f1b", 4, 8, 1},
                                                           {"gpipe", 3, 2, 1},
                                                           {"interleaved", 4, 8, 2},
                                                           {"zbh1", 5, 7, 1},
                                                           {"zbv", 4, 9, 2}}) {
    const pp::Schedule s = make(st, S, M, C);
    for (const std::string& text : {pp::to_csv(s), pp::to_json(s)}) {
      const pp::Schedule t = pp::parse_schedule_table(text, "t");
      EXPECT_EQ(t.name, s.name);
      EXPECT_EQ(t.stages, s.stages);
      EXPECT_EQ(t.microbatches, s.microbatches);
      EXPECT_EQ(t.chunks, s.chunks);
      EXPECT_EQ(t.placement, s.placement);
      EXPECT_EQ(t.ranks, s.ranks) << text;
    }
  }
  // A name with spaces survives the CSV header.
  pp::Schedule named = make("1f1b", 2, 2);
  named.name = "my  own schedule";
  EXPECT_EQ(pp::parse_schedule_table(pp::to_csv(named)).name, named.name);
  EXPECT_EQ(pp::parse_schedule_table(pp::to_json(named)).name, named.name);
  // Rows of ranks may interleave; blank lines and the column header are optional.
  const auto t = pp::parse_schedule_table(
      "# stages=2 microbatches=1\n# name=hand\n0,F,0,0\n1,RecvF,0,0\n0,SendF,0,0\n\n1,F,0,0\n"
      "1,BW,0,0\n1,SendB,0,0\n0,RecvB,0,0\n0,BW,0,0\n");
  EXPECT_EQ(t.name, "hand");
  EXPECT_EQ(pp::describe(t),
            "hand: stages=2 microbatches=1 chunks=1 placement=loop\n"
            "rank 0: F0.0 SendF0.0 RecvB0.0 BW0.0\nrank 1: RecvF0.0 F0.0 BW0.0 SendB0.0\n");
}

TEST(Tables, ParseErrorsNameTheLine) {
  auto err = [](const std::string& text) {
    try {
      pp::parse_schedule_table(text, "mine.csv");
    } catch (const colossal::InputError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "accepted: " << text;
    return std::string();
  };
  const std::string head =
      "# stages=2 microbatches=1 chunks=1 placement=loop name=x\nrank,op,mb,chunk\n";
  EXPECT_NE(err(head + "0,F,0,0\n0,Fwd,0,0\n")
                .find("mine.csv line 4: unknown pipeline instruction 'Fwd'"),
            std::string::npos);
  EXPECT_NE(err(head + "0,F,0\n").find("mine.csv line 3: expected 4 columns"), std::string::npos);
  EXPECT_NE(err(head + "2,F,0,0\n").find("mine.csv line 3: rank '2' is not in 0..1"),
            std::string::npos);
  EXPECT_NE(err(head + "0,F,-1,0\n").find("line 3: micro-batch '-1'"), std::string::npos);
  EXPECT_NE(err("# stages=2 microbatches=x\n").find("mine.csv line 1: microbatches must be"),
            std::string::npos);
  EXPECT_NE(err("# stages=2 microbatches=1 placement=w\n").find("line 1: unknown placement 'w'"),
            std::string::npos);
  EXPECT_NE(err("# stages=2 colour=red\n").find("line 1: unknown header key 'colour'"),
            std::string::npos);
  EXPECT_NE(err("0,F,0,0\n").find("line 1: the header must give stages="), std::string::npos);
  // A valid table whose schedule is wrong fails validate() after parsing.
  EXPECT_NE(
      err(head + "0,F,0,0\n0,BW,0,0\n1,F,0,0\n1,BW,0,0\n").find("rank 0, instruction 1 (BW0.0)"),
      std::string::npos);
  // JSON: errors name the rank and entry, or the JSON parser's line.
  EXPECT_NE(err(R"({"stages": 1, "microbatches": 1, "ranks": [["F0.0", "BX0.0"]]})")
                .find("rank 0, entry 1"),
            std::string::npos);
  EXPECT_NE(err(R"({"stages": 1, "microbatches": 1, "ranks": [["F0"]]})").find("'F0' is not"),
            std::string::npos);
  EXPECT_NE(err("{\"stages\": 1,\n \"microbatches\": }").find("line 2"), std::string::npos);
  EXPECT_NE(err(R"({"stages": 2, "microbatches": 1, "ranks": [[]]})").find("1 lists for stages=2"),
            std::string::npos);
  EXPECT_THROW(pp::load_schedule_table("/nonexistent/x.csv"), colossal::InputError);
  EXPECT_THROW(pp::load_schedule_table("x.txt"), colossal::InputError);
}

TEST(Names, RoundTrip) {
  for (Op op : {Op::F, Op::B, Op::W, Op::BW, Op::SendF, Op::RecvF, Op::SendB, Op::RecvB})
    EXPECT_EQ(pp::parse_op(pp::to_string(op)), op);
  EXPECT_EQ(pp::to_string(Instr{Op::F, 3, 1}), "F3.1");
  EXPECT_EQ(pp::to_string(Instr{Op::SendB, 0, 0}), "SendB0.0");
  EXPECT_EQ(pp::parse_placement("v"), pp::Placement::V);
  EXPECT_THROW(pp::parse_placement("ring"), colossal::InputError);
  EXPECT_THROW(pp::parse_op("X"), colossal::InputError);
  // Placement maps are inverse of each other.
  for (auto pl : {pp::Placement::Loop, pp::Placement::V}) {
    pp::Schedule s;
    s.stages = 4;
    s.chunks = 2;
    s.placement = pl;
    for (int v = 0; v < 8; ++v) {
      auto [r, c] = s.holder(v);
      EXPECT_EQ(s.virtual_stage(r, c), v);
    }
  }
}

TEST(Timeline, SvgIsWellFormed) {
  const pp::Schedule s = make("zbv", 4, 8, 2);
  const auto r = pp::simulate(s, {});
  const std::string svg = pp::timeline_svg(s, r);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  // Tags balance: every opening tag is closed or self-closing, in order.
  std::vector<std::string> stack;
  const std::regex tag(R"(<(/?)([A-Za-z][A-Za-z0-9]*)[^>]*?(/?)>)");
  size_t rects = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tag); it != std::sregex_iterator();
       ++it) {
    const auto& m = *it;
    const std::string name = m[2];
    if (name == "rect" && m[1] != "/") ++rects;
    if (m[1] == "/") {
      ASSERT_FALSE(stack.empty()) << name;
      ASSERT_EQ(stack.back(), name);
      stack.pop_back();
    } else if (m[3] != "/") {
      stack.push_back(name);
    }
  }
  EXPECT_TRUE(stack.empty());
  size_t computes = 0;
  for (const auto& e : r.events) computes += pp::is_compute(e.instr.op);
  EXPECT_EQ(rects, computes);
  EXPECT_EQ(computes, 4u * 8 * 2 * 3);
  char title[64];
  std::snprintf(title, sizeof title, "step time %.4g", r.step_time);
  EXPECT_NE(svg.find(title), std::string::npos);
  for (int k = 0; k < 4; ++k)
    EXPECT_NE(svg.find(">rank " + std::to_string(k) + "<"), std::string::npos);
}
