// The tensor-parallel plan of the Llama family (what ColossalAI's LlamaPolicy and torchtitan's
// llama parallelize do), as data for nn::apply_plan: q/k/v and gate/up column-parallel, o and
// down row-parallel, the embedding vocab-parallel. Norms, rotary tables and lm_head stay
// replicated (the vocab-parallel head and its loss belong to the tensor-parallel plugin).
#pragma once

#include <cstdint>

#include "colossal/dist/communicator.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/models/llama/config.h"
#include "colossal/nn/plan.h"

namespace colossal::models {

// InputError naming the size when cfg cannot be split over tp ranks (attention heads,
// intermediate size or vocabulary not divisible by tp; kv heads neither divisible by tp nor
// dividing it: fewer kv heads than tp are replicated, tp / kv ranks per head).
void check_tensor_parallel(const ModelConfig& cfg, int64_t tp);

// The plan for this config. A tied embedding stays whole (the tied head reads all of it).
nn::ParallelPlan tensor_parallel_plan(const ModelConfig& cfg);

// Sequence-parallel attention (sequence_parallel.h): rules that put an all_to_all (Ulysses) or
// ring_attn (zigzag ring) core attention over `sp` into every layer's
// model.layers.*.self_attn.core_attn. The inputs go through nn::shard_sequence and its positions
// into ForwardOptions::positions. Off, split_gather and ring (which live in the tensor-parallel
// linears) get an empty plan. InputError when heads are not divisible by sp (all_to_all) or
// inner_ring_size is not 0 or a divisor of sp in (1, sp) (ring_attn; other modes take 0 only).
nn::ParallelPlan sequence_parallel_plan(const ModelConfig& cfg, dist::SequenceParallel mode,
                                        const dist::Communicator& sp, int64_t inner_ring_size = 0);

}  // namespace colossal::models
