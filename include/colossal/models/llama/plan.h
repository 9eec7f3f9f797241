// The tensor-parallel plan of the Llama family (what ColossalAI's LlamaPolicy and torchtitan's
// llama parallelize do), as data for nn::apply_plan: q/k/v and gate/up column-parallel, o and
// down row-parallel, the embedding vocab-parallel and lm_head column-parallel over the
// vocabulary, both padded to a multiple of make_vocab_size_divisible_by * tp. A tied head is
// the embedding's shard itself (one weight, sharded once, both uses accumulate into its
// gradient). Norms and rotary tables stay replicated.
#pragma once

#include <cstdint>

#include "colossal/dist/communicator.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/models/llama/config.h"
#include "colossal/nn/plan.h"

namespace colossal::models {

// ColossalAI's shard_config knobs of the vocabulary-parallel layers.
struct TensorParallelOptions {
  // The vocabulary is padded to a multiple of this times tp (ColossalAI's
  // make_vocab_size_divisible_by); padded rows are zero, never looked up, never saved.
  int64_t make_vocab_size_divisible_by = 64;
  // true: the head's logits stay vocab-sharded (CausalLM::forward returns this rank's columns
  // of the padded vocabulary; forward_loss takes the vocab-parallel cross-entropy); false:
  // the head gathers them and forward returns [.., vocab_size].
  bool parallel_output = true;
};

// InputError naming the size when cfg cannot be split over tp ranks (attention heads or
// intermediate size not divisible by tp; kv heads neither divisible by tp nor dividing it:
// fewer kv heads than tp are replicated, tp / kv ranks per head). The vocabulary is padded
// instead.
void check_tensor_parallel(const ModelConfig& cfg, int64_t tp);

// The plan for this config: with an untied head, model.embed_tokens Vocab and lm_head Column,
// both padded; tied, model.embed_tokens alone (lm_head is its weight). InputError when
// make_vocab_size_divisible_by < 1.
nn::ParallelPlan tensor_parallel_plan(const ModelConfig& cfg,
                                      const TensorParallelOptions& options = {});

// Sequence-parallel attention (sequence_parallel.h): rules that put an all_to_all (Ulysses) or
// ring_attn (zigzag ring) core attention over `sp` into every layer's
// model.layers.*.self_attn.core_attn. The inputs go through nn::shard_sequence and its positions
// into ForwardOptions::positions. Off, split_gather and ring (which live in the tensor-parallel
// linears) get an empty plan. InputError when heads are not divisible by sp (all_to_all) or
// inner_ring_size is not 0 or a divisor of sp in (1, sp) (ring_attn; other modes take 0 only).
nn::ParallelPlan sequence_parallel_plan(const ModelConfig& cfg, dist::SequenceParallel mode,
                                        const dist::Communicator& sp, int64_t inner_ring_size = 0);

}  // namespace colossal::models
