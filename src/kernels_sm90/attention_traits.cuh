// The tiles, shared-memory layouts and wgmma shapes of our sm_90a attention kernels
// (attention_fwd.cu, attention_bwd.cu), and the dQ accumulator's layout: one definition that
// the kernels compile and tests/kernels/test_attention_layouts.cu checks on the host (which
// thread holds which rows and columns, what the softmax's shuffles and the dQ stores assume).
#pragma once

#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include <cstdint>

namespace colossal::kernels::cuda::sm90 {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;

// Stages of the forward's K / V ring. Under ncu (H100, 2026-12-05) W2's consumers spent about a
// tenth of their samples waiting for a K tile with two, but as many as shared memory held then
// (3 at head dim 128, 4 at 64) moved the forward's time within run-to-run noise
// (docs/benchmarks.md; three at every head dim again in three interleaved rounds on 2026-12-06:
// 0.98-1.00x; four at 64 with the output staging, 2-4 % slower), so two it stays. Since the output
// staging (Smem::o, 32 KiB at head dim 128) a third stage no longer fits at 128.
inline constexpr int kFwdStages = 2;

template <int kD, int kBlockN, int kStages>
struct FwdTraits {
  static constexpr int kBlockM = 128;
  static constexpr int kThreads = 384;          // producer warpgroup + two consumer warpgroups
  static constexpr int kConsumerThreads = 256;  // 64 query rows each
  using D = Int<kD>;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  using S = Int<kStages>;
  // Q [BM, D] and K [BN, D] K-major (the head dimension contiguous), V as [D, BN] MN-major (the
  // head dimension contiguous too: it is the GEMM's N), 128-byte swizzled as wgmma reads them.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Bf16>{}, Shape<BM, D>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Bf16>{}, Shape<BN, D, S>{}));
  using SmemLayoutV =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Bf16>{}, Shape<D, BN, S>{}));
  using MmaQK = decltype(GMMA::ss_op_selector<Bf16, Bf16, float, Shape<_64, BN, D>, GMMA::Major::K,
                                              GMMA::Major::K>());
  using MmaPV = decltype(GMMA::rs_op_selector<Bf16, Bf16, float, Shape<_64, D, BN>, GMMA::Major::K,
                                              GMMA::Major::MN>());
  using TiledMmaQK = decltype(make_tiled_mma(MmaQK{}, Layout<Shape<_2, _1, _1>>{}));
  using TiledMmaPV = decltype(make_tiled_mma(MmaPV{}, Layout<Shape<_2, _1, _1>>{}));
  // The S accumulator of one thread, ((2 cols, 2 rows, BN/8 col blocks), 1, 1), reread as the
  // A operand of the P V wgmma, ((2, 2, 2), 1, BN/16): the same registers in the same order
  // (checked at compile time against the MMA's own fragment below).
  using LayoutP =
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;

  struct alignas(1024) Smem {
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutV>> v;
    // Each consumer warpgroup's output rows (64 x D bf16) on their way to global memory: written
    // by stmatrix, read back as 16-byte chunks (fwd_o_chunk's swizzle), stored row by row.
    alignas(128) cute::array_aligned<Bf16, 2 * 64 * kD> o;
    alignas(8) uint64_t bar_q, empty_q;
    int item[6];  // the item the producer handed the consumers (attention_fwd.cu)
    uint64_t full_k[kStages], empty_k[kStages], full_v[kStages], empty_v[kStages];
  };
  static constexpr int kBytesQ = kBlockM * kD * 2;
  static constexpr int kBytesKV = kBlockN * kD * 2;
};

// The forward's output staging (FwdTraits::Smem::o): row r's 16-byte chunk c (columns 8c ..
// 8c + 7) of a warpgroup's 64 x D tile sits at chunk c ^ (r % 8) of that row, so the 8 rows of
// one stmatrix 8 x 8 matrix, and the 8 chunks a quarter-warp reads back, hit 8 different bank
// groups (test_attention_layouts checks both).
__host__ __device__ constexpr int fwd_o_chunk(int row, int c) {
  return c ^ (row & 7);
}
// The epilogue's stmatrix .x4 number k of a warp writes four 8 x 8 matrices i: row half i % 2
// and column block 2k + i / 2 of the warp's 16 rows. Register i packs accumulator registers
// (fwd_o_register(k, i), + 1) (register j: column pair element j % 2, row half (j / 2) % 2,
// column block j / 4); lane l addresses row fwd_o_stmatrix_row(w, l) of its warpgroup's tile
// (w: the warp within the warpgroup), in column block fwd_o_stmatrix_block(k, l / 8).
__host__ __device__ constexpr int fwd_o_register(int k, int i) {
  return (2 * k + i / 2) * 4 + 2 * (i % 2);
}
__host__ __device__ constexpr int fwd_o_stmatrix_row(int w, int lane) {
  return 16 * w + 8 * ((lane >> 3) & 1) + (lane & 7);
}
__host__ __device__ constexpr int fwd_o_stmatrix_block(int k, int i) {
  return 2 * k + i / 2;
}
// The epilogue's read back: thread t (of its warpgroup's 128) takes, in its k-th 16-byte read,
// chunk t + 128 k of the tile in row order (a warp reads 512 contiguous bytes of rows) from
// its swizzled slot, and stores it at (row, 8 * chunk) of the output.
struct FwdOReadback {
  int row, chunk, offset;  // offset: in elements, in the warpgroup's staging buffer
};
__host__ __device__ constexpr FwdOReadback fwd_o_readback(int kD, int t, int k) {
  const int q = t + 128 * k, row = q / (kD / 8), chunk = q % (kD / 8);
  return {row, chunk, row * kD + fwd_o_chunk(row, chunk) * 8};
}

