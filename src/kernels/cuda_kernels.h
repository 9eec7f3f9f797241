// Launch wrappers of the CUDA kernels, one section per op, each implemented in src/kernels/<op>.cu
// (the ABI between an op's dispatch file <op>.cpp and its kernels). Plain C++: raw pointers,
// element counts and strides, and the stream as the CUDA runtime's opaque handle, so that this
// header compiles without the CUDA toolkit or LibTorch's CUDA headers (a CPU-only LibTorch
// still builds and links the kernels; it never calls them). Every wrapper launches on `stream`
// and reports launch errors as std::runtime_error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "colossal/kernels/adamw_hyper.h"
#include "kernels/attention_tiles.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace colossal::kernels::cuda {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };
using Stream = CUstream_st*;

// ---- RMSNorm: x, y [rows, h] contiguous; w [h]; rstd [rows] fp32 ----
// Whether the register-resident kernels cover this row length when all pointers are 16-byte
// aligned (callers re-align misaligned inputs; otherwise they fall back to the composite).
bool rms_norm_supported(int64_t h, DType dt);
// res/hout (both null, or both [rows, h]): the row normalised is hout = x + res (add_rms_norm).
void rms_norm_fwd(const void* x, const void* res, const void* w, void* y, void* hout, float* rstd,
                  int64_t rows, int64_t h, double eps, DType dt, Stream stream);
// Number of fp32 partial rows of dweight the backward needs: dw_partial is [blocks, h].
int64_t rms_norm_bwd_blocks(int64_t rows, int64_t h, DType dt);
// dres (null or [rows, h]): added to dx (the residual stream's other gradient).
void rms_norm_bwd(const void* dy, const void* x, const void* w, const float* rstd, const void* dres,
                  void* dx, float* dw_partial, void* dw, int64_t rows, int64_t h, DType dt,
                  Stream stream);

// ---- Rotary: x [B, heads, S, D] with strides (sb, sh, ss) and unit last stride; cos/sin
// [B, S, D] with strides (cb, cs); y [B, S, heads, D] contiguous. backward: y = the input
// gradient for the upstream gradient x (the transposed rotation). ----
struct RotaryShape {
  int64_t b, heads, s, d;
  int64_t sb, sh, ss;  // x strides in elements
  int64_t cb, cs;      // cos/sin strides in elements (both tensors share them)
};
void rotary(const void* x, const void* cos, const void* sin, void* y, const RotaryShape& shape,
            bool backward, DType dt, Stream stream);

// ---- SwiGLU: n contiguous elements. amax pointers (fp32 [1], zeroed by the caller; null: not
// computed) receive the max |value| of what the kernel stored (FP8 casts of the outputs skip
// their amax pass: kernels::record_fp8_amax): amax_y of y; amax_dgate / amax_dup of the
// gradients (the same pointer twice for one amax of the packed dgu). ----
void swiglu_fwd(const void* gate, const void* up, void* y, int64_t n, DType dt, Stream stream,
                float* amax_y = nullptr);
void swiglu_bwd(const void* dy, const void* gate, const void* up, void* dgate, void* dup, int64_t n,
                DType dt, Stream stream, float* amax_dgate = nullptr, float* amax_dup = nullptr);
// Packed: gu [rows, 2*cols] contiguous (gate = first cols of a row, up = the rest), y [rows, cols];
// the gradient dgu is packed the same way.
void swiglu_packed_fwd(const void* gu, void* y, int64_t rows, int64_t cols, DType dt, Stream stream,
                       float* amax_y = nullptr);
void swiglu_packed_bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols,
                       DType dt, Stream stream, float* amax_dgu = nullptr);

// ---- Sum of squares of a tensor list (contiguous tensors of one dtype): one fp32 partial per
// block of 65536 elements written to `partials` (sum_squares_blocks(numels) of them), summed
// in fp64 by the caller. Up to kSqMaxTensors tensors per launch. ----
constexpr int kSqMaxTensors = 64;
int64_t sum_squares_blocks(const int64_t* numels, int count);
void sum_squares(const void* const* tensors, const int64_t* numels, int count, DType dt,
                 float* partials, Stream stream);

// ---- Attention merge by log-sum-exp (kernels/attention_merge.h), in place: out [B, H, n, D]
// fp32 and part [B, H, n, D] of dtype dt with unit last strides and the strides below (in
// elements); lse and part_lse [B, H, n] fp32. ----
struct MergeShape {
  int64_t b, h, n, d;
  int64_t out_s[3], part_s[3], lse_s[3], plse_s[3];  // strides of dims B, H, n
};
void attention_merge(float* out, float* lse, const void* part, const float* part_lse,
                     const MergeShape& shape, DType dt, Stream stream);

