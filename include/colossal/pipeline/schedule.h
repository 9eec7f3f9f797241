// Pipeline schedules as data (torchtitan / DeepSpeed's idea, taken further): every schedule is a
// per-rank list of instructions that can be printed, parsed from a user's table, validated,
// simulated and executed by one interpreter (pipeline/executor.h). ColossalAI hand-writes one
// loop per style (one_f_one_b.py, interleaved_pp.py, zero_bubble_pp.py); here a new style is a
// generator or a table, never a new loop.
//
// Vocabulary. The model is cut into V = stages * chunks virtual stages v = 0..V-1 (v = 0 holds
// the embedding, v = V-1 the head and the loss). Placement says which pipeline rank and which of
// its chunks hold each virtual stage:
//   Loop  (1F1B, GPipe, interleaved; ColossalAI's interleaved layout): v = chunk * stages + rank;
//   V     (ZB-V; ColossalAI's zbv layout, chunks == 2): chunk 0 of rank r is v = r, chunk 1 of
//         rank r is v = 2 * stages - 1 - r (the last virtual stage sits on rank 0).
// Instructions name a micro-batch m and a chunk c of the executing rank:
//   F      forward of (m, c): its input is the received activation (or the micro-batch's tokens
//          at v = 0); the output is kept for SendF / the next chunk on this rank; v = V-1 also
//          takes the loss.
//   B      input-gradient backward of (m, c) (ZB-H1 / ZB-V's B): the gradient of F's input,
//          weights' gradients deferred to a W of the same (m, c).
//   W      weight-gradient backward of (m, c), after its B.
//   BW     full backward of (m, c) (B and W at once; GPipe, 1F1B, interleaved).
//   SendF  send F(m, c)'s output to the holder of v + 1; RecvF: receive F(m, c)'s input from the
//          holder of v - 1. SendB: send B/BW(m, c)'s input gradient to v - 1; RecvB: receive the
//          gradient of F(m, c)'s output from v + 1.
// A hand-off between two virtual stages on the same rank (ZB-V's turn at rank stages-1... and
// v = 0 / V-1 ends) needs no Send/Recv: generators emit none and the validator refuses them.
// Consecutive Send/Recv instructions of one rank form one batch (dist::Communicator::batch_p2p):
// they are posted together and the batch completes when every op in it is matched.
//
// Matching rules (what makes a table safe on NCCL as well as Gloo): between an ordered pair of
// ranks (a -> b), the k-th Send on a and the k-th Recv on b from a must carry the same message
// (kind F or B, micro-batch, and the sender's/receiver's virtual stages v and v + 1 for F,
// v and v - 1 for B).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace colossal::pipeline {

enum class Op { F, B, W, BW, SendF, RecvF, SendB, RecvB };
const char* to_string(Op op);       // "F", "B", "W", "BW", "SendF", "RecvF", "SendB", "RecvB"
Op parse_op(const std::string& s);  // InputError naming the text otherwise
bool is_comm(Op op);                // Send* / Recv*
bool is_compute(Op op);             // F / B / W / BW

struct Instr {
  Op op = Op::F;
  int mb = 0;     // micro-batch index, 0 .. microbatches-1
  int chunk = 0;  // model chunk of the executing rank, 0 .. chunks-1
  bool operator==(const Instr&) const = default;
};
std::string to_string(const Instr& i);  // "F3.1" = F of micro-batch 3, chunk 1; "SendB0.0"

enum class Placement { Loop, V };
const char* to_string(Placement p);               // "loop", "v"
Placement parse_placement(const std::string& s);  // InputError otherwise

struct Schedule {
  std::string name;      // "1f1b", "gpipe", "interleaved", "zbh1", "zbv", or the table's name
  int stages = 1;        // pipeline ranks
  int microbatches = 1;  // per step
  int chunks = 1;        // model chunks per rank
  Placement placement = Placement::Loop;
  std::vector<std::vector<Instr>> ranks;  // ranks[r]: rank r's instructions in order

  int virtual_stages() const { return stages * chunks; }
  // Placement maps (v <-> (rank, chunk)).
  int virtual_stage(int rank, int chunk) const;
  std::pair<int, int> holder(int v) const;  // {rank, chunk}
  bool splits_backward() const;             // any B/W (instead of BW)
};

// ColossalAI's pp_style names plus ours: "1f1b", "gpipe", "interleaved", "zbh1", "zbv".
struct ScheduleOptions {
  std::string style = "1f1b";
  int stages = 1;
  int microbatches = 1;
  int chunks = 1;  // interleaved: > 1; zbv: 2; the others: 1
};

