// How a model's decoder layers are split over pipeline stages (pure arithmetic, no model or
// communicator). V = stages * chunks virtual stages v = 0..V-1 in model order: v = 0 also holds
// the embedding, v = V-1 the final norm, the LM head and the loss. The block ranges index a whole
// models::CausalLM (0 = embed_tokens, 1..L = layers.0..L-1, L+1 = norm, L+2 = lm_head) and feed
// CausalLM::keep_chunks. Placements as in schedule.h: Loop (v = chunk * stages + rank) and V
// (chunk 0 of rank r is v = r, chunk 1 is v = 2 * stages - 1 - r).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace colossal::pipeline {

// Layers per virtual stage (size stages * chunks, in virtual-stage order), ColossalAI's default
// rule: L / V each, and the remainder r one more each for the middle slots V/2 - r/2 .. + r - 1.
// L=30, 4 stages: 7 8 8 7. InputError when L < V or stages, chunks < 1.
std::vector<int64_t> distribute_layers(int64_t num_layers, int stages, int chunks = 1);

// A user's num_layers_per_stage: InputError unless it has virtual_stages entries, each >= 1,
// summing to num_layers.
void check_layers_per_stage(const std::vector<int64_t>& layers, int64_t num_layers,
                            int virtual_stages);

// The contiguous split of num_layers over virtual_stages that minimises the largest stage cost,
// where a stage costs layer_cost per layer, virtual stage 0 also first_extra (the embedding) and
// V-1 also last_extra (final norm, head and loss); every stage gets >= 1 layer. Exact (dynamic
// programming); among optimal splits, the one closest to distribute_layers (least sum of
// absolute differences), so with zero extras it is distribute_layers. InputError when
// num_layers < virtual_stages, layer_cost <= 0 or an extra is negative or not finite.
std::vector<int64_t> balance_layers(int64_t num_layers, int virtual_stages, double layer_cost,
                                    double first_extra, double last_extra);

// The block range [begin, end) of every virtual stage: v = 0 starts at block 0 (embedding),
// v = V-1 ends at block L + 3 (norm and lm_head included). InputError on an entry < 1.
std::vector<std::pair<int64_t, int64_t>> stage_block_ranges(
    const std::vector<int64_t>& layers_per_virtual_stage);

// The virtual stage of each of `rank`'s chunks (chunk c = element c) under the Loop placement or
// (v_placement) the V placement, which takes exactly 2 chunks. E.g. to pick a per-virtual-stage
// list (ColossalAI's num_ckpt_layers_per_stage) for a rank. InputError when virtual_stages is
// not a multiple of `stages` or rank is outside [0, stages).
std::vector<int> rank_virtual_stages(int virtual_stages, int stages, int rank, bool v_placement);

// The block ranges of `rank`'s chunks (chunk c = element c, the argument of keep_chunks):
// stage_block_ranges at rank_virtual_stages (same errors).
std::vector<std::pair<int64_t, int64_t>> rank_block_ranges(
    const std::vector<int64_t>& layers_per_virtual_stage, int stages, int rank, bool v_placement);

}  // namespace colossal::pipeline
