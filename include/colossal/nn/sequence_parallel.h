// Sequence parallelism of attention (ColossalAI's sequence_parallelism_mode `all_to_all` and
// `ring_attn`): each rank of an sp group holds a shard of the sequence of every layer's
// activations, and only the core attention — the one step that mixes tokens — communicates.
// Both are CoreAttention layers that a plan puts into the model's `core_attn` slots
// (models::sequence_parallel_plan), so the model's code stays free of collectives; the inputs
// are sharded with shard_sequence() and the rotary tables follow its `positions`.
//
//   all_to_all (DeepSpeed-Ulysses)  rank r holds the contiguous tokens [r*S/sp, (r+1)*S/sp).
//       An all-to-all trades the sequence shard of every head for the whole sequence of heads/sp
//       heads, the inner core attention (SDPA) runs causally over the whole sequence, and an
//       all-to-all trades back. Needs heads (per tensor-parallel rank) divisible by sp.
//   ring_attn (ring attention, zigzag)  the sequence is cut into 2*sp chunks and rank r holds
//       chunks r and 2*sp-1-r, so every rank does the same causal work. Keys/values travel
//       around the sp ring block by block (point-to-point); each block's attention and its
//       log-sum-exp are merged into the running result, and the backward passes keys/values
//       around the ring again with their gradient accumulators, so no rank ever holds more than
//       its own shard plus the block in flight. inner_ring_size (ColossalAI's double ring) makes
//       the ring two-level: inner rings of inner_ring_size consecutive ranks, an outer ring
//       across them; the result is the same.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "colossal/dist/communicator.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/nn/attention.h"

namespace colossal::nn {

// One rank's part of a batch: input and targets [B, S_local] and the global position of each
// local token (int64 [S_local]; pass it as models::ForwardOptions::positions).
struct SequenceShard {
  at::Tensor input, targets, positions;
};

// all_to_all: the contiguous slice r of S/sp tokens; ring_attn: chunks r and 2*sp-1-r of S/(2*sp)
// tokens, in that order (zigzag). The other modes (off, split_gather, ring) take the whole
// sequence on every rank: input and targets come back unchanged with positions 0..S-1, as they
// do for an sp group of one rank. InputError when S is not divisible by sp (all_to_all) or 2*sp
// (ring_attn), naming both, or when input and targets differ in shape. `targets` may be
// undefined (inference): it stays undefined.
SequenceShard shard_sequence(const at::Tensor& input, const at::Tensor& targets,
                             const dist::Communicator& sp, dist::SequenceParallel mode);

// The global positions of rank `rank`'s tokens under `mode` for a sequence of seq_len tokens
// (what shard_sequence returns as positions; same errors).
at::Tensor sequence_positions(int64_t seq_len, int64_t rank, int64_t world,
                              dist::SequenceParallel mode);

// DeepSpeed-Ulysses. q [B, H, S/sp, D], k/v [B, Hkv, S/sp, D] (this rank's contiguous tokens) ->
// [B, H, S/sp, D]. InputError when H is not divisible by sp. Grouped-query key/value heads are
// exchanged as they are when Hkv is divisible by sp (rank j gets kv heads of its query heads);
// otherwise each kv head is first repeated over its query group (H heads are exchanged).
// Takes no explicit mask and no KV cache (InputError).
class AllToAllAttention : public CoreAttention {
 public:
  explicit AllToAllAttention(dist::Communicator sp,
                             std::shared_ptr<CoreAttention> inner = nullptr);  // null: SDPA
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionMask& mask, const SequenceInfo& seq) override;
  const dist::Communicator& group() const { return sp_; }
  std::shared_ptr<CoreAttention> inner;  // runs on the whole sequence of H/sp heads

 private:
  dist::Communicator sp_;
};

// ---- One block of ring attention (what RingAttention runs per block; exposed for the tests) --
// A block: queries q [B, H, qn, D] against keys/values k, v [B, Hkv, kn, D] (Hkv dividing H;
// causal only with qn == kn, aligned at the top left). Three kernels compute it:
//   own        our sm_90a kernels (kernels/attention.h; H100 / H200, bf16, head dims 64 and 128):
//              each batch row one sequence whose queries and keys have offsets of their own,
//              so a block of any shape runs as it is (at B = 1 without copies of q, k or v).
//   flash      ATen's flash-attention kernels (at::_flash_attention_forward / _backward): on a
//              CUDA device of compute capability 8.0 or newer, fp16/bf16, head dimension a
//              multiple of 8 up to 256; any shape; GQA without copies.
//   composite  ATen matmuls in fp32 on any device and dtype (the reference; materialises the
//              block's [qn, kn] scores per head).
enum class RingBlockKernel { composite, flash, own };
// The fastest measured of those that take q (an H100, docs/benchmarks.md 2026-12-07, after the
// one-pass merge): own (1.28x flash's forward+backward at head dims 64 and 128), else flash,
// else composite.
// deterministic (a bitwise repeatable backward, --deterministic): own (its deterministic mode) or
// composite, never flash. COLOSSAL_RING_BLOCKS (read at every call) = own, flash or composite
// forces one (for a comparison; own or flash where it does not apply, or flash when deterministic,
// is an InputError naming why); any other value than "" and "auto" is an InputError.
RingBlockKernel ring_block_kernel(const at::Tensor& q, bool deterministic = false);
const char* to_string(RingBlockKernel kernel);

