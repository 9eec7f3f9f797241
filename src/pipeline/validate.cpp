// validate(): ranges, per-rank ordering, per-pair FIFO matching, then a deadlock-free run under
// the batch semantics (the same engine simulate() times).
#include <cstdint>
#include <map>
#include <tuple>

#include "colossal/core/error.h"
#include "colossal/pipeline/schedule.h"
#include "pipeline/internal.h"

namespace colossal::pipeline {
namespace {

constexpr int kMaxStages = 4096;
constexpr int64_t kMaxMicrobatchChunks = 1 << 20;

using detail::where;

// What one rank has done so far for one (m, c).
struct Seen {
  int f = -1, b = -1, bw = -1, w = -1;  // index of the instruction, -1 = not yet
  int send_f = -1, recv_f = -1, send_b = -1, recv_b = -1;
};

void check_rank(const Schedule& s, int r) {
  const int M = s.microbatches, C = s.chunks, V = s.virtual_stages();
  const auto& list = s.ranks[r];
  std::vector<Seen> seen(static_cast<size_t>(M) * C);
  auto at = [&](int m, int c) -> Seen& { return seen[static_cast<size_t>(m) * C + c]; };
  for (int i = 0; i < static_cast<int>(list.size()); ++i) {
    const Instr& in = list[i];
    const std::string w = where(r, i, in);
    COLOSSAL_CHECK_INPUT(in.mb >= 0 && in.mb < M, w, "micro-batch ", in.mb,
                         " out of range (microbatches=", M, ")");
    COLOSSAL_CHECK_INPUT(in.chunk >= 0 && in.chunk < C, w, "chunk ", in.chunk,
                         " out of range (chunks=", C, ")");
    Seen& e = at(in.mb, in.chunk);
    const int v = s.virtual_stage(r, in.chunk);
    // The neighbouring virtual stages when they sit on this rank (a local hand-off).
    auto local = [&](int u) -> Seen* {
      if (u < 0 || u >= V) return nullptr;
      auto [hr, hc] = s.holder(u);
      return hr == r ? &at(in.mb, hc) : nullptr;
    };
    switch (in.op) {
      case Op::F: {
        COLOSSAL_CHECK_INPUT(e.f < 0, w, "second F of this micro-batch and chunk (first at ", e.f,
                             ")");
        Seen* prev = local(v - 1);
        const bool ready = v == 0 || e.recv_f >= 0 || (prev && prev->f >= 0);
        COLOSSAL_CHECK_INPUT(ready, w, "F before its input is available (",
                             prev ? str("F of virtual stage ", v - 1, " on this rank")
                                  : str("RecvF", in.mb, ".", in.chunk),
                             " must come earlier)");
        e.f = i;
        break;
      }
      case Op::B:
      case Op::BW: {
        COLOSSAL_CHECK_INPUT(e.b < 0 && e.bw < 0, w,
                             "second backward of this micro-batch and chunk");
        COLOSSAL_CHECK_INPUT(e.f >= 0, w, to_string(in.op), " before its F (F", in.mb, ".",
                             in.chunk, " must come earlier on this rank)");
        Seen* next = local(v + 1);
        const bool ready = v == V - 1 || e.recv_b >= 0 || (next && (next->b >= 0 || next->bw >= 0));
        COLOSSAL_CHECK_INPUT(ready, w, to_string(in.op),
                             " before its output gradient is available (",
                             next ? str("the backward of virtual stage ", v + 1, " on this rank")
                                  : str("RecvB", in.mb, ".", in.chunk),
                             " must come earlier)");
        (in.op == Op::B ? e.b : e.bw) = i;
        break;
      }
      case Op::W:
        COLOSSAL_CHECK_INPUT(e.bw < 0, w,
                             "W after a BW (BW already computes the weight gradients)");
        COLOSSAL_CHECK_INPUT(e.w < 0, w, "second W of this micro-batch and chunk");
        COLOSSAL_CHECK_INPUT(e.b >= 0, w, "W before its B (B", in.mb, ".", in.chunk,
                             " must come earlier on this rank)");
        e.w = i;
        break;
      case Op::SendF:
      case Op::RecvF:
      case Op::SendB:
      case Op::RecvB: {
        const bool fwd = in.op == Op::SendF || in.op == Op::RecvF;
        const bool send = in.op == Op::SendF || in.op == Op::SendB;
        const int u = (in.op == Op::SendF || in.op == Op::RecvB) ? v + 1 : v - 1;
        COLOSSAL_CHECK_INPUT(u >= 0 && u < V, w, "virtual stage ", v, " has no ",
                             u < 0 ? "previous" : "next", " virtual stage to ",
                             send ? "send to" : "receive from", " (no rank holds virtual stage ", u,
                             ")");
        COLOSSAL_CHECK_INPUT(s.holder(u).first != r, w, "same-rank hand-off: virtual stage ", u,
                             " is also on rank ", r, ", so no Send/Recv is allowed");
        int& slot = in.op == Op::SendF   ? e.send_f
                    : in.op == Op::RecvF ? e.recv_f
                    : in.op == Op::SendB ? e.send_b
                                         : e.recv_b;
        COLOSSAL_CHECK_INPUT(slot < 0, w, "second ", to_string(in.op),
                             " of this micro-batch and chunk (first at ", slot, ")");
        if (send && fwd)
          COLOSSAL_CHECK_INPUT(e.f >= 0, w, "SendF before its F (F", in.mb, ".", in.chunk,
                               " must come earlier)");
        if (send && !fwd)
          COLOSSAL_CHECK_INPUT(e.b >= 0 || e.bw >= 0, w, "SendB before its backward (B/BW", in.mb,
                               ".", in.chunk, " must come earlier)");
        slot = i;
        break;
      }
    }
  }
  // Completeness: every (m, c) has F, a backward, W after B, and its sends.
  const int n = static_cast<int>(list.size());
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) {
      const Seen& e = at(m, c);
      const int v = s.virtual_stage(r, c);
      const std::string mc = str(m, ".", c);
      COLOSSAL_CHECK_INPUT(e.f >= 0, "rank ", r, ", end of list (", n, " instructions): F", mc,
                           " is missing");
      COLOSSAL_CHECK_INPUT(e.b >= 0 || e.bw >= 0, where(r, e.f, list[e.f]), "no backward (BW", mc,
                           " or B", mc, " + W", mc, ") follows");
      if (e.b >= 0)
        COLOSSAL_CHECK_INPUT(e.w >= 0, where(r, e.b, list[e.b]), "no W", mc,
                             " follows (a split backward needs its W)");
      if (v + 1 < V && s.holder(v + 1).first != r)
        COLOSSAL_CHECK_INPUT(e.send_f >= 0, where(r, e.f, list[e.f]), "no SendF", mc,
                             " follows (virtual stage ", v + 1, " is on rank ",
                             s.holder(v + 1).first, ")");
      if (v > 0 && s.holder(v - 1).first != r) {
        const int b = e.b >= 0 ? e.b : e.bw;
        COLOSSAL_CHECK_INPUT(e.send_b >= 0, where(r, b, list[b]), "no SendB", mc,
                             " follows (virtual stage ", v - 1, " is on rank ",
                             s.holder(v - 1).first, ")");
      }
    }
}

}  // namespace

