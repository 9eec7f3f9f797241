// make_schedule(): the generators. GPipe and 1F1B place their Send/Recv by hand, Megatron's way
// (send_forward_recv_backward, send_backward_recv_forward). Interleaved, ZB-H1 and ZB-V first
// decide each rank's compute order and then get their Send/Recv from insert_comm(), which is
// deadlock-free and FIFO-safe by construction (see there).
#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "colossal/core/error.h"
#include "colossal/pipeline/schedule.h"

namespace colossal::pipeline {
namespace {

// Does the hand-off out of (r, c) towards v + 1 (fwd) or v - 1 (!fwd) cross ranks?
bool remote(const Schedule& s, int r, int c, bool fwd) {
  const int u = s.virtual_stage(r, c) + (fwd ? 1 : -1);
  return u >= 0 && u < s.virtual_stages() && s.holder(u).first != r;
}

// GPipe and 1F1B (chunks == 1), Megatron's placement of the point-to-point calls: receive right
// before the compute, send right after it; adjacent calls form one batch, so the steady phase
// posts [SendF, RecvB] after each F and [SendB, RecvF] after each BW.
void gpipe_or_1f1b(Schedule& s, bool gpipe) {
  const int S = s.stages, M = s.microbatches;
  for (int r = 0; r < S; ++r) {
    auto& L = s.ranks[r];
    const bool prev = remote(s, r, 0, false), next = remote(s, r, 0, true);
    auto recv_f = [&](int m) {
      if (prev) L.push_back({Op::RecvF, m, 0});
    };
    auto send_f = [&](int m) {
      if (next) L.push_back({Op::SendF, m, 0});
    };
    auto recv_b = [&](int m) {
      if (next) L.push_back({Op::RecvB, m, 0});
    };
    auto send_b = [&](int m) {
      if (prev) L.push_back({Op::SendB, m, 0});
    };
    auto fwd = [&](int m) {
      recv_f(m);
      L.push_back({Op::F, m, 0});
      send_f(m);
    };
    auto bwd = [&](int m) {
      recv_b(m);
      L.push_back({Op::BW, m, 0});
      send_b(m);
    };
    if (gpipe) {
      for (int m = 0; m < M; ++m) fwd(m);
      for (int m = M - 1; m >= 0; --m) bwd(m);
      continue;
    }
    const int warm = std::min(S - r - 1, M), steady = M - warm;
    for (int m = 0; m < warm; ++m) fwd(m);
    if (steady > 0) recv_f(warm);
    for (int i = 0; i < steady; ++i) {
      L.push_back({Op::F, warm + i, 0});
      send_f(warm + i);  // with recv_b: send_forward_recv_backward
      recv_b(i);
      L.push_back({Op::BW, i, 0});
      send_b(i);  // with recv_f: send_backward_recv_forward
      if (i + 1 < steady) recv_f(warm + i + 1);
    }
    for (int m = steady; m < M; ++m) bwd(m);
  }
}

// Adds the Send/Recv of every cross-rank hand-off to per-rank compute orders with integer
// compute times (`start`; `end` gives a producer's end; `inside` the times strictly inside a
// compute, per rank). The hand-off made at the producer's end p is sent and received at the
// first time tau >= p at which neither rank is inside a compute: sent after the computes that
// start before tau, received before those that start at tau or later; tau must not pass the
// consumer's start (false otherwise). So every Send and its Recv sit at the same slot time, and
// within one slot both sides order one pair's messages by (kind, micro-batch, sender's v): the
// per-pair FIFO rule holds by construction. No deadlock either: by induction over slot times,
// every rank reaches (posts) all its operations of slot tau once those of earlier slots are
// matched, and their partners sit at slot tau too (adjacent slots merged into one batch, on a
// rank idle in between, keep this: a batch is posted at its first slot).
bool place_comm(Schedule& s, const std::vector<std::vector<Instr>>& order,
                const std::vector<std::vector<int>>& start,
                const std::vector<std::set<int>>& inside,
                const std::function<int(int, size_t)>& end) {
  const int S = s.stages;
  // The consumer's start per (rank, F or backward, micro-batch, chunk).
  std::map<std::tuple<int, bool, int, int>, int> begins;
  for (int r = 0; r < S; ++r)
    for (size_t i = 0; i < order[r].size(); ++i) {
      const Instr& in = order[r][i];
      if (in.op != Op::W) begins[{r, in.op == Op::F, in.mb, in.chunk}] = start[r][i];
    }
  // Items sorted by (time, comm before compute, tie-break).
  using Key = std::tuple<int, int, int, int, int, int, int>;
  std::vector<std::vector<std::pair<Key, Instr>>> items(S);
  for (int r = 0; r < S; ++r)
    for (size_t i = 0; i < order[r].size(); ++i) {
      const Instr& in = order[r][i];
      items[r].push_back({Key{start[r][i], 1, static_cast<int>(i), 0, 0, 0, 0}, in});
      const bool fwd = in.op == Op::F;
      if (in.op == Op::W || !remote(s, r, in.chunk, fwd)) continue;
      // A cross-rank hand-off produced here.
      const int v = s.virtual_stage(r, in.chunk);
      const auto [pr, pc] = s.holder(fwd ? v + 1 : v - 1);
      const int q = begins.at({pr, fwd, in.mb, pc});
      int tau = end(r, i);
      while (inside[r].count(tau) || inside[pr].count(tau)) ++tau;
      if (tau > q) return false;
      const int kind = fwd ? 0 : 1;
      items[r].push_back({Key{tau, 0, 0, pr, kind, in.mb, v},
                          Instr{fwd ? Op::SendF : Op::SendB, in.mb, in.chunk}});
      items[pr].push_back(
          {Key{tau, 0, 1, r, kind, in.mb, v}, Instr{fwd ? Op::RecvF : Op::RecvB, in.mb, pc}});
    }
  for (int r = 0; r < S; ++r) {
    std::stable_sort(items[r].begin(), items[r].end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    s.ranks[r].clear();
    for (const auto& [k, in] : items[r]) s.ranks[r].push_back(in);
  }
  return true;
}

// Send/Recv for per-rank compute orders (ZB-H1, ZB-V): each pass gets a unit-time slot, as
// soon as its inputs are there in its rank's order (every integer time is then a boundary), and
// place_comm() adds the messages.
void insert_comm(Schedule& s, const std::vector<std::vector<Instr>>& order) {
  const int S = s.stages, M = s.microbatches, V = s.virtual_stages();
  auto idx = [&](int m, int v) { return static_cast<size_t>(m) * V + v; };
  // Start and end times of F and of the input-gradient backward (B or BW) per (m, v).
  std::vector<int> f_start(static_cast<size_t>(M) * V, -1), b_start(f_start), f_end(f_start),
      b_end(f_start);
  std::vector<std::vector<int>> start(S);
  std::vector<std::set<int>> inside(S);  // times strictly inside a compute, per rank
  std::vector<size_t> pos(S, 0);
  std::vector<int> clock(S, 0);
  for (int r = 0; r < S; ++r) start[r].assign(order[r].size(), -1);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < S; ++r)
      while (pos[r] < order[r].size()) {
        const Instr& in = order[r][pos[r]];
        const int v = s.virtual_stage(r, in.chunk);
        int ready = 0;
        if (in.op == Op::F) {
          ready = v == 0 ? 0 : f_end[idx(in.mb, v - 1)];
        } else if (in.op == Op::B || in.op == Op::BW) {
          ready = v == V - 1 ? f_end[idx(in.mb, v)] : b_end[idx(in.mb, v + 1)];
        } else {
          ready = b_end[idx(in.mb, v)];
        }
        if (ready < 0) break;
        const int t = std::max(clock[r], ready), d = 1;
        start[r][pos[r]] = t;
        clock[r] = t + d;
        for (int k = t + 1; k < t + d; ++k) inside[r].insert(k);
        if (in.op == Op::F) {
          f_start[idx(in.mb, v)] = t;
          f_end[idx(in.mb, v)] = t + d;
        }
        if (in.op == Op::B || in.op == Op::BW) {
          b_start[idx(in.mb, v)] = t;
          b_end[idx(in.mb, v)] = t + d;
        }
        ++pos[r];
        progress = true;
      }
  }
  for (int r = 0; r < S; ++r)
    COLOSSAL_CHECK(pos[r] == order[r].size(), "insert_comm: the compute order of rank ", r,
                   " is not feasible (stuck at ", pos[r], ")");
  const bool ok =
      place_comm(s, order, start, inside, [&](int r, size_t i) { return start[r][i] + 1; });
  COLOSSAL_CHECK(ok, "insert_comm: a unit-time hand-off missed its consumer");
}

// Megatron's interleaved 1F1B over C chunks (Loop placement): forward step k runs micro-batch
// (k / (S C)) S + k mod S on chunk (k mod S C) / S, backward step k the same with the chunk
// reversed. Rank r warms up with W_r = 2 (S - r - 1) + (C - 1) S forwards; its iteration i
// runs forward step i (if any) then backward step i - W_r (if any), and sends and receives
// once after it, as Megatron does. Iteration i of rank r is global step i + r: every hand-off
// leaves at the end of the producer's step and is consumed exactly in the next step of its
// receiver (W_r drops by 2 per rank), so the messages sit at one common step boundary on both
// sides and place_comm()'s argument applies (no deadlock, FIFO order by construction).
void interleaved(Schedule& s) {
  const int S = s.stages, M = s.microbatches, C = s.chunks, total = M * C;
  auto mb = [&](int k) { return (k / (S * C)) * S + k % S; };
  auto chunk = [&](int k, bool fwd) {
    const int c = (k % (S * C)) / S;
    return fwd ? c : C - 1 - c;
  };
  std::vector<std::vector<Instr>> order(S);
  std::vector<std::vector<int>> step(S);
  for (int r = 0; r < S; ++r) {
    const int warm = 2 * (S - r - 1) + (C - 1) * S;
    for (int i = 0; i < total || i - warm < total; ++i) {
      if (i < total) {
        order[r].push_back({Op::F, mb(i), chunk(i, true)});
        step[r].push_back(i + r);
      }
      if (i >= warm && i - warm < total) {
        order[r].push_back({Op::BW, mb(i - warm), chunk(i - warm, false)});
        step[r].push_back(i + r);
      }
    }
  }
  const std::vector<std::set<int>> none(S);
  const bool ok = place_comm(s, order, step, none, [&](int r, size_t i) { return step[r][i] + 1; });
  COLOSSAL_CHECK(ok, "interleaved: a hand-off misses its step");
}

// ZB-H1: 1F1B's order with the backward split. Rank r keeps up to r weight-gradient passes
// pending (it runs W(i - r) after B(i)), so later ranks, whose B arrive first, push their Ws
// into the cool-down where 1F1B idles; the B chain then runs at b per stage instead of b + w.
// In-flight activations (F done, W not yet) stay <= S, 1F1B's peak on rank 0.
std::vector<std::vector<Instr>> zbh1_order(const Schedule& s) {
  const int S = s.stages, M = s.microbatches;
  std::vector<std::vector<Instr>> order(S);
  for (int r = 0; r < S; ++r) {
    auto& L = order[r];
    std::deque<int> pending;
    auto b = [&](int m, size_t keep) {
      L.push_back({Op::B, m, 0});
      pending.push_back(m);
      while (pending.size() > keep) {
        L.push_back({Op::W, pending.front(), 0});
        pending.pop_front();
      }
    };
    const int warm = std::min(S - r - 1, M), steady = M - warm;
    for (int m = 0; m < warm; ++m) L.push_back({Op::F, m, 0});
    for (int i = 0; i < steady; ++i) {
      L.push_back({Op::F, warm + i, 0});
      b(i, static_cast<size_t>(r));
    }
    for (int m = steady; m < M; ++m) b(m, static_cast<size_t>(r));
    for (int m : pending) L.push_back({Op::W, m, 0});
  }
  return order;
}

// ZB-V (V placement, chunks == 2): a unit-time list scheduler in the spirit of the ZB paper's
// heuristic. At each time step every rank takes one ready pass: a B first (the backward chain
// is the critical path), else an F (chunk 1 before chunk 0, micro-batches in order) while its
// in-flight chunk activations stay below 2 S (1F1B's peak on rank 0, in half-stage chunks; a
// chunk-0 F may keep `reserve` slots free for chunk 1), else a pending W (oldest first) to fill
// the gap. It yields the V shape: warm-up forwards of chunk 0 then chunk 1, then F/B/W
// interleaved, Ws draining the cool-down. Empty when a step finds no rank able to move.
std::vector<std::vector<Instr>> zbv_order(const Schedule& s, int reserve) {
  const int S = s.stages, M = s.microbatches, V = 2 * S;
  const int cap = 2 * S;
  auto idx = [&](int m, int v) { return static_cast<size_t>(m) * V + v; };
  std::vector<int> f_end(static_cast<size_t>(M) * V, -1), b_end(f_end);
  std::vector<std::vector<Instr>> order(S);
  std::vector<int> next_f0(S, 0), next_f1(S, 0), next_b0(S, 0), next_b1(S, 0), alive(S, 0);
  std::vector<std::deque<Instr>> pending_w(S);
  const size_t total = static_cast<size_t>(M) * 2 * 3;
  size_t done = 0;
  auto ended = [](int e, int t) { return e >= 0 && e <= t; };
  for (int t = 0; done < static_cast<size_t>(S) * total; ++t) {
    std::vector<std::pair<int, Instr>> picks;
    for (int r = 0; r < S; ++r) {
      const int v0 = r, v1 = V - 1 - r;
      // Ready passes of rank r at time t.
      const int mb1 = next_b1[r], mb0 = next_b0[r], mf1 = next_f1[r], mf0 = next_f0[r];
      const bool b1 = mb1 < M && ended(f_end[idx(mb1, v1)], t) &&
                      (v1 == V - 1 || ended(b_end[idx(mb1, v1 + 1)], t));
      const bool b0 = mb0 < M && ended(f_end[idx(mb0, v0)], t) && ended(b_end[idx(mb0, v0 + 1)], t);
      const bool f1 = mf1 < M && ended(f_end[idx(mf1, v1 - 1)], t) && alive[r] < cap;
      const bool f0 =
          mf0 < M && (v0 == 0 || ended(f_end[idx(mf0, v0 - 1)], t)) && alive[r] < cap - reserve;
      Instr in;
      if (b1 && (!b0 || mb1 <= mb0)) {
        in = {Op::B, mb1, 1};
        ++next_b1[r];
      } else if (b0) {
        in = {Op::B, mb0, 0};
        ++next_b0[r];
      } else if (f1) {
        in = {Op::F, mf1, 1};
        ++next_f1[r];
        ++alive[r];
      } else if (f0) {
        in = {Op::F, mf0, 0};
        ++next_f0[r];
        ++alive[r];
      } else if (!pending_w[r].empty()) {
        in = pending_w[r].front();
        pending_w[r].pop_front();
        --alive[r];
      } else {
        continue;
      }
      picks.push_back({r, in});
    }
    if (picks.empty()) return {};  // stuck: nothing ready anywhere
    for (const auto& [r, in] : picks) {
      const int v = s.virtual_stage(r, in.chunk);
      if (in.op == Op::F) f_end[idx(in.mb, v)] = t + 1;
      if (in.op == Op::B) {
        b_end[idx(in.mb, v)] = t + 1;
        pending_w[r].push_back({Op::W, in.mb, in.chunk});
      }
      order[r].push_back(in);
      ++done;
    }
  }
  return order;
}

}  // namespace