// ---- Softmax cross-entropy gradient, in place: logits [rows, V] contiguous; targets [rows]
// (ignore_index rows: loss 0, gradient 0); scale: device fp32 scalar or nullptr (= 1). Writes
// row_loss [rows] fp32 = logsumexp - logit[target] and logits := (softmax - onehot) * scale. ----
void cross_entropy_grad(void* logits, const int64_t* targets, float* row_loss, const float* scale,
                        int64_t rows, int64_t V, int64_t ignore_index, DType dt, Stream stream);
// The split-softmax steps: stats [rows, 2] fp32 = (max, sum exp(x - max)) of each row;
// logits := (exp(x - lse[r]) - onehot(targets[r])) * row_scale[r] (targets outside [0, V): no
// onehot).
void softmax_row_stats(const void* logits, float* stats, int64_t rows, int64_t V, DType dt,
                       Stream stream);
void softmax_grad_given_lse(void* logits, const int64_t* targets, const float* lse,
                            const float* row_scale, int64_t rows, int64_t V, DType dt,
                            Stream stream);

// ---- Multi-tensor AdamW: fp32 p/m/v, grads of `grad_dt`, optional working copies of
// `work_dt` (work == nullptr entries: none). One launch per group of up to kAdamWMaxTensors
// tensors. Numerics follow ATen's CUDA fused AdamW (fp32 scalars, fma moments). ----
constexpr int kAdamWMaxTensors = 48;
struct AdamWTensor {
  float* p;
  float* m;
  float* v;
  const void* g;
  void* w;  // nullptr: no working copy
  int64_t n;
  // Max |w| as stored (fp32 [1], zeroed by the caller; nullptr: not computed): the FP8 weight
  // cast of the next forward skips its amax pass (kernels::record_fp8_amax).
  float* amax = nullptr;
};
void adamw(const AdamWTensor* tensors, int count, DType grad_dt, DType work_dt,
           const AdamWStep& hyper, Stream stream);

// ---- Dequantisation of frozen weights (kernels/quant.h), output `dt` contiguous ----
// NF4: codes [ceil(n / 2)] (high nibble first); absmax fp32 [blocks] (absmax_codes == nullptr)
// or uint8 codes of dmap (fp32 [256]) times absmax2 [ceil(blocks / blocksize2)] plus offset.
// levels: the 16 NF4 levels (host array, copied to the kernel's parameters).
void nf4_dequantize(const uint8_t* codes, const float* absmax, const uint8_t* absmax_codes,
                    const float* absmax2, const float* dmap, float offset, const float* levels,
                    void* out, int64_t n, int64_t blocksize, int64_t blocksize2, DType dt,
                    Stream stream);
// FP8 e4m3 rows: codes [rows, cols] (raw bytes), scale fp32 [rows].
void fp8_rows_dequantize(const uint8_t* codes, const float* scale, void* out, int64_t rows,
                         int64_t cols, DType dt, Stream stream);

// ---- FP8 casts with current scaling (kernels/fp8.h): x [rows, cols] contiguous of `dt`;
// e5m2 false: float8_e4m3fn, true: float8_e5m2. amax: fp32 [1] (tensorwise) or [rows]
// (rowwise), written; scale / inv_scale likewise; out [rows, cols] and out_t [cols, rows]
// (nullptr: not written) raw fp8 bytes. ----
// amax_given (tensorwise): amax already holds the tensor's amax (a kernel that wrote x recorded
// it: kernels::known_fp8_amax); the amax pass is skipped.
void fp8_cast(const void* x, int64_t rows, int64_t cols, bool rowwise, bool e5m2, float fp8_max,
              float* amax, float* scale, float* inv_scale, uint8_t* out, uint8_t* out_t, DType dt,
              Stream stream, bool amax_given = false);
// Tensorwise casts of xs[i] ([rows[i], cols], contiguous, of `dt`) as their concatenation along
// rows: one amax (fp32 [1]) over all, out [sum rows, cols], out_t [cols, sum rows] or nullptr.
// amax_given: amax already holds the amax over all parts (the pass is skipped).
void fp8_cast_rows_concat(const std::vector<const void*>& xs, const std::vector<int64_t>& rows,
                          int64_t cols, bool e5m2, float fp8_max, float* amax, float* scale,
                          float* inv_scale, uint8_t* out, uint8_t* out_t, DType dt, Stream stream,
                          bool amax_given = false);