// The backward's S^T accumulator (keys x queries) holds, in each thread's registers j, the
// query columns of ((2 columns, 2 rows, column blocks)): register j's column is the thread's
// column slot bwd_query_slot(j), and slot c is first held by register bwd_slot_register(c).
// The kernel reads each slot's log-sum-exp and delta once; test_attention_layouts checks the map.
__host__ __device__ constexpr int bwd_query_slot(int j) {
  return 2 * (j / 4) + j % 2;
}
__host__ __device__ constexpr int bwd_slot_register(int c) {
  return 4 * (c / 2) + c % 2;
}

// Queries per backward step. 128 at head dim 64: half the steps, so each step's fixed costs
// (the pipeline's waits, the dS^T barrier, one dQ reduce-add) are spread over twice the work
// (H100, 2026-12-05: W1's forward+backward 9-10 % faster than with 64). 64 at head dim 128,
// whose accumulators leave no registers for 128, and in deterministic mode, whose ordered dQ
// adds were 40 % slower with 128 (a key tile waits for its predecessor a longer step).
__host__ __device__ constexpr int bwd_block_m(int head_dim, bool deterministic) {
  return head_dim == 64 && !deterministic ? 128 : 64;
}

// kDqTma_: the dQ tile goes out through shared memory and a TMA reduce-add (else atomics from
// the registers), which decides how the warpgroups split dQ's GEMM (kDqSplitM).
template <int kD, int kBlockM_, bool kDqTma_>
struct BwdTraits {
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = 128;       // keys per CTA (64 per consumer warpgroup)
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static constexpr int kConsumers = 256;
  static constexpr int kStatThreads = 64;  // producer threads loading lse / delta per step
  using D = Int<kD>;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  using S = Int<kStages>;
  using Atom = GMMA::Layout_K_SW128_Atom<Bf16>;
  // Row-major tiles (the last dimension contiguous), 128-byte swizzled.
  using SmemLayoutQ = decltype(tile_to_shape(Atom{}, Shape<BM, D, S>{}));  // also dO
  using SmemLayoutK = decltype(tile_to_shape(Atom{}, Shape<BN, D>{}));     // also V
  using SmemLayoutDS = decltype(tile_to_shape(Atom{}, Shape<BN, BM>{}));   // dS^T [key, query]
  // The same bytes read as the transposed (MN-major) operands.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<D, BM, S>{}, Stride<BM, _1, Int<kBlockM * kD>>{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK{}, make_layout(Shape<D, BN>{}, Stride<BN, _1>{})));
  using SmemLayoutDSt =
      decltype(composition(SmemLayoutDS{}, make_layout(Shape<BM, BN>{}, Stride<BN, _1>{})));
  // S^T = K Q^T, dP^T = V dO^T: [BN keys, BM queries], both operands K-major.
  using MmaSdP = decltype(GMMA::ss_op_selector<Bf16, Bf16, float, Shape<_64, BM, D>, GMMA::Major::K,
                                               GMMA::Major::K>());
  // dV += P^T dO, dK += dS^T Q: [BN, D], A from registers, B = dO^T / Q^T MN-major.
  using MmaKV = decltype(GMMA::rs_op_selector<Bf16, Bf16, float, Shape<_64, D, BM>, GMMA::Major::K,
                                              GMMA::Major::MN>());
  // dQ = dS K: [BM, D] split over the warpgroups along the queries when a step has 128 and the
  // tile goes out by TMA (each 64 x D: half the wgmma instructions of a split along D, each
  // twice as wide; W1's forward+backward 2-4 % faster on the H100), else along D (with atomics
  // the split along the queries was 26-45 % slower at W1); A = dS (MN-major view of dS^T),
  // B = K^T (MN-major view of K).
  static constexpr bool kDqSplitM = kBlockM == 128 && kDqTma_;
  using MmaQ =
      decltype(GMMA::ss_op_selector<Bf16, Bf16, float, Shape<_64, Int<kDqSplitM ? kD : kD / 2>, BN>,
                                    GMMA::Major::MN, GMMA::Major::MN>());
  using TiledMmaSdP = decltype(make_tiled_mma(MmaSdP{}, Layout<Shape<_2, _1, _1>>{}));
  using TiledMmaKV = decltype(make_tiled_mma(MmaKV{}, Layout<Shape<_2, _1, _1>>{}));
  using TiledMmaQ = decltype(make_tiled_mma(
      MmaQ{}, Layout<std::conditional_t<kDqSplitM, Shape<_2, _1, _1>, Shape<_1, _2, _1>>>{}));
  // The S^T accumulator ((2, 2, BM/8), 1, 1) read as the A fragment ((2, 2, 2), 1, BM/16).
  using LayoutP =
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockM / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;

