// Our attention kernels (issue 25): flash attention on sm_90a (H100 / H200) written on CuTe,
// bf16 with fp32 accumulation and softmax statistics, head dims 64 and 128, causal or full,
// GQA/MQA without copies, packed variable-length sequences (nothing attended across
// sequences), returning the log-sum-exp per query (what a ring-attention merge needs).
// kernels::attention_reference (attention_reference.h) is its fp64 oracle.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace colossal::kernels {

struct AttentionResult {
  at::Tensor out;  // [T, H, D], q's dtype
  at::Tensor lse;  // [H, T] float32, natural log
};

// Why our kernels do not cover these inputs ("" when they do): this build lacks the sm_90a
// kernels (configured without the CUTLASS headers: scripts/fetch_cutlass.sh), the tensors are
// not on a CUDA device of compute capability 9.0, not bf16, or the head dimension is not 64 or
// 128. The dispatcher (the model's core-attention slot) falls back to SDPA on a non-empty reason.
std::string own_attention_unsupported(const at::Tensor& q, const at::Tensor& k);

// softmax(q k^T * scale) v over packed sequences: q [T, H, D], k and v [T, Hkv, D] (H a
// multiple of Hkv; query head h reads kv head h / (H / Hkv)), the head dimension contiguous;
// sequence i holds tokens [cu_seqlens[i], cu_seqlens[i+1]) (int32 or int64 [n+1]: 0 first, T
// last, non-decreasing), checked on the host: on the CPU they are uploaded once and reused while
// the same tensor comes again (the layers of a forward); on the device each call copies them
// back and synchronises. max_seqlen: at least the longest (computed when <= 0).
// causal: a query attends to the keys of its sequence up to its own position. scale: 1/sqrt(D)
// when 0. `out` (optional, [T, H, D] contiguous, q's dtype) receives the output (tests poison it).
// InputError naming the bad argument, or the reason above when the kernels do not cover it.
// No autograd (attention() below records it).
AttentionResult attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                                  double scale = 0,
                                  const std::optional<at::Tensor>& out = std::nullopt);

// Keys of their own lengths (FlashAttention's cu_seqlens_q / cu_seqlens_k): sequence i's queries
// are rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of q, its keys and values rows [cu_seqlens_k[i],
// cu_seqlens_k[i+1]) of k and v, so k and v may hold another number of rows than q (one block of
// ring attention: queries against another rank's keys, without copies). The same number of
// sequences on both sides; a sequence with queries needs keys and one with keys needs queries
// (their rows would otherwise be left unwritten); causal needs each sequence's two lengths equal.
// max_seqlen_q / max_seqlen_k: at least the longest of each side (computed when <= 0). The
// output and lse are q's rows; the backward's dk and dv k's.
AttentionResult attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                  double scale = 0,
                                  const std::optional<at::Tensor>& out = std::nullopt);

struct AttentionGrads {
  at::Tensor dq, dk, dv;  // contiguous, shaped as q, k, v
};

// The gradients for dout (the output's gradient, [T, H, D]) given the forward's inputs, its
// output and log-sum-exp. deterministic: the partial dQ sums are added in a fixed order, so the
// result is bitwise repeatable (at the cost of waits between the CTAs of a query tile);
// otherwise they are added by fp32 atomics in whatever order the CTAs finish.
AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& dout,
                                  const at::Tensor& lse, const at::Tensor& cu_seqlens,
                                  int64_t max_seqlen, bool causal, double scale = 0,
                                  bool deterministic = false);
// The same with keys of their own lengths (attention_forward's cross-length form above).
AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& dout,
                                  const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                                  const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                  int64_t max_seqlen_k, bool causal, double scale = 0,
                                  bool deterministic = false);

// The kernels' schedules, so one build can measure them against each other (bench_kernels
// --op attention prints every one) and the GPU tests check every one. forward:
//  - plain: one key tile at a time (S = Q K^T, its softmax, then O += P V);
//  - overlap: a tile's softmax overlaps the previous tile's P V GEMM (FlashAttention-3's
//    intra-warpgroup pipelining);
//  - pingpong: overlap, and the two consumer warpgroups take turns at the tensor cores so one's
//    softmax runs under the other's GEMMs.
// dq_tma: the backward adds its partial dQ sums through shared memory and a TMA reduce-add
// issued by a warp of its own instead of fp32 atomics from the consumer warps (deterministic
// mode keeps its ordered atomics). The results of every schedule are equal up to the order of
// the fp32 dQ additions.
struct AttentionSchedule {
  enum class Forward { plain, overlap, pingpong };
  Forward forward = Forward::plain;
  bool dq_tma = false;
  bool operator==(const AttentionSchedule&) const = default;
};
// The schedule the kernels run unless told otherwise: the fastest measured (H100, 2026-12-05
// 14:19Z, docs/benchmarks.md: pingpong's forward at both head dims, dq_tma's backward about
// twice the atomics').
inline constexpr AttentionSchedule kDefaultAttentionSchedule{AttentionSchedule::Forward::pingpong,
                                                             true};
