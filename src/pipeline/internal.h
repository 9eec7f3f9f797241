// Shared pieces of the pipeline layer: message matching and the batch-semantics engine that both
// validate() (deadlock check) and simulate() (timing) run.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "colossal/pipeline/schedule.h"

namespace colossal::pipeline::detail {

// "rank 1, instruction 7 (BW3.0): "
std::string where(int rank, int index, const Instr& in);

// The rank a Send/Recv talks to (the holder of v + 1 for SendF / RecvB, v - 1 for SendB /
// RecvF), or -1 when that virtual stage does not exist.
int comm_peer(const Schedule& s, int rank, const Instr& in);

// partner[r][i]: {rank, index} of the instruction matched with comm instruction i of rank r
// under the per-pair FIFO rule ({-1, -1} for computes). Throws InputError on a mismatch.
std::vector<std::vector<std::pair<int, int>>> match_messages(const Schedule& s);

struct EngineResult {
  bool complete = true;
  int blocked_rank = -1, blocked_index = -1;    // first unmatched op of the lowest blocked rank
  std::vector<int> pos;                         // per rank: where it stopped (size = finished)
  std::vector<std::vector<double>> start, end;  // per instruction (NaN when never reached)
};
// Runs every rank's list under the batch semantics: a compute takes cost(rank, instr); a batch
// (maximal run of Send/Recv) is posted when the rank reaches it and completes when every op's
// partner is posted: a Send at max(posts), a Recv at max(own post, the Send's post + comm).
EngineResult run_engine(const Schedule& s,
                        const std::vector<std::vector<std::pair<int, int>>>& partner,
                        const std::function<double(int, const Instr&)>& cost, double comm);

}  // namespace colossal::pipeline::detail