// Builds the instruction lists of a style. InputError naming the option (and what it needs) for:
// stages < 1, microbatches < stages for 1f1b / interleaved / zbh1 / zbv (fewer micro-batches
// than stages cannot fill the pipeline; ColossalAI's assertion), interleaved with chunks < 2 or
// microbatches not a multiple of stages, zbv without chunks == 2, 1f1b / gpipe / zbh1 with
// chunks != 1, an unknown style. Every generated schedule passes validate().
//   gpipe        all F then all BW (reverse order), per chunk 1.
//   1f1b         warm-up min(stages - rank - 1, M) forwards, steady 1F1B, cool-down (Megatron /
//                ColossalAI's one_f_one_b).
//   interleaved  Megatron's interleaved 1F1B over `chunks` chunks in Loop placement.
//   zbh1         1F1B with the backward split into B and W, W deferred to fill the cool-down
//                bubble (Qi et al., ZB-H1): same activation memory as 1F1B.
//   zbv          the V placement with split backward (ZB-V): F chunk 0 ... F chunk 1 ... B/W.
Schedule make_schedule(const ScheduleOptions& options);

// What validate() checks, in order, for each rank's list; the first violation is an InputError
// naming the rank, the index and the instruction ("rank 1, instruction 7 (BW3.0): ...").
//  - fields in range (mb, chunk), every (m, c) on every rank has exactly one F, and either one
//    BW or one B followed later by one W;
//  - each F after its input is available (RecvF earlier on this rank, or the previous virtual
//    stage's F earlier on this rank, or v == 0); each B/BW after its F and after its output
//    gradient is available (RecvB earlier, or the next virtual stage's B/BW earlier on this
//    rank, or v == V-1); W after its B;
//  - each Send after the compute producing it; Sends/Recvs only between different ranks and to
//    the right holder; the per-pair FIFO matching rule above;
//  - the whole table runs to completion under the batch semantics (no deadlock): a simulation
//    advances every rank until all finish; if none can advance the error names the first
//    blocked instruction of the lowest blocked rank.
void validate(const Schedule& s);

// Per-op costs for the simulator (any time unit) and activation memory units.
struct Costs {
  double f = 1.0;     // forward of one chunk
  double b = 1.0;     // input-gradient backward (B)
  double w = 1.0;     // weight-gradient backward (W); BW costs b + w
  double comm = 0.0;  // latency of one Send -> Recv hand-off (added to the receiver's wait)
  // Optional per (rank) overrides, e.g. the last stage's loss: index = rank; empty = uniform.
  std::vector<double> f_rank, b_rank, w_rank;
};

struct SimEvent {
  int rank;
  Instr instr;
  double start, end;
};

struct SimResult {
  double step_time = 0;               // makespan over all ranks
  double bubble_fraction = 0;         // 1 - sum(compute time) / (stages * step_time)
  std::vector<int> peak_activations;  // per rank: most micro-batch chunks alive (F done, not
                                      // yet freed by BW / W)
  std::vector<double> busy;           // per rank: compute time
  std::vector<SimEvent> events;       // every compute and comm instruction with its times
};
// Event simulation of a (valid) schedule: each rank runs its list in order; a compute starts
// when the rank is free and its inputs are there; data sent by a Send at time t is available to
// the matching Recv at t + comm. A batch completes when all its ops do: a Send when its Recv is
// posted, a Recv at max(its post, the Send's post + comm). validate()s first. With comm = 0
// the 1F1B step time is exactly (M + S - 1) * (f + b + w) (any f, b, w; tested), so the bubble
// is (S - 1) / (M + S - 1).
SimResult simulate(const Schedule& s, const Costs& costs);

// Timeline picture (SVG): one row per rank, a box per compute (F, B, W, BW coloured apart,
// labelled with micro-batch and chunk), the time axis, and the step time and bubble in the title.
std::string timeline_svg(const Schedule& s, const SimResult& r);
// The same picture inline in a standalone HTML page, above the schedule's listing (describe()).
std::string timeline_html(const Schedule& s, const SimResult& r);

// Text forms. A table file is CSV (`rank,op,mb,chunk` per line in each rank's order, with
// header lines `# stages=4 microbatches=8 chunks=1 placement=loop name=mine`) or JSON
// ({"name":..,"stages":..,"microbatches":..,"chunks":..,"placement":"loop"|"v",
//   "ranks":[["F0.0","SendF0.0",...], ...]}). parse errors are InputErrors naming the file's
// line (CSV) or the rank and entry (JSON). The result is validate()d.
std::string to_csv(const Schedule& s);
std::string to_json(const Schedule& s);
Schedule parse_schedule_table(const std::string& text, const std::string& what = "schedule");
Schedule load_schedule_table(const std::string& path);  // by extension .csv / .json

// A readable listing: one line per rank, instructions separated by spaces.
std::string describe(const Schedule& s);

}  // namespace colossal::pipeline