// "plain", "overlap" or "pingpong", optionally followed by "+dq_tma" (also "dq_tma" alone:
// plain+dq_tma). InputError naming the bad part.
AttentionSchedule parse_attention_schedule(const std::string& text);
std::string to_string(const AttentionSchedule& schedule);
// The schedule the kernels run: set_attention_schedule's, else COLOSSAL_ATTENTION_SCHEDULE's
// (read at the first call; a bad value is an InputError then), else kDefaultAttentionSchedule.
AttentionSchedule attention_schedule();
void set_attention_schedule(const AttentionSchedule& schedule);
// Every schedule, for the benchmarks and the GPU tests.
std::vector<AttentionSchedule> attention_schedules();

// "" or, after a launch of our kernels failed because a wait never ended (a barrier protocol
// bug: the kernel traps after seconds of waiting instead of hanging), which kernel, CTA, thread
// and barrier it was. The CLI and the GPU tests print it next to the CUDA error.
std::string attention_hang_report();

// The work lists the kernels run, built on the host from the offsets (exposed for the CPU
// tests): every (sequence, tile) pair that has work, heaviest first, so no CTA is launched
// only to exit (a packed batch of many short documents) and the long tiles do not come last.
// Forward: 128-query tiles; work = the 128-key tiles it reads. Backward: 128-key tiles; work =
// the 64-query tiles that see them. Equal work keeps sequence, then tile order, so a
// sequence's backward key tiles stay in increasing order (deterministic mode's waits go to
// earlier CTAs only).
struct AttentionTile {
  int32_t seq = 0, block = 0;
  int64_t work = 0;
};
std::vector<AttentionTile> attention_forward_tiles(const std::vector<int64_t>& cu_seqlens,
                                                   bool causal);
std::vector<AttentionTile> attention_backward_tiles(const std::vector<int64_t>& cu_seqlens,
                                                    bool causal);
// With keys of their own lengths: the forward's tiles cut the queries and read the keys, the
// backward's cut the keys and read the queries (causal: the lengths are equal, as above).
std::vector<AttentionTile> attention_forward_tiles(const std::vector<int64_t>& cu_seqlens_q,
                                                   const std::vector<int64_t>& cu_seqlens_k,
                                                   bool causal);
std::vector<AttentionTile> attention_backward_tiles(const std::vector<int64_t>& cu_seqlens_q,
                                                    const std::vector<int64_t>& cu_seqlens_k,
                                                    bool causal);

// The backward runs one CTA per (key tile, kv head) pair, and a CTA holds an SM. A cross-length
// call with many queries and few keys (ring attention's block of 2c queries x c keys, at few kv
// heads) can therefore leave SMs idle: at 4 kv heads and 2,048 keys, 64 CTAs on 132 SMs.
// attention_backward_query_parts says how many equal parts a caller should cut each sequence's
// queries into, each part a sequence of its own against its own copy of the keys, the parts'
// dK / dV summed after: the most parts whose CTAs still fit one wave of `multiprocessors`, each
// part whole 64-query tiles and at least kAttentionBwdMinPartTiles of them (a CTA's fixed cost,
// loading its key tile and storing dK / dV, stays a small share of its loop). 1 where the CTAs
// already fill the SMs or the queries are not whole tiles.
inline constexpr int64_t kAttentionBwdMinPartTiles = 4;
int64_t attention_backward_query_parts(int64_t sequences, int64_t queries, int64_t keys,
                                       int64_t kv_heads, int64_t multiprocessors);
// The SMs of a CUDA device (132, an H100 SXM's count, where they cannot be read).
int64_t attention_multiprocessors(const at::Device& device);

