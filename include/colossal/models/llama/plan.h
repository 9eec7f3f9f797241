// The tensor-parallel plan of the Llama family (what ColossalAI's LlamaPolicy and torchtitan's
// llama parallelize do), as data for nn::apply_plan: q/k/v and gate/up column-parallel, o and
// down row-parallel, the embedding vocab-parallel. Norms, rotary tables and lm_head stay
// replicated (the vocab-parallel head and its loss belong to the tensor-parallel plugin).
#pragma once

#include <cstdint>

#include "colossal/models/llama/config.h"
#include "colossal/nn/plan.h"

namespace colossal::models {

// InputError naming the size when cfg cannot be split over tp ranks (attention heads,
// intermediate size or vocabulary not divisible by tp; kv heads neither divisible by tp nor
// dividing it: fewer kv heads than tp are replicated, tp / kv ranks per head).
void check_tensor_parallel(const ModelConfig& cfg, int64_t tp);

// The plan for this config. A tied embedding stays whole (the tied head reads all of it).
nn::ParallelPlan tensor_parallel_plan(const ModelConfig& cfg);

}  // namespace colossal::models