Schedule make_schedule(const ScheduleOptions& o) {
  const std::string& st = o.style;
  COLOSSAL_CHECK_INPUT(
      st == "1f1b" || st == "gpipe" || st == "interleaved" || st == "zbh1" || st == "zbv",
      "unknown pipeline style '", st, "' (expected 1f1b, gpipe, interleaved, zbh1 or zbv)");
  COLOSSAL_CHECK_INPUT(o.stages >= 1, "pipeline stages (pp_size) must be >= 1, got ", o.stages);
  COLOSSAL_CHECK_INPUT(o.microbatches >= 1, "microbatches must be >= 1, got ", o.microbatches);
  COLOSSAL_CHECK_INPUT(o.stages <= 4096, "pipeline stages (pp_size) must be <= 4096, got ",
                       o.stages);
  COLOSSAL_CHECK_INPUT(int64_t{o.microbatches} * std::max(o.chunks, 1) <= (1 << 20),
                       "microbatches * chunks must be <= ", 1 << 20, ", got ", o.microbatches,
                       " * ", o.chunks);
  COLOSSAL_CHECK_INPUT(st == "gpipe" || o.microbatches >= o.stages, "pp_style ", st,
                       ": microbatches (", o.microbatches, ") must be >= stages (", o.stages,
                       "): fewer micro-batches than stages cannot fill the pipeline");
  if (st == "interleaved") {
    COLOSSAL_CHECK_INPUT(o.chunks >= 2,
                         "pp_style interleaved needs chunks (num_model_chunks) >= 2, got ",
                         o.chunks, " (use 1f1b for one chunk)");
    COLOSSAL_CHECK_INPUT(o.microbatches % o.stages == 0,
                         "pp_style interleaved needs microbatches (", o.microbatches,
                         ") to be a multiple of stages (", o.stages, ")");
  } else if (st == "zbv") {
    COLOSSAL_CHECK_INPUT(o.chunks == 2, "pp_style zbv needs chunks (num_model_chunks) == 2, got ",
                         o.chunks);
  } else {
    COLOSSAL_CHECK_INPUT(o.chunks == 1, "pp_style ", st,
                         " needs chunks (num_model_chunks) == 1, got ", o.chunks);
  }
  Schedule s;
  s.name = st;
  s.stages = o.stages;
  s.microbatches = o.microbatches;
  s.chunks = o.chunks;
  s.placement = st == "zbv" ? Placement::V : Placement::Loop;
  s.ranks.assign(o.stages, {});
  if (st == "1f1b" || st == "gpipe")
    gpipe_or_1f1b(s, st == "gpipe");
  else if (st == "interleaved")
    interleaved(s);
  else if (st == "zbh1")
    insert_comm(s, zbh1_order(s));
  else {
    // No slot kept for chunk 1 schedules tighter (measured); keeping one is the fallback.
    auto order = zbv_order(s, 0);
    if (order.empty()) order = zbv_order(s, 1);
    COLOSSAL_CHECK(!order.empty(),
                   "zbv: the list scheduler found no schedule for stages=", s.stages,
                   " microbatches=", s.microbatches);
    insert_comm(s, order);
  }
  validate(s);
  return s;
}

}  // namespace colossal::pipeline
