// ParallelDims: the parallel degrees of a run (dp, pp, tp, sp, ep), checked against the world
// size and the model, and the mesh they lay out, with one communicator per axis for the plugins
// (torchtitan's ParallelDims; ColossalAI's HybridParallelPlugin degrees and ProcessGroupMesh).
//
// Layout: the ranks form the C-order grid (dp, pp, tp, sp) of ColossalAI's HybridParallelPlugin
// (the last axis varies fastest, so with sp = 1 the tensor-parallel peers are neighbouring
// ranks). Expert parallelism is not an axis of its own: as in torchtitan, its ranks are borrowed
// from the data x sequence ranks, which ZeRO shards over too: ep() is a block of ep consecutive
// members of the dp x sp group, and ep_dp() the ranks holding the same experts.
//
// Rules (each violation is an InputError naming the degrees and values):
//   every degree >= 1; dp * pp * tp * sp == world size; ep divides dp * sp;
//   sequence parallelism: off -> sp == 1; split_gather / ring (Megatron's, inside the TP group)
//   -> tp > 1 and sp == 1; all_to_all (Ulysses) / ring_attn -> sp > 1 (ColossalAI accepts
//   split_gather with sp > 1 by ignoring sp; here it is refused instead of dropped silently);
//   model facts, when given (> 0): heads % tp == 0; kv heads % tp == 0 or tp % kv heads == 0
//   (fewer key/value heads than tp are replicated, which ColossalAI refuses); layers >= pp; for
//   all_to_all heads % (tp * sp) == 0 (each rank attends over whole heads). The vocabulary is
//   not checked: the vocab-parallel layers pad it to make_vocab_size_divisible_by * tp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "colossal/dist/communicator.h"
#include "colossal/dist/mesh.h"

namespace colossal::dist {

// ColossalAI's sequence_parallelism_mode.
enum class SequenceParallel { Off, SplitGather, Ring, AllToAll, RingAttn };
const char* to_string(SequenceParallel m);
// "off" (or ""), "split_gather", "ring", "all_to_all", "ring_attn"; InputError otherwise.
SequenceParallel parse_sequence_parallel(const std::string& name);

struct ParallelDegrees {
  int dp = 1, pp = 1, tp = 1, sp = 1, ep = 1;
  SequenceParallel sequence_parallel = SequenceParallel::Off;
  std::string describe() const;  // "dp=2 pp=1 tp=2 sp=1 ep=1"
};

// What the degrees must divide; 0 means unknown (not checked).
struct ModelFacts {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t num_layers = 0;
  int64_t vocab_size = 0;
};

class ParallelDims {
 public:
  // Throws InputError (naming the degrees and the values) for every impossible combination.
  static void validate(const ParallelDegrees& degrees, int world_size,
                       const ModelFacts& model = {});

  // Validates, then lays the mesh out over `world` (default: dist::world()). Creating groups
  // does not block (dist::Communicator::new_group): an axis's group is built on first use.
  explicit ParallelDims(const ParallelDegrees& degrees, const ModelFacts& model = {});
  ParallelDims(const ParallelDegrees& degrees, const Communicator& world,
               const ModelFacts& model = {});

  const ParallelDegrees& degrees() const { return degrees_; }
  int world_size() const { return mesh_.world_size(); }
  ProcessGroupMesh& mesh() { return mesh_; }
  const ProcessGroupMesh& mesh() const { return mesh_; }

  // This rank's group along one axis.
  Communicator& dp() { return mesh_.group(Axis::DP); }
  Communicator& pp() { return mesh_.group(Axis::PP); }
  Communicator& tp() { return mesh_.group(Axis::TP); }
  Communicator& sp() { return mesh_.group(Axis::SP); }
  // The group ZeRO and Gemini shard over: the data x sequence ranks (ColossalAI's dp group
  // under all_to_all sequence parallelism), which is dp() when sp == 1.
  Communicator& dp_sp() { return mesh_.group({Axis::DP, Axis::SP}); }
  // Expert parallel: the ep ranks that split the experts, and the dp*sp/ep ranks that hold the
  // same experts (their gradients are averaged over it).
  Communicator& ep();
  Communicator& ep_dp();
  // Any combination of mesh axes (e.g. {PP, TP} for a norm over the model-parallel ranks).
  Communicator& group(const std::vector<Axis>& along) { return mesh_.group(along); }

  // Members (global ranks, in group order) of this rank's expert groups.
  std::vector<int> ep_ranks() const;
  std::vector<int> ep_dp_ranks() const;

 private:
  ParallelDegrees degrees_;
  ProcessGroupMesh mesh_;
  Communicator world_;
  Communicator ep_, ep_dp_;
};

}  // namespace colossal::dist