// ---- Attention on sm_90a (issue 25; src/kernels_sm90/, built when the CUTLASS headers are
// present: attention_sm90_built()). bf16 q [total, heads, head_dim] with row stride
// q_row_stride (elements), k and v [total, kv_heads, head_dim] with row strides kv_row_stride and
// v_row_stride,
// the head dimension contiguous, 16-byte aligned; sequence i holds tokens [cu_seqlens[i],
// cu_seqlens[i+1]) (int32 [sequences + 1], on the device), max_seqlen the longest; its keys and
// values rows [cu_seqlens_k[i], cu_seqlens_k[i+1]) of k and v (total_k rows) when cu_seqlens_k
// is given. out [total, heads, head_dim] contiguous bf16; lse fp32 [heads, total] (natural log).
// ----
// The forward's schedules (kernels/attention.h, AttentionSchedule): one key tile at a time;
// FlashAttention-3's intra-warpgroup overlap of a tile's softmax with the previous tile's P V;
// that plus the two consumer warpgroups taking turns at the tensor cores.
enum class AttentionFwdSchedule { plain, overlap, pingpong };

struct AttentionFwdArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  const int* cu_seqlens = nullptr;
  // The keys' offsets and rows (kernels::attention_forward's cross-length form); nullptr / 0:
  // cu_seqlens and total (the keys are the queries' rows).
  const int* cu_seqlens_k = nullptr;
  int64_t total_k = 0;
  int64_t total = 0, sequences = 0, max_seqlen = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_row_stride = 0, kv_row_stride = 0, v_row_stride = 0;
  bool causal = true;
  double scale = 0;
  float* out_amax = nullptr;  // forward: max |out| as stored (fp32 [1], zeroed), or nullptr
  // The work list: int32 (sequence, tile) pairs, heaviest first; one CTA per pair and head (the
  // forward's query tiles; the backward's key tiles, per kv head, in bwd_tiles).
  const int* tiles = nullptr;
  int64_t tile_count = 0;
  // CTAs run the heads in sections of this many (query heads, a multiple of heads / kv_heads;
  // 0: all heads in one): within a section tile by tile, the section's heads adjacent, so the
  // CTAs on the GPU at one time share their keys and values in L2 (kernels::attention_sections).
  int64_t head_section = 0;
  // Forward: int32 [1], zero at launch (the persistent CTAs' item counter).
  int* work_counter = nullptr;
  AttentionFwdSchedule schedule = AttentionFwdSchedule::plain;
};
// Whether this build holds the sm_90a kernels (the CUTLASS headers were found at configure time).
bool attention_sm90_built();
bool attention_sm90_supported(int64_t head_dim);
void attention_sm90_fwd(const AttentionFwdArgs& args, Stream stream);
// Backward: out (the forward's output, contiguous [total, heads, head_dim]) and dout (head
// dimension contiguous, row stride dout_row_stride), lse from the forward. Workspaces: delta
// fp32 [heads, total], dq_accum fp32 [attention_sm90_dq_accum_elements(..)] (its own layout),
// and in deterministic mode dq_semaphore int32 [semaphore_count =
// attention_sm90_bwd_semaphores(..)]. Outputs contiguous bf16: dq [total, heads, head_dim], dk
// and dv [total_k, kv_heads, head_dim]. dq_tma (not with deterministic): the partial dQ sums go
// through shared memory and a TMA reduce-add issued by a warp of their own, instead of fp32
// atomics from the consumer warps.
struct AttentionBwdArgs : AttentionFwdArgs {
  const void* dout = nullptr;
  int64_t dout_row_stride = 0;
  float* delta = nullptr;
  float* dq_accum = nullptr;
  int* dq_semaphore = nullptr;
  int64_t semaphore_count = 0;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  bool deterministic = false;
  bool dq_tma = false;
  const int* bwd_tiles = nullptr;
  int64_t bwd_tile_count = 0;
  // int32 [bwd_tile_count x kv_heads]: CTA i runs tile_and_head(bwd_order[i], ...)
  // (kernels::attention_backward_order).
  const int* bwd_order = nullptr;
  int64_t kv_head_section = 0;  // as head_section, in kv heads, for the backward's CTAs
};
int64_t attention_sm90_dq_accum_elements(int64_t total, int64_t heads, int64_t head_dim);
// "" or what a hung wait of the kernels recorded before it stopped the launch (a trap): kernel,
// CTA, thread, barrier, stage and phase.
std::string attention_sm90_hang_report();
int64_t attention_sm90_bwd_semaphores(int64_t sequences, int64_t max_seqlen, int64_t heads);
void attention_sm90_bwd(const AttentionBwdArgs& args, Stream stream);

}  // namespace colossal::kernels::cuda
