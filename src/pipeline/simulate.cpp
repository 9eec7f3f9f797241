// The batch-semantics engine and the event simulation of a schedule.
#include <algorithm>
#include <cmath>
#include <limits>

#include "colossal/core/error.h"
#include "colossal/pipeline/schedule.h"
#include "pipeline/internal.h"

namespace colossal::pipeline {
namespace detail {

EngineResult run_engine(const Schedule& s,
                        const std::vector<std::vector<std::pair<int, int>>>& partner,
                        const std::function<double(int, const Instr&)>& cost, double comm) {
  const int S = s.stages;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EngineResult res;
  res.start.resize(S);
  res.end.resize(S);
  for (int r = 0; r < S; ++r) {
    res.start[r].assign(s.ranks[r].size(), nan);
    res.end[r].assign(s.ranks[r].size(), nan);
  }
  std::vector<int>& pos = res.pos;
  pos.assign(S, 0);
  std::vector<double> clock(S, 0.0);
  auto posted = [&](int r, int i) { return !std::isnan(res.start[r][i]); };
  // Each pass advances every rank as far as it can; the times do not depend on the order in
  // which ranks are visited (a batch's completion needs only posts, which are final).
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < S; ++r) {
      const auto& list = s.ranks[r];
      const int n = static_cast<int>(list.size());
      while (pos[r] < n) {
        const int i = pos[r];
        if (is_compute(list[i].op)) {
          res.start[r][i] = clock[r];
          clock[r] += cost(r, list[i]);
          res.end[r][i] = clock[r];
          ++pos[r];
          progress = true;
          continue;
        }
        int e = i;
        while (e < n && is_comm(list[e].op)) ++e;
        if (!posted(r, i)) {
          for (int k = i; k < e; ++k) res.start[r][k] = clock[r];
          progress = true;
        }
        double done = clock[r];
        bool matched = true;
        for (int k = i; k < e && matched; ++k) {
          const auto [pr, pk] = partner[r][k];
          if (!posted(pr, pk)) {
            matched = false;
            break;
          }
          const bool send = list[k].op == Op::SendF || list[k].op == Op::SendB;
          const double t = send ? std::max(res.start[r][k], res.start[pr][pk])
                                : std::max(res.start[r][k], res.start[pr][pk] + comm);
          res.end[r][k] = t;
          done = std::max(done, t);
        }
        if (!matched) break;
        clock[r] = done;
        pos[r] = e;
        progress = true;
      }
    }
  }
  for (int r = 0; r < S; ++r) {
    if (pos[r] >= static_cast<int>(s.ranks[r].size())) continue;
    res.complete = false;
    res.blocked_rank = r;
    const int i = pos[r];
    int k = i;
    while (k < static_cast<int>(s.ranks[r].size()) && is_comm(s.ranks[r][k].op)) {
      const auto [pr, pk] = partner[r][k];
      if (!posted(pr, pk)) break;
      ++k;
    }
    res.blocked_index = k;
    break;
  }
  return res;
}

}  // namespace detail

SimResult simulate(const Schedule& s, const Costs& costs) {
  validate(s);
  auto pick = [](const std::vector<double>& per_rank, int r, double uniform) {
    return per_rank.empty() ? uniform : per_rank.at(static_cast<size_t>(r));
  };
  for (const auto* v : {&costs.f_rank, &costs.b_rank, &costs.w_rank})
    COLOSSAL_CHECK_INPUT(v->empty() || static_cast<int>(v->size()) == s.stages,
                         "per-rank costs need one value per stage (", s.stages, "), got ",
                         v->size());
  auto cost = [&](int r, const Instr& in) {
    switch (in.op) {
      case Op::F:
        return pick(costs.f_rank, r, costs.f);
      case Op::B:
        return pick(costs.b_rank, r, costs.b);
      case Op::W:
        return pick(costs.w_rank, r, costs.w);
      case Op::BW:
        return pick(costs.b_rank, r, costs.b) + pick(costs.w_rank, r, costs.w);
      default:
        return 0.0;
    }
  };
  const auto partner = detail::match_messages(s);
  const auto run = detail::run_engine(s, partner, cost, costs.comm);
  COLOSSAL_CHECK(run.complete, "simulate: a validated schedule did not run to completion");

  SimResult out;
  out.peak_activations.assign(s.stages, 0);
  out.busy.assign(s.stages, 0.0);
  double total = 0;
  for (int r = 0; r < s.stages; ++r) {
    int alive = 0;
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Instr& in = s.ranks[r][i];
      out.events.push_back({r, in, run.start[r][i], run.end[r][i]});
      out.step_time = std::max(out.step_time, run.end[r][i]);
      if (is_compute(in.op)) out.busy[r] += run.end[r][i] - run.start[r][i];
      if (in.op == Op::F) out.peak_activations[r] = std::max(out.peak_activations[r], ++alive);
      if (in.op == Op::BW || in.op == Op::W) --alive;
    }
    total += out.busy[r];
  }
  out.bubble_fraction = out.step_time > 0 ? 1.0 - total / (s.stages * out.step_time) : 0.0;
  std::stable_sort(out.events.begin(), out.events.end(),
                   [](const SimEvent& a, const SimEvent& b) { return a.start < b.start; });
  return out;
}

}  // namespace colossal::pipeline