// Computes the block's attention and merges it into its rows' running result, in place
// (kernels::attention_merge, by log-sum-exp): out [B, H, qn, D] float32 and lse [B, H, qn]
// float32 (a row not yet written holds out 0 and lse -inf; any strides with a unit last stride
// on out). After the blocks of all of a row's keys, out holds the row's attention and lse its
// log-sum-exp. A kernel's own output is merged as it comes (bf16 for own and flash): no float32
// copy of it is made.
void ring_block_forward(RingBlockKernel kernel, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, bool causal, double scale, const at::Tensor& out,
                        const at::Tensor& lse);

// Float32 gradient accumulators of a block (views into the ring's): dq [B, H, qn, D], dk and
// dv [B, Hkv, kn, D].
struct RingBlockGrads {
  at::Tensor dq;
  at::Tensor dk, dv;
};
// Adds the block's share of the gradients for dout ([B, H, qn, D]) to `grads`, in place, given
// the rows' merged output `out` and log-sum-exp `lse` over every block (the softmax's
// probabilities of this block are exp(scores - lse); rowsum(dout * out) is the softmax
// backward's correction). own and flash take out and dout in q's dtype (out as the forward
// returned it), composite in any dtype; their gradients are added as they come (bf16 into the
// float32 accumulators, no float32 copy). deterministic: own's fixed-order dQ sums (flash: an
// InputError; composite is always).
void ring_block_backward(RingBlockKernel kernel, const at::Tensor& dout, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                         const at::Tensor& lse, bool causal, double scale,
                         const RingBlockGrads& grads, bool deterministic = false);

// Zigzag ring attention. q [B, H, 2c, D], k/v [B, Hkv, 2c, D] with Hkv dividing H: this rank's
// chunks r and 2*sp-1-r of c tokens each -> [B, H, 2c, D]. Each block's attention is computed
// by ring_block_kernel(q)'s kernel (ours on an H100 / H200 in bf16, else ATen's flash attention
// on a GPU in fp16/bf16, else the fp32 composite), merged in fp32 by its log-sum-exp, and the
// result cast back to q's dtype; the gradient accumulators of keys/values travel in fp32.
// Everything the ring keeps or sends is stored tokens-major ([B, S, heads, D] memory, seen as
// [B, heads, S, D]): the layout the projections and the rotary kernel hand over, the result's
// reader (o_proj) takes, and in which a batch row's block is our kernels' rows without a copy.
// inner_ring_size 0: one ring. InputError when inner_ring_size is not 0 and not a divisor of sp
// with 1 < inner_ring_size < sp, when the local length is odd, or for an explicit mask or KV
// cache. mask.causal = false attends to every key.
class RingAttention : public CoreAttention {
 public:
  explicit RingAttention(dist::Communicator sp, int64_t inner_ring_size = 0);
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionMask& mask, const SequenceInfo& seq) override;
  const dist::Communicator& group() const { return sp_; }
  int64_t inner_ring_size() const { return inner_; }
  // A bitwise repeatable backward (ring_block_kernel's deterministic choice); use_own_attention
  // sets it with --deterministic.
  void set_deterministic(bool on) { deterministic_ = on; }
  bool deterministic() const { return deterministic_; }

 private:
  dist::Communicator sp_;
  int64_t inner_;
  bool deterministic_ = false;
};

// The function RingAttention runs (an autograd function; scale 1/sqrt(D) as SDPA's). Its block
// kernel (ring_block_kernel) is logged by rank 0 at the first call and when it changes.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const dist::Communicator& sp, bool causal = true,
                          int64_t inner_ring_size = 0, bool deterministic = false);

// InputError unless inner_ring_size is 0 (one ring) or a divisor of sp_size with
// 1 < inner_ring_size < sp_size.
void check_inner_ring_size(int64_t inner_ring_size, int64_t sp_size);

}  // namespace colossal::nn