namespace detail {

std::vector<std::vector<std::pair<int, int>>> match_messages(const Schedule& s) {
  const int S = s.stages;
  std::vector<std::vector<std::pair<int, int>>> partner(S);
  // sends[a][b] / recvs[b][a]: instruction indices in list order.
  std::vector<std::vector<std::vector<int>>> sends(S, std::vector<std::vector<int>>(S)),
      recvs(S, std::vector<std::vector<int>>(S));
  for (int r = 0; r < S; ++r) {
    partner[r].assign(s.ranks[r].size(), {-1, -1});
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Instr& in = s.ranks[r][i];
      if (!is_comm(in.op)) continue;
      const int p = comm_peer(s, r, in);
      if (in.op == Op::SendF || in.op == Op::SendB)
        sends[r][p].push_back(i);
      else
        recvs[r][p].push_back(i);
    }
  }
  for (int a = 0; a < S; ++a)
    for (int b = 0; b < S; ++b) {
      const auto& snd = sends[a][b];
      const auto& rcv = recvs[b][a];
      const size_t n = std::min(snd.size(), rcv.size());
      for (size_t k = 0; k < n; ++k) {
        const Instr& x = s.ranks[a][snd[k]];
        const Instr& y = s.ranks[b][rcv[k]];
        const bool fwd = x.op == Op::SendF;
        const int vx = s.virtual_stage(a, x.chunk), vy = s.virtual_stage(b, y.chunk);
        const bool same = (fwd ? y.op == Op::RecvF : y.op == Op::RecvB) && x.mb == y.mb &&
                          vy == (fwd ? vx + 1 : vx - 1);
        COLOSSAL_CHECK_INPUT(same, where(b, rcv[k], y), "FIFO order violated: it is receive ", k,
                             " from rank ", a, ", but send ", k, " from rank ", a, " to rank ", b,
                             " is ", to_string(x), " (rank ", a, ", instruction ", snd[k],
                             "); sends and receives of one pair must come in the same order");
        partner[a][snd[k]] = {b, rcv[k]};
        partner[b][rcv[k]] = {a, snd[k]};
      }
      if (snd.size() > n)
        throw InputError(str(where(a, snd[n], s.ranks[a][snd[n]]), "no matching receive on rank ",
                             b, " (rank ", a, " sends ", snd.size(), " messages to rank ", b,
                             ", which receives ", rcv.size(), ")"));
      if (rcv.size() > n)
        throw InputError(str(where(b, rcv[n], s.ranks[b][rcv[n]]), "no matching send on rank ", a,
                             " (rank ", b, " receives ", rcv.size(), " messages from rank ", a,
                             ", which sends ", snd.size(), ")"));
    }
  return partner;
}

}  // namespace detail

