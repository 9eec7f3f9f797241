// ParallelDims: validation of the degrees against the world and the model, the (dp, pp, tp, sp)
// mesh, and the expert groups carved out of the dp x sp ranks.
#include "colossal/dist/parallel_dims.h"

#include <algorithm>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"

namespace colossal::dist {

const char* to_string(SequenceParallel m) {
  switch (m) {
    case SequenceParallel::Off:
      return "off";
    case SequenceParallel::SplitGather:
      return "split_gather";
    case SequenceParallel::Ring:
      return "ring";
    case SequenceParallel::AllToAll:
      return "all_to_all";
    case SequenceParallel::RingAttn:
      return "ring_attn";
  }
  return "?";
}

SequenceParallel parse_sequence_parallel(const std::string& name) {
  if (name.empty()) return SequenceParallel::Off;
  for (SequenceParallel m :
       {SequenceParallel::Off, SequenceParallel::SplitGather, SequenceParallel::Ring,
        SequenceParallel::AllToAll, SequenceParallel::RingAttn})
    if (name == to_string(m)) return m;
  throw InputError(str("unknown sequence parallelism mode '", name,
                       "': expected one of off, split_gather, ring, all_to_all, ring_attn"));
}

std::string ParallelDegrees::describe() const {
  std::string s = str("dp=", dp, " pp=", pp, " tp=", tp, " sp=", sp, " ep=", ep);
  if (sequence_parallel != SequenceParallel::Off)
    s += str(" sequence_parallel=", to_string(sequence_parallel));
  return s;
}

void ParallelDims::validate(const ParallelDegrees& d, int world, const ModelFacts& m) {
  const std::string all = d.describe();
  for (auto [name, v] : {std::pair<const char*, int>{"dp", d.dp},
                         {"pp", d.pp},
                         {"tp", d.tp},
                         {"sp", d.sp},
                         {"ep", d.ep}})
    COLOSSAL_CHECK_INPUT(v >= 1, "parallel degrees ", all, ": ", name, " is ", v,
                         "; every degree must be at least 1");
  const long long product = 1LL * d.dp * d.pp * d.tp * d.sp;
  COLOSSAL_CHECK_INPUT(product == world, "parallel degrees ", all, ": dp*pp*tp*sp = ", d.dp, "*",
                       d.pp, "*", d.tp, "*", d.sp, " = ", product, " but the world has ", world,
                       " ranks; choose degrees whose product is the number of ranks");
  COLOSSAL_CHECK_INPUT((d.dp * d.sp) % d.ep == 0, "parallel degrees ", all, ": ep=", d.ep,
                       " does not divide dp*sp = ", d.dp * d.sp,
                       " (expert-parallel ranks are taken from the data x sequence ranks)");
  switch (d.sequence_parallel) {
    case SequenceParallel::Off:
      COLOSSAL_CHECK_INPUT(d.sp == 1, "parallel degrees ", all, ": sp=", d.sp,
                           " needs a sequence parallelism mode (all_to_all or ring_attn); "
                           "with sequence parallelism off sp must be 1");
      break;
    case SequenceParallel::SplitGather:
    case SequenceParallel::Ring:
      COLOSSAL_CHECK_INPUT(d.tp > 1, "parallel degrees ", all, ": sequence parallelism mode ",
                           to_string(d.sequence_parallel),
                           " shards the sequence over the tensor-parallel group and needs "
                           "tp > 1, got tp=",
                           d.tp);
      COLOSSAL_CHECK_INPUT(d.sp == 1, "parallel degrees ", all, ": sequence parallelism mode ",
                           to_string(d.sequence_parallel),
                           " uses the tp group; sp must be 1, got sp=", d.sp);
      break;
    case SequenceParallel::AllToAll:
    case SequenceParallel::RingAttn:
      COLOSSAL_CHECK_INPUT(
          d.sp > 1, "parallel degrees ", all, ": sequence parallelism mode ",
          to_string(d.sequence_parallel),
          " shards the sequence over the sp group and needs sp > 1, got sp=", d.sp);
      break;
  }
  if (m.num_attention_heads > 0) {
    COLOSSAL_CHECK_INPUT(m.num_attention_heads % d.tp == 0, "parallel degrees ", all,
                         ": num_attention_heads=", m.num_attention_heads,
                         " is not divisible by tp=", d.tp);
    if (d.sequence_parallel == SequenceParallel::AllToAll)
      COLOSSAL_CHECK_INPUT(
          m.num_attention_heads % (d.tp * d.sp) == 0, "parallel degrees ", all,
          ": all_to_all sequence parallelism scatters the heads over tp*sp = ", d.tp * d.sp,
          " ranks but num_attention_heads=", m.num_attention_heads, " is not divisible by it");
  }
  // Key/value heads are split when there are at least tp of them, and replicated in groups when
  // fewer (each rank holds the one head its query heads read): either way each must divide the
  // other.
  if (m.num_key_value_heads > 0)
    COLOSSAL_CHECK_INPUT(
        m.num_key_value_heads % d.tp == 0 || d.tp % m.num_key_value_heads == 0, "parallel degrees ",
        all, ": num_key_value_heads=", m.num_key_value_heads, " and tp=", d.tp,
        " must divide one another (heads split over tp, or replicated when fewer)");
  if (m.num_layers > 0)
    COLOSSAL_CHECK_INPUT(
        m.num_layers >= d.pp, "parallel degrees ", all, ": pp=", d.pp,
        " stages need at least one layer each but num_hidden_layers=", m.num_layers);
}

namespace {
std::vector<std::pair<Axis, int>> layout(const ParallelDegrees& d, int world, const ModelFacts& m) {
  ParallelDims::validate(d, world, m);
  return {{Axis::DP, d.dp}, {Axis::PP, d.pp}, {Axis::TP, d.tp}, {Axis::SP, d.sp}};
}
}  // namespace

ParallelDims::ParallelDims(const ParallelDegrees& degrees, const ModelFacts& model)
    : ParallelDims(degrees, world(), model) {}

ParallelDims::ParallelDims(const ParallelDegrees& degrees, const Communicator& world,
                           const ModelFacts& model)
    : degrees_(degrees), mesh_(layout(degrees, world.size(), model), world), world_(world) {}

std::vector<int> ParallelDims::ep_ranks() const {
  // Mesh ranks of the dp x sp group (dp slowest), then the block of ep holding this rank.
  const std::vector<int> members = mesh_.group_ranks({Axis::DP, Axis::SP});
  const auto me = std::find(members.begin(), members.end(), mesh_.rank()) - members.begin();
  const auto begin = me / degrees_.ep * degrees_.ep;
  return {members.begin() + begin, members.begin() + begin + degrees_.ep};
}

std::vector<int> ParallelDims::ep_dp_ranks() const {
  const std::vector<int> members = mesh_.group_ranks({Axis::DP, Axis::SP});
  const auto me = std::find(members.begin(), members.end(), mesh_.rank()) - members.begin();
  std::vector<int> out;
  for (auto i = me % degrees_.ep; i < static_cast<decltype(i)>(members.size()); i += degrees_.ep)
    out.push_back(members[static_cast<size_t>(i)]);
  return out;
}

namespace {
Communicator make_group(const Communicator& world, const std::vector<int>& mesh_ranks,
                        const std::string& name) {
  std::vector<int> global;
  for (int r : mesh_ranks) global.push_back(world.global_rank(r));
  std::string full = name;
  for (int g : global) full += "_" + std::to_string(g);
  Communicator c = world.new_group(global, full);
  COLOSSAL_CHECK(c.valid(), "internal: this rank is not in its own ", full, " group");
  return c;
}
}  // namespace

Communicator& ParallelDims::ep() {
  if (!ep_.valid()) ep_ = make_group(world_, ep_ranks(), "ep");
  return ep_;
}

Communicator& ParallelDims::ep_dp() {
  if (!ep_dp_.valid()) ep_dp_ = make_group(world_, ep_dp_ranks(), "ep_dp");
  return ep_dp_;
}

}  // namespace colossal::dist
