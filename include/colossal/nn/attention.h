// The attention pieces every decoder shares: what attention masks out, where a sequence shard
// sits in the whole sequence, the KV cache of decoding, and the core-attention slot — the
// softmax(q k^T) v step between the projections, behind an interface so ring or all-to-all
// (Ulysses) attention, or our own kernels, can replace SDPA without touching the model.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/nn/module.h"

namespace colossal::nn {

// Documents packed into one sequence (training with --doc_mask): a token attends only to the
// tokens before it in its own document. `ids` [B, S] int64 on the compute device numbers the
// documents of each row (equal ids = one document, contiguous); `cu_seqlens` int32 [n + 1] on
// the same device is where each of the n documents of the flattened [B*S] tokens starts (the
// layout of variable-length attention kernels), `max_len` the longest one. Built by
// make_documents() from ids on the CPU (one pass; the uploads do not wait for the device).
struct DocumentMask {
  at::Tensor ids;
  at::Tensor cu_seqlens;
  at::Tensor cu_seqlens_cpu;  // the same offsets on the host (our kernels check them there)
  int64_t max_len = 0;
  bool defined() const { return ids.defined(); }
};
DocumentMask make_documents(const at::Tensor& ids_cpu, const at::Device& device);
// The dense form: bool [B, 1, S, S], true where query i may attend key j (same document, j <= i).
at::Tensor document_causal_mask(const at::Tensor& ids);

// What attention masks out. An undefined `mask` with causal=true is the plain causal case
// (SDPA's is_causal); otherwise `mask` is a bool [B|1, 1, S, kv_len] (true = attend). With
// `documents`, attention also stays inside each document (and `mask`, if defined, still
// applies: a sliding window). A core attention that cannot honour documents must refuse them.
struct AttentionMask {
  at::Tensor mask;
  bool causal = true;
  DocumentMask documents;
};

// Where this rank's tokens sit in the sequence: positions [past + offset, past + offset +
// local_len) of a step whose new tokens number global_len. Without sequence parallelism
// offset = 0 and local_len = global_len (the whole sequence is local).
struct SequenceInfo {
  int64_t past = 0;        // tokens already in the KV cache
  int64_t offset = 0;      // of this rank's first token among the step's new tokens
  int64_t local_len = 0;   // tokens this rank holds
  int64_t global_len = 0;  // new tokens of the step over all ranks
  bool sharded() const { return local_len != global_len; }
};

// Keys and values of every layer so far (post-rotary, as HF caches them). Reserve() to write in
// place; without it each step appends with a concatenation.
struct KVCache {
  std::vector<at::Tensor> k, v;  // per layer [B, kv_heads, capacity, head_dim]
  std::vector<int64_t> len;      // per layer valid length
  int64_t capacity = 0;          // 0: grow by concatenation
  explicit KVCache(int64_t num_layers = 0, int64_t reserve_tokens = 0)
      : k(num_layers), v(num_layers), len(num_layers, 0), capacity(reserve_tokens) {}
  int64_t length(int64_t layer = 0) const { return len.empty() ? 0 : len[layer]; }
  // Appends [B, kvh, S, D] and returns the whole valid [B, kvh, len, D] views.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& k_new,
                                           const at::Tensor& v_new);
};

// softmax(q k^T / sqrt(D) + mask) v. q [B, Hq, S, D], k/v [B, Hkv, kv_len, D] with Hq a multiple
// of Hkv (grouped-query attention without copies) -> [B, Hq, S, D].
class CoreAttention : public Module {
 public:
  virtual at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionMask& mask, const SequenceInfo& seq) = 0;
};

// Whether SdpaAttention takes the variable-length kernel for these queries and mask.
bool varlen_attention_applies(const at::Tensor& q, const AttentionMask& mask);

// at::scaled_dot_product_attention (LibTorch picks flash, cuDNN, efficient or math). Documents:
// on CUDA in fp16/bf16 the variable-length flash kernel (at::_flash_attention_forward over
// cu_seqlens: no [S, S] mask, no work across documents); otherwise SDPA with the dense
// document-causal mask (the masked composite).
class SdpaAttention : public CoreAttention {
 public:
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionMask& mask, const SequenceInfo& seq) override;
};

// Why OwnAttention hands these inputs to SDPA ("" when our kernels take them). Checked in this
// order: a KV cache (past tokens) or a sequence shard, keys of another length than the queries,
// an explicit mask (sliding windows, padding), then the kernels' own reason
// (kernels::own_attention_unsupported: device, dtype, head dimension, a build without them).
std::string own_attention_fallback(const at::Tensor& q, const at::Tensor& k,
                                   const AttentionMask& mask, const SequenceInfo& seq);

// Our attention kernels (kernels/attention.h: FlashAttention-3-class on sm_90a; causal or full,
// GQA without copies, packed documents through their offsets) where they apply, SDPA otherwise
// (--attn_backend own). Each call that falls back is counted with its reason, so a run can say
// which kernel served it. deterministic: the backward adds dQ's partial sums in a fixed order.
class OwnAttention : public CoreAttention {
 public:
  explicit OwnAttention(bool deterministic = false) : deterministic_(deterministic) {}
  bool deterministic() const { return deterministic_; }
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionMask& mask, const SequenceInfo& seq) override;
  int64_t own_calls() const { return own_calls_; }
  int64_t fallback_calls() const { return fallback_calls_; }
  const std::string& fallback_reason() const { return fallback_reason_; }  // the first one
  // "own N calls (schedule S), SDPA M (first reason)": what a run's report says.
  std::string summary() const;

 private:
  bool deterministic_;
  SdpaAttention sdpa_;
  int64_t own_calls_ = 0, fallback_calls_ = 0;
  std::string fallback_reason_;
  at::Tensor uniform_cu_;  // offsets of B equal sequences of S tokens, on the host
};

// Puts one OwnAttention in every core-attention slot under `root` that holds the plain
// SdpaAttention (a slot already given another kind, a sequence-parallel wrapper, stays as it
// is); returns it (its counters cover every layer) and the number of slots replaced. Reads the
// kernels' schedule first, so a bad COLOSSAL_ATTENTION_SCHEDULE is an InputError before any work.
// RingAttention slots (ring_attn, whose blocks may run our kernels: nn::ring_block_kernel) are
// given the deterministic setting. A sequence-parallel plan applied afterwards
// (models::sequence_parallel_plan) keeps what this put in a slot: all_to_all runs it as its inner
// attention, ring_attn takes its deterministic setting.
std::pair<std::shared_ptr<OwnAttention>, int64_t> use_own_attention(torch::nn::Module& root,
                                                                    bool deterministic);

}  // namespace colossal::nn