void validate(const Schedule& s) {
  COLOSSAL_CHECK_INPUT(s.stages >= 1, "schedule '", s.name, "': stages must be >= 1, got ",
                       s.stages);
  COLOSSAL_CHECK_INPUT(s.microbatches >= 1, "schedule '", s.name,
                       "': microbatches must be >= 1, got ", s.microbatches);
  COLOSSAL_CHECK_INPUT(s.chunks >= 1, "schedule '", s.name, "': chunks must be >= 1, got ",
                       s.chunks);
  // Bounds that keep a hostile table from asking for unbounded memory.
  COLOSSAL_CHECK_INPUT(s.stages <= kMaxStages, "schedule '", s.name, "': stages (", s.stages,
                       ") above ", kMaxStages);
  COLOSSAL_CHECK_INPUT(int64_t{s.microbatches} * s.chunks <= kMaxMicrobatchChunks, "schedule '",
                       s.name, "': microbatches * chunks (", int64_t{s.microbatches} * s.chunks,
                       ") above ", kMaxMicrobatchChunks);
  COLOSSAL_CHECK_INPUT(s.placement != Placement::V || s.chunks == 2, "schedule '", s.name,
                       "': placement v needs chunks == 2, got ", s.chunks);
  COLOSSAL_CHECK_INPUT(static_cast<int>(s.ranks.size()) == s.stages, "schedule '", s.name,
                       "': ", s.ranks.size(), " rank lists for stages=", s.stages);
  for (int r = 0; r < s.stages; ++r) check_rank(s, r);
  const auto partner = detail::match_messages(s);
  const auto run = detail::run_engine(
      s, partner, [](int, const Instr&) { return 1.0; }, 0.0);
  if (!run.complete) {
    const int r = run.blocked_rank, i = run.blocked_index;
    const auto [pr, pi] = partner[r][i];
    throw InputError(str(where(r, i, s.ranks[r][i]), "deadlock: its partner ",
                         to_string(s.ranks[pr][pi]), " (rank ", pr, ", instruction ", pi,
                         ") is never posted: rank ", pr, " waits at instruction ", run.pos[pr],
                         " (", to_string(s.ranks[pr][run.pos[pr]]), "); no rank can advance"));
  }
}

}  // namespace colossal::pipeline