  struct alignas(1024) Smem {
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Bf16, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Bf16, 2 * cosize_v<SmemLayoutDS>> ds;  // two steps' dS^T
    alignas(128) float dq[kBlockM * kD];  // dq_tma: one query tile's dQ sum (dq_index order)
    float lse2[kStages][kBlockM];         // lse * log2(e); +inf past the sequence's end
    float delta[kStages][kBlockM];        // rowsum(dO * O)
    alignas(8) uint64_t bar_kv;
    uint64_t full_q[kStages], full_do[kStages], full_stat[kStages], empty[kStages];
  };
  static constexpr int kBytesQ = kBlockM * kD * 2;
  static constexpr int kBytesK = kBlockN * kD * 2;
};

// Where row t (of the whole batch), column c of one head's dQ sum lives within that head's
// [total + 128, D] slab. A backward thread holds dQ's columns 8b + 2q + e of its rows (b: the
// 8-column block, q: the thread's pair within it, e: which of the pair). Its pairs of blocks 2g
// and 2g + 1 form one 16-byte chunk (16g + 2q + {0, 1} and 16g + 8 + 2q + {0, 1}, in that order,
// or swapped in rows t with t & 2: dq_chunk_swap), one float4 for the atomics path. The four
// chunks q of a 16-column group g lie side by side (64 bytes: a warp's vector atomics fill
// whole 32-byte sectors), and odd rows swap the groups in pairs (g ^ 1). With the swapped
// halves, each half-warp's 8-byte stores of one register pair into the dq_tma tile in shared
// memory (rows t .. t + 3) fill the 32 banks once.
__host__ __device__ __forceinline__ int dq_chunk_swap(int64_t t) {
  return int((t >> 1) & 1);
}
__host__ __device__ __forceinline__ int dq_column(int c, int64_t t) {
  const int g = c >> 4, hi = (c >> 3) & 1, q = (c >> 1) & 3, e = c & 1;
  return ((g ^ int(t & 1)) << 4) | (q << 2) | ((hi ^ dq_chunk_swap(t)) << 1) | e;
}
template <int kD>
__host__ __device__ __forceinline__ int64_t dq_index(int64_t t, int c) {
  return t * kD + dq_column(c, t);
}
// The lowest logical column c of row t's physical chunk k, which holds columns c, c + 1, c + 8,
// c + 9 (the last two first where dq_chunk_swap(t)): the inverse of dq_column.
__host__ __device__ __forceinline__ int dq_chunk_column(int k, int64_t t) {
  const int g = (k >> 2) ^ int(t & 1), q = k & 3;
  return 16 * g + 2 * q;
}
// A chunk's four values in both orders: register order (c, c + 1, c + 8, c + 9) to the order
// they lie in at row t of the accumulator, and back (the swap is its own inverse). The atomics
// path adds dq_chunk_vector(registers, t) at (dq_index(t, c) & ~3); the conversion reads that
// float4 and gets the registers' order back (test_attention_layouts checks both against
// dq_column).
__host__ __device__ __forceinline__ float4 dq_chunk_vector(float4 v, int64_t t) {
  return dq_chunk_swap(t) ? make_float4(v.z, v.w, v.x, v.y) : v;
}
// Register i (0..3) of a backward thread's k-th dQ chunk: the dQ accumulator's registers j hold
// ((2 columns, 2 rows, column blocks)), so chunk k = (block pair k / 2, row half k % 2) takes
// registers 8 (k / 2) + 2 (k % 2) + {0, 1} and the same + 4 (test_attention_layouts checks it).
__host__ __device__ constexpr int dq_chunk_register(int k, int i) {
  return 8 * (k / 2) + 2 * (k % 2) + 4 * (i / 2) + i % 2;
}

}  // namespace colossal::kernels::cuda::sm90
