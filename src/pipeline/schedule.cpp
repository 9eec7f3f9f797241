// Names, placement maps and the text listing of pipeline schedules.
#include "colossal/pipeline/schedule.h"

#include <sstream>

#include "colossal/core/error.h"
#include "pipeline/internal.h"

namespace colossal::pipeline {

const char* to_string(Op op) {
  switch (op) {
    case Op::F:
      return "F";
    case Op::B:
      return "B";
    case Op::W:
      return "W";
    case Op::BW:
      return "BW";
    case Op::SendF:
      return "SendF";
    case Op::RecvF:
      return "RecvF";
    case Op::SendB:
      return "SendB";
    case Op::RecvB:
      return "RecvB";
  }
  return "?";
}

Op parse_op(const std::string& s) {
  for (Op op : {Op::F, Op::B, Op::W, Op::BW, Op::SendF, Op::RecvF, Op::SendB, Op::RecvB})
    if (s == to_string(op)) return op;
  throw InputError("unknown pipeline instruction '" + s +
                   "' (expected F, B, W, BW, SendF, RecvF, SendB or RecvB)");
}

bool is_comm(Op op) {
  return op == Op::SendF || op == Op::RecvF || op == Op::SendB || op == Op::RecvB;
}
bool is_compute(Op op) {
  return !is_comm(op);
}

std::string to_string(const Instr& i) {
  return str(to_string(i.op), i.mb, ".", i.chunk);
}

const char* to_string(Placement p) {
  return p == Placement::Loop ? "loop" : "v";
}

Placement parse_placement(const std::string& s) {
  if (s == "loop") return Placement::Loop;
  if (s == "v") return Placement::V;
  throw InputError("unknown placement '" + s + "' (expected loop or v)");
}

int Schedule::virtual_stage(int rank, int chunk) const {
  if (placement == Placement::V && chunk == 1) return 2 * stages - 1 - rank;
  return chunk * stages + rank;
}

std::pair<int, int> Schedule::holder(int v) const {
  if (placement == Placement::V && v >= stages) return {2 * stages - 1 - v, 1};
  return {v % stages, v / stages};
}

bool Schedule::splits_backward() const {
  for (const auto& r : ranks)
    for (const auto& i : r)
      if (i.op == Op::B || i.op == Op::W) return true;
  return false;
}

std::string describe(const Schedule& s) {
  std::ostringstream os;
  os << s.name << ": stages=" << s.stages << " microbatches=" << s.microbatches
     << " chunks=" << s.chunks << " placement=" << to_string(s.placement) << "\n";
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    os << "rank " << r << ":";
    for (const auto& i : s.ranks[r]) os << " " << to_string(i);
    os << "\n";
  }
  return os.str();
}

namespace detail {

std::string where(int rank, int index, const Instr& in) {
  return str("rank ", rank, ", instruction ", index, " (", to_string(in), "): ");
}

int comm_peer(const Schedule& s, int rank, const Instr& in) {
  const int v = s.virtual_stage(rank, in.chunk);
  const int to = (in.op == Op::SendF || in.op == Op::RecvB) ? v + 1 : v - 1;
  if (to < 0 || to >= s.virtual_stages()) return -1;
  return s.holder(to).first;
}

}  // namespace detail
}  // namespace colossal::pipeline