// How many heads the CTAs of one launch run together (tile by tile, those heads adjacent)
// before the next heads, so that the CTAs on the GPU at one time share what they read in L2
// instead of streaming every head's keys and values from memory at once. A section holds as
// many kv heads as fit l2_bytes: the forward counts each kv head's K and V (tokens x head_dim,
// bf16), the backward each kv head group's Q, dO (bf16) and fp32 dQ accumulator; at least one
// kv head, at most all. fwd_heads counts query heads (whole kv head groups), bwd_kv_heads kv
// heads. l2_bytes 0: one section (heads fastest over the whole list).
struct AttentionSections {
  int64_t fwd_heads = 0, bwd_kv_heads = 0;
};
AttentionSections attention_sections(int64_t tokens, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, int64_t l2_bytes);
// The budget the kernels use: COLOSSAL_ATTENTION_L2_MB's (MiB; read at the first call, 0 turns
// the sections off, anything but a whole number from 0 to 4096 is an InputError), else 24 MiB
// (about half of an H100's or H200's 50 MB L2). set_attention_l2_budget overrides it (bytes;
// the benchmarks and the GPU tests).
int64_t attention_l2_budget();
void set_attention_l2_budget(int64_t bytes);

// The backward's launch order: CTA i runs the (key tile, kv head) pair numbered order[i] in
// tile_and_head's numbering (src/kernels_sm90/common.cuh: the head sections one after another,
// each tile by tile, heaviest first, its kv heads adjacent). The CTAs are not persistent, so
// the GPU starts them in this order as SMs free up. With the sections strictly one after
// another (interleave 0) the last section's heaviest tiles start only when nearly all other
// work is done and finish alone: by a list-scheduling count on 132 SMs the makespan is 15-18 %
// over the average at W1's packed documents and at W2 with one sequence. interleave (percent)
// sorts the pairs by work - (1 - interleave / 100) x section x the heaviest tile's work
// (stable, highest first), so a later section's heavy tiles start beside an earlier section's
// light ones; 100 is heaviest first across all sections (each section's L2 reuse is then
// shared with the others). A sequence's key tiles of one kv head keep their order at every
// setting (deterministic mode waits only on earlier CTAs).
std::vector<int32_t> attention_backward_order(const std::vector<AttentionTile>& tiles,
                                              int64_t kv_heads, int64_t kv_section,
                                              int64_t interleave);
// The interleave the kernels use: COLOSSAL_ATTENTION_BWD_INTERLEAVE's (read at the first call;
// anything but 'auto' or a whole number from 0 to 100 is an InputError), else
// kAttentionBwdInterleaveDefault. set_attention_bwd_interleave overrides it (the benchmarks and
// the GPU tests).
// kAttentionBwdInterleaveAuto ('auto') picks the interleave per layout with
// attention_bwd_interleave_auto.
inline constexpr int64_t kAttentionBwdInterleaveAuto = -1;
inline constexpr int64_t kAttentionBwdInterleaveDefault = kAttentionBwdInterleaveAuto;
int64_t attention_bwd_interleave();
void set_attention_bwd_interleave(int64_t percent);
// The automatic setting: a list-scheduling count of the launch at each interleave from 0 to
// kAttentionBwdAutoMax in steps of 10 (each CTA, in launch order, to the first of `sms` SMs to
// free; a CTA costs its tile's work times the query heads per kv head, `group`, plus two
// steps), and the lowest interleave whose share of the SMs' time kept busy is within
// kAttentionBwdAutoSlack of the best. The count does not see L2, which the sections are for:
// hence the lowest, and the cap. Measured on an H100 (docs/benchmarks.md, 2026-12-07): past 60
// the sections' L2 reuse is lost (at 100, W2 B4 dense ran 1.65x slower); at 0-60 the packed
// documents and W2 B1 ran 2-10 % faster, W1 dense 1-7 % slower from 25 up, which the count
// keeps at 0.
inline constexpr int64_t kAttentionBwdAutoMax = 60;
// Under `auto`, deterministic mode takes this interleave instead: its CTAs wait for earlier
// key tiles' dQ, which the count does not model, and every shape measured ran faster at 60 than
// at 0 (0.72-0.89x the time, H100, 2026-12-07), W1 and W2 B4 dense included.
inline constexpr int64_t kAttentionBwdAutoDeterministic = 60;
inline constexpr double kAttentionBwdAutoSlack = 0.01;
int64_t attention_bwd_interleave_auto(const std::vector<AttentionTile>& tiles, int64_t kv_heads,
                                      int64_t kv_section, int64_t group, int64_t sms,
                                      bool deterministic = false);

// attention_forward's output with autograd (q, k, v differentiable; the backward above).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                     double scale = 0, bool deterministic = false);

}  // namespace colossal::kernels
