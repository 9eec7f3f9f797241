// Issue 25: our own attention forward for sm_90a (H100 / H200), bf16 in, fp32 accumulation and
// softmax statistics, head dims 64 and 128, causal or full, GQA/MQA (a query head reads kv head
// h / (H / Hkv) in place), packed variable-length sequences (cu_seqlens: nothing attended
// across sequences, causal within each), writing the output and the log-sum-exp per query.
//
// Built on CuTe (CUTLASS's headers, scripts/fetch_cutlass.sh), not on FlashAttention's code; the
// structure follows the FlashAttention-3 paper (Shah et al., 2024):
//  - items (128-query tile of a sequence, head) from a host-built work list that holds only
//    tiles with work, heaviest first (the causal tiles with the most keys; long documents before
//    short ones), the heads of a section adjacent (tile_and_head); persistent CTAs, one per SM,
//    each drawing the list's next item when it is ready for one (an atomic counter), so one
//    item's output is written while the next item's Q and first key tiles load; three
//    warpgroups: the first only issues TMA loads (Q per item, then K and V tiles into a
//    two-stage ring guarded by mbarriers), the other two each own 64 query rows and run the two
//    GEMMs as wgmma (S = Q K^T from shared memory, O += P V with P from registers, never written
//    to shared memory);
//  - online softmax in base 2 on the fp32 S fragment (a row's four threads reduce by shuffles);
//  - the key tiles run from the last to the first, so only the first tiles need the causal and
//    sequence-end masks;
//  - tiles of rows past a sequence's end read the next sequence's tokens (or TMA's zero fill
//    past the end of the batch) and are masked; rows past the end are never written;
//  - a sequence's keys may be rows of their own (cu_seqlens_k, another count than the queries':
//    one block of ring attention), each side masked at its own end.
// Compiled only for sm_90a (wgmma, TMA, setmaxnreg); cuda_kernels.h declares the launcher.
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>
#include <cutlass/cluster_launch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"
#include "kernels_sm90/attention_traits.cuh"
#include "kernels_sm90/common.cuh"

namespace colossal::kernels::cuda {

namespace {

using namespace cute;
using namespace sm90;
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;
using NamedBarrier = cutlass::arch::NamedBarrier;
constexpr int kTurn = 1;    // named barriers kTurn, kTurn + 1: the ping-pong turns
constexpr int kOStage = 3;  // kOStage + w: warpgroup w's output staging

struct FwdParams {
  Bf16* o;
  float* lse;
  float* amax;  // null, or max |o| as stored (zeroed by the caller)
  const int* cu_seqlens;
  const int* cu_seqlens_k;  // the keys' offsets (cu_seqlens's values unless given their own)
  const int* tiles;         // (sequence, query tile) pairs
  int* next_item;           // the persistent CTAs' counter of items drawn after their first (zero)
  HangRecord* hang;
  int heads, kv_heads, total, total_k, tile_count, head_section;
  float scale_log2;  // softmax scale * log2(e)
  float scale;
};

template <class Traits, bool kCausal, bool kOverlap, bool kPingpong, class TmaQ, class TmaK,
          class TmaV>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_fwd_kernel(CUTE_GRID_CONSTANT FwdParams const p, CUTE_GRID_CONSTANT TmaQ const tma_q,
                         CUTE_GRID_CONSTANT TmaK const tma_k, CUTE_GRID_CONSTANT TmaV const tma_v) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = Traits;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::BN::value, kStages = T::S::value;
  extern __shared__ __align__(1024) char smem_raw[];  // 128-byte swizzles need 1024
  auto& s = *reinterpret_cast<typename T::Smem*>(smem_raw);

  // Persistent: CTA b runs item (work-list entry, head) b first, then whichever item is next in
  // the list when it is ready for one (a counter in global memory, zero at launch): the list's
  // order is the order items start in, as with one CTA per item, and a CTA that drew light
  // items draws more. The producer draws and decodes; the consumers read the decoded item from
  // shared memory (no dependent global loads between the Q barrier and their first GEMM).
  const int items = p.tile_count * p.heads;
  // One item's coordinates (the same in every role).
  // start, len: the queries' first row and count; k_start, k_len: the keys'.
  struct Item {
    int head, kv_head, m_block, start, len, k_start, k_len, n_blocks;
  };
  auto make_item = [&](int head, int m_block, int start, int len, int k_start, int k_len) {
    Item it;
    it.head = head;
    it.kv_head = head / (p.heads / p.kv_heads);
    it.m_block = m_block;
    it.start = start;
    it.len = len;
    it.k_start = k_start;
    it.k_len = k_len;
    // The work list holds tiles with work only (m_block * kBlockM < len).
    it.n_blocks = (k_len + kBlockN - 1) / kBlockN;
    if constexpr (kCausal)
      it.n_blocks = min(it.n_blocks, ((m_block + 1) * kBlockM + kBlockN - 1) / kBlockN);
    return it;
  };
  auto decode = [&](int w) {
    const TileHead th = tile_and_head(w, p.tile_count, p.heads, p.head_section);
    const int seq = p.tiles[2 * th.tile], start = p.cu_seqlens[seq];
    const int k_start = p.cu_seqlens_k[seq];
    return make_item(th.head, p.tiles[2 * th.tile + 1], start, p.cu_seqlens[seq + 1] - start,
                     k_start, p.cu_seqlens_k[seq + 1] - k_start);
  };
  // Volatile: the barriers' asm carries no memory clobber, so only volatile accesses keep their
  // place before the producer's arrive and after the consumers' wait.
  // head (-1: no items left), m_block, start, len, k_start, k_len
  volatile int* handed = s.item;

  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    FullBarrier::init(&s.bar_q, 1);
    EmptyBarrier::init(&s.empty_q, T::kConsumerThreads);
    for (int i = 0; i < kStages; ++i) {
      FullBarrier::init(&s.full_k[i], 1);
      FullBarrier::init(&s.full_v[i], 1);
      EmptyBarrier::init(&s.empty_k[i], T::kConsumerThreads);
      EmptyBarrier::init(&s.empty_v[i], T::kConsumerThreads);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(s.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(s.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(s.v.data()), typename T::SmemLayoutV{});

  if (warpgroup == 0) {
    // Producer: one thread issues every load; the warpgroup gives its registers to the others.
    // The K / V ring's position (it) runs on across items; Q is loaded once the consumers have
    // released the previous item's (after its last S GEMM), so the next item's Q and first
    // key tiles arrive while the consumers finish the last tile and write the output.
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (warp == 0 && cute::elect_one_sync()) {
      Tensor mQ = tma_q.get_tma_tensor(make_shape(p.total, typename T::D{}, p.heads));
      Tensor mK = tma_k.get_tma_tensor(make_shape(p.total_k, typename T::D{}, p.kv_heads));
      Tensor mV = tma_v.get_tma_tensor(make_shape(typename T::D{}, p.total_k, p.kv_heads));
      int it = 0;
      int w = int(blockIdx.x);
      for (int k = 0;; ++k) {
        // The consumers have read the previous item (and released its Q): hand them this one,
        // or head -1 (none left: they stop).
        const Item c = w < items ? decode(w) : Item{-1, 0, 0, 0, 0, 0, 0, 0};
        watched_wait(&s.empty_q, (k & 1) ^ 1, p.hang, kHangFwd, kWaitEmptyQ, 0);
        handed[0] = c.head;
        handed[1] = c.m_block;
        handed[2] = c.start;
        handed[3] = c.len;
        handed[4] = c.k_start;
        handed[5] = c.k_len;
        if (w >= items) {
          FullBarrier::arrive(&s.bar_q);  // completes the phase with no bytes: releases it
          break;
        }
        w = int(gridDim.x) + atomicAdd(p.next_item, 1);  // the next, drawn early
        Tensor gQ = local_tile(domain_offset(make_coord(c.start, _0{}), mQ(_, _, c.head)),
                               Shape<typename T::BM, typename T::D>{}, make_coord(c.m_block, _0{}));
        Tensor gK = local_tile(domain_offset(make_coord(c.k_start, _0{}), mK(_, _, c.kv_head)),
                               Shape<typename T::BN, typename T::D>{}, make_coord(_, _0{}));
        Tensor gV = local_tile(domain_offset(make_coord(_0{}, c.k_start), mV(_, _, c.kv_head)),
                               Shape<typename T::D, typename T::BN>{}, make_coord(_0{}, _));
        auto [tQg, tQs] = tma_partition(tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                        group_modes<0, 2>(gQ));
        auto [tKg, tKs] = tma_partition(tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                        group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(gV));
        FullBarrier::arrive_and_expect_tx(&s.bar_q, T::kBytesQ);  // releases the item too
        copy(tma_q.with(s.bar_q), tQg, tQs);
        for (int i = 0; i < c.n_blocks; ++i, ++it) {
          const int n = c.n_blocks - 1 - i, stage = it % kStages;
          const uint32_t phase = (it / kStages) & 1;
          watched_wait(&s.empty_k[stage], phase ^ 1, p.hang, kHangFwd, kWaitEmptyK, stage);
          FullBarrier::arrive_and_expect_tx(&s.full_k[stage], T::kBytesKV);
          copy(tma_k.with(s.full_k[stage]), tKg(_, n), tKs(_, stage));
          watched_wait(&s.empty_v[stage], phase ^ 1, p.hang, kHangFwd, kWaitEmptyV, stage);
          FullBarrier::arrive_and_expect_tx(&s.full_v[stage], T::kBytesKV);
          copy(tma_v.with(s.full_v[stage]), tVg(_, n), tVs(_, stage));
        }
      }
    }
    return;
  }

  // Consumers: 256 threads, two warpgroups of 64 query rows.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ct = threadIdx.x - 128;
  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ct);
  auto thr_pv = mma_pv.get_thread_slice(ct);
  Tensor tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ));  // (MMA, 1, D/16)
  Tensor tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK));  // (MMA, 1, D/16, stages)
  Tensor tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV));  // (MMA, 1, BN/16, stages)
  Tensor accO = partition_fragment_C(mma_pv, Shape<typename T::BM, typename T::D>{});
  Tensor cS = make_identity_tensor(Shape<typename T::BM, typename T::BN>{});
  Tensor tScS = thr_qk.partition_C(cS);  // (row, col) in the tile of each S register
  Tensor cO = make_identity_tensor(Shape<typename T::BM, typename T::D>{});
  Tensor tOcO = thr_pv.partition_C(cO);
  using FragA = decltype(thr_pv.partition_fragment_A(
      make_tensor(make_smem_ptr((Bf16*)nullptr),
                  make_layout(Shape<typename T::BM, typename T::BN>{}, LayoutRight{}))));
  static_assert(std::is_same_v<typename FragA::layout_type, typename T::LayoutP>,
                "the S accumulator does not read as the P V wgmma's A fragment");

  // Row statistics of this thread's two rows (r = 0, 1: rows i and i + 8 of its warp's 16).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  // The current item's query and key counts, and its first query (within the sequence).
  int len = 0, k_len = 0, q_row0 = 0;

  // Mask key tile n's scores in accS, fold them into the row statistics, write P (bf16) into rp
  // and the factor the output accumulated so far must take into corr (the caller applies it
  // once no P V GEMM that reads the accumulator is still running).
  auto softmax_step = [&](auto& accS, int n, auto& rp, float(&corr)[2]) {
    // Masks: keys past the sequence's end, and (causal) keys after the query.
    const int k_col0 = n * kBlockN;
    const bool need_mask = k_col0 + kBlockN > k_len || (kCausal && k_col0 + kBlockN - 1 > q_row0);
    if (need_mask) {
      CUTE_UNROLL
      for (int j = 0; j < size(accS); ++j) {
        const int row = q_row0 + get<0>(tScS(j)), col = k_col0 + get<1>(tScS(j));
        if (col >= k_len || (kCausal && col > row)) accS(j) = -INFINITY;
      }
    }
    // Online softmax in base 2. Register j of accS is column pair element j % 2, row (j / 2) % 2,
    // column block j / 4 (the wgmma accumulator's order).
    float new_max[2] = {row_max[0], row_max[1]};
    CUTE_UNROLL
    for (int j = 0; j < size(accS); ++j)
      new_max[(j >> 1) & 1] = fmaxf(new_max[(j >> 1) & 1], accS(j));
    float scaled_max[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffff, new_max[r], 1));
      new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffff, new_max[r], 2));
      // A row with every key masked so far keeps max -inf: its exponentials are exp2(-inf) = 0.
      scaled_max[r] = new_max[r] == -INFINITY ? 0.f : new_max[r] * p.scale_log2;
      corr[r] = sm90::exp2_approx(row_max[r] * p.scale_log2 - scaled_max[r]);
      row_max[r] = new_max[r];
      row_sum[r] *= corr[r];
    }
    CUTE_UNROLL
    for (int j = 0; j < size(accS); ++j) {
      const int r = (j >> 1) & 1;
      const float e = sm90::exp2_approx(accS(j) * p.scale_log2 - scaled_max[r]);
      row_sum[r] += e;
      rp(j) = Bf16(e);
    }
  };
  auto rescale_o = [&](const float(&corr)[2]) {
    CUTE_UNROLL
    for (int j = 0; j < size(accO); ++j) accO(j) *= corr[(j >> 1) & 1];
  };
  using FragS = decltype(partition_fragment_C(mma_qk, Shape<typename T::BM, typename T::BN>{}));

  // Ping-pong (kPingpong): the two consumer warpgroups take turns issuing their GEMMs, so that
  // one's softmax runs while the other's GEMMs hold the tensor cores. Warpgroup w waits on
  // barrier kTurn + w before it issues and hands the turn over after. The turns alternate
  // across items too (both warpgroups take the same number per item): the second warpgroup
  // hands the first its first turn before the first item, and the first takes the second's
  // last hand-over after the last, so every arrival is matched and neither warpgroup ever has
  // two arrivals pending on one barrier.
  const int cw = warpgroup - 1;
  auto turn_begin = [&] {
    if constexpr (kPingpong) NamedBarrier::sync(T::kConsumerThreads, kTurn + cw);
  };
  auto turn_end = [&] {
    if constexpr (kPingpong) NamedBarrier::arrive(T::kConsumerThreads, kTurn + 1 - cw);
  };
  if constexpr (kPingpong)
    if (cw == 1) NamedBarrier::arrive(T::kConsumerThreads, kTurn);

  int it = 0;  // the K / V ring's position, as the producer's
  for (int k = 0;; ++k) {
    watched_wait(&s.bar_q, k & 1, p.hang, kHangFwd, kWaitBarQ, 0);
    if (handed[0] < 0) break;
    const Item c = make_item(handed[0], handed[1], handed[2], handed[3], handed[4], handed[5]);
    const int n_blocks = c.n_blocks;
    len = c.len;
    k_len = c.k_len;
    q_row0 = c.m_block * kBlockM;  // the tile's first query, within the sequence
    clear(accO);
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
    if constexpr (!kOverlap) {
      // One key tile at a time: S = Q K^T, its softmax, then O += P V.
      for (int i = 0; i < n_blocks; ++i) {
        const int stage = (it + i) % kStages;
        const uint32_t phase = ((it + i) / kStages) & 1;
        Tensor accS = partition_fragment_C(mma_qk, Shape<typename T::BM, typename T::BN>{});
        watched_wait(&s.full_k[stage], phase, p.hang, kHangFwd, kWaitFullK, stage);
        sm90::gemm_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, stage), accS);
        warpgroup_wait<0>();
        warpgroup_fence_operand(accS);
        EmptyBarrier::arrive(&s.empty_k[stage]);
        if (i == n_blocks - 1) EmptyBarrier::arrive(&s.empty_q);  // the last read of Q
        Tensor rP = make_tensor<Bf16>(typename FragS::layout_type{});
        float corr[2];
        softmax_step(accS, n_blocks - 1 - i, rP, corr);
        rescale_o(corr);
        Tensor tOrP = make_tensor(rP.data(), typename T::LayoutP{});
        watched_wait(&s.full_v[stage], phase, p.hang, kHangFwd, kWaitFullV, stage);
        warpgroup_fence_operand(tOrP);
        sm90::gemm_batch<false>(mma_pv, tOrP, tOrV(_, _, _, stage), accO);
        warpgroup_wait<0>();
        warpgroup_fence_operand(accO);
        EmptyBarrier::arrive(&s.empty_v[stage]);
      }
    } else {
      // FlashAttention-3's intra-warpgroup pipelining: S_i is issued, then P_{i-1} V_{i-1}; once
      // S_i is done its softmax runs while P V still computes; the accumulator is rescaled after
      // that GEMM has finished (it reads and writes accO), and P_{i-1}'s registers are reused
      // only then (the GEMM reads them).
      Tensor rP = make_tensor<Bf16>(typename FragS::layout_type{});
      float corr[2];
      {
        const int stage = it % kStages;
        const uint32_t phase = (it / kStages) & 1;
        Tensor accS = partition_fragment_C(mma_qk, Shape<typename T::BM, typename T::BN>{});
        turn_begin();
        watched_wait(&s.full_k[stage], phase, p.hang, kHangFwd, kWaitFullK, stage);
        sm90::gemm_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, stage), accS);
        turn_end();
        warpgroup_wait<0>();
        warpgroup_fence_operand(accS);
        EmptyBarrier::arrive(&s.empty_k[stage]);
        if (n_blocks == 1) EmptyBarrier::arrive(&s.empty_q);  // the last read of Q
        softmax_step(accS, n_blocks - 1, rP, corr);  // accO is still zero: nothing to rescale
      }
      for (int i = 1; i < n_blocks; ++i) {
        const int stage = (it + i) % kStages, prev = (it + i - 1) % kStages;
        const uint32_t phase = ((it + i) / kStages) & 1, prev_phase = ((it + i - 1) / kStages) & 1;
        Tensor accS = partition_fragment_C(mma_qk, Shape<typename T::BM, typename T::BN>{});
        Tensor tOrP = make_tensor(rP.data(), typename T::LayoutP{});
        turn_begin();
        watched_wait(&s.full_k[stage], phase, p.hang, kHangFwd, kWaitFullK, stage);
        sm90::gemm_batch<true>(mma_qk, tSrQ, tSrK(_, _, _, stage), accS);
        watched_wait(&s.full_v[prev], prev_phase, p.hang, kHangFwd, kWaitFullV, prev);
        warpgroup_fence_operand(tOrP);
        sm90::gemm_batch<false>(mma_pv, tOrP, tOrV(_, _, _, prev), accO);
        turn_end();
        warpgroup_wait<1>();  // S_i done; P_{i-1} V_{i-1} may still run
        warpgroup_fence_operand(accS);
        EmptyBarrier::arrive(&s.empty_k[stage]);
        if (i == n_blocks - 1) EmptyBarrier::arrive(&s.empty_q);  // the last read of Q
        Tensor rP_next = make_tensor<Bf16>(typename FragS::layout_type{});
        softmax_step(accS, n_blocks - 1 - i, rP_next, corr);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrP);  // P_{i-1}'s registers stay live until the GEMM read them
        warpgroup_fence_operand(accO);
        EmptyBarrier::arrive(&s.empty_v[prev]);
        rescale_o(corr);
        CUTE_UNROLL
        for (int j = 0; j < size(rP); ++j) rP(j) = rP_next(j);
      }
      {
        const int stage = (it + n_blocks - 1) % kStages;
        const uint32_t phase = ((it + n_blocks - 1) / kStages) & 1;
        Tensor tOrP = make_tensor(rP.data(), typename T::LayoutP{});
        turn_begin();
        watched_wait(&s.full_v[stage], phase, p.hang, kHangFwd, kWaitFullV, stage);
        warpgroup_fence_operand(tOrP);
        sm90::gemm_batch<false>(mma_pv, tOrP, tOrV(_, _, _, stage), accO);
        turn_end();
        warpgroup_wait<0>();
        warpgroup_fence_operand(accO);
        EmptyBarrier::arrive(&s.empty_v[stage]);
      }
    }
    it += n_blocks;

    // Epilogue: the row sums over the row's four threads, O / sum in bf16, the log-sum-exp.
    // The rows go out through shared memory: stmatrix writes the warpgroup's 64 x D tile
    // (fwd_o_chunk's swizzle: no bank conflicts), and each thread stores whole 16-byte chunks,
    // a warp 512 contiguous bytes of rows. Stored from the accumulator's registers, each 4-byte
    // store touched 8 rows: 16 (32 at head dim 128) such stores a thread took the traced CTA
    // 1,100-1,700 cycles an item at W1 and 2,100-3,800 at W2 (H100, 2026-12-06).
    constexpr int kD = T::D::value, kChunks = kD / 8;  // 16-byte chunks a row
    float inv[2], lse[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[r];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      inv[r] = sum > 0.f ? 1.f / sum : 0.f;
      // MUFU.LG2 (absolute error about 2^-22 here) rather than logf's polynomial.
      lse[r] = sum > 0.f ? row_max[r] * p.scale + __logf(sum) : -INFINITY;
    }
    {
      Bf16* obuf = s.o.data() + cw * 64 * kD;
      // The previous item's chunks are read (every warp of the warpgroup is past them).
      NamedBarrier::sync(128, kOStage + cw);
      const int lane = threadIdx.x & 31;
      const int mrow = fwd_o_stmatrix_row(warp & 3, lane);  // the row this lane addresses
      CUTE_UNROLL
      for (int k = 0; k < kChunks / 2; ++k) {
        uint32_t r4[4];
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int j = fwd_o_register(k, i);
          r4[i] = sm90::pack_bf16x2(accO(j) * inv[i % 2], accO(j + 1) * inv[i % 2]);
        }
        sm90::stmatrix_x4(
            obuf + mrow * kD + fwd_o_chunk(mrow, fwd_o_stmatrix_block(k, lane >> 3)) * 8, r4);
      }
      NamedBarrier::sync(128, kOStage + cw);
      asm volatile("" ::: "memory");  // the reads below stay after the barrier
      const int t = threadIdx.x & 127;
      const int64_t ld = int64_t(p.heads) * kD;
      Bf16* o_tile = p.o + (int64_t(c.start) + q_row0 + cw * 64) * ld + c.head * kD;
      CUTE_UNROLL
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const FwdOReadback rb = fwd_o_readback(kD, t, k);
        const uint4 v = *reinterpret_cast<const uint4*>(obuf + rb.offset);
        if (q_row0 + cw * 64 + rb.row < len)
          *reinterpret_cast<uint4*>(o_tile + rb.row * ld + rb.chunk * 8) = v;
      }
    }
    bool live[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) live[r] = q_row0 + get<0>(tOcO(2 * r)) < len;
    if (p.amax) {        // a warp's max, one atomic per warp (|x| >= 0 orders as its fp32 bits)
      float amax = 0.f;  // of the stored values (FP8 known amax)
      CUTE_UNROLL
      for (int j = 0; j < size(accO); j += 2) {
        const int r = (j >> 1) & 1;
        const __nv_bfloat162 v = __floats2bfloat162_rn(accO(j) * inv[r], accO(j + 1) * inv[r]);
        if (live[r]) amax = fmaxf(amax, fmaxf(fabsf(__low2float(v)), fabsf(__high2float(v))));
      }
      CUTE_UNROLL
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
      if ((threadIdx.x & 31) == 0)
        atomicMax(reinterpret_cast<unsigned int*>(p.amax), __float_as_uint(amax));
    }
    if ((threadIdx.x & 3) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = q_row0 + get<0>(tOcO(2 * r));
        if (live[r]) p.lse[int64_t(c.head) * p.total + c.start + row] = lse[r];
      }
    }
  }
  if constexpr (kPingpong)
    if (cw == 0) NamedBarrier::sync(T::kConsumerThreads, kTurn);  // the second's last hand-over
#endif
}

template <int kD, int kBlockN, int kStages, bool kCausal, bool kOverlap, bool kPingpong>
void launch_fwd(const AttentionFwdArgs& a, Stream stream) {
  static_assert(kOverlap || !kPingpong, "ping-pong is built on the overlapped schedule");
  using T = FwdTraits<kD, kBlockN, kStages>;
  using D = typename T::D;
  const auto* q = reinterpret_cast<const Bf16*>(a.q);
  const auto* k = reinterpret_cast<const Bf16*>(a.k);
  const auto* v = reinterpret_cast<const Bf16*>(a.v);
  const int64_t total = a.total;
  Tensor mQ = make_tensor(make_gmem_ptr(q), make_shape(int(total), D{}, int(a.heads)),
                          make_stride(a.q_row_stride, _1{}, int64_t(kD)));
  const int64_t total_k = a.cu_seqlens_k != nullptr ? a.total_k : total;
  Tensor mK = make_tensor(make_gmem_ptr(k), make_shape(int(total_k), D{}, int(a.kv_heads)),
                          make_stride(a.kv_row_stride, _1{}, int64_t(kD)));
  Tensor mV = make_tensor(make_gmem_ptr(v), make_shape(D{}, int(total_k), int(a.kv_heads)),
                          make_stride(_1{}, a.v_row_stride, int64_t(kD)));
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, typename T::SmemLayoutQ{});
  auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename T::SmemLayoutK{}));
  auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(typename T::SmemLayoutV{}));
  FwdParams p;
  p.o = reinterpret_cast<Bf16*>(a.out);
  p.lse = a.lse;
  p.amax = a.out_amax;
  p.cu_seqlens = a.cu_seqlens;
  p.cu_seqlens_k = a.cu_seqlens_k != nullptr ? a.cu_seqlens_k : a.cu_seqlens;
  p.total_k = int(total_k);
  p.heads = int(a.heads);
  p.kv_heads = int(a.kv_heads);
  p.total = int(total);
  p.tiles = a.tiles;
  p.tile_count = int(a.tile_count);
  p.head_section = int(a.head_section);
  p.next_item = a.work_counter;
  p.hang = hang_record_device();
  p.scale = float(a.scale);
  p.scale_log2 = float(a.scale * M_LOG2E);
  if (a.work_counter == nullptr)
    throw std::runtime_error(
        "attention_sm90_fwd: no work counter (AttentionFwdArgs::work_counter)");
  auto* kernel = &attention_fwd_kernel<T, kCausal, kOverlap, kPingpong, decltype(tma_q),
                                       decltype(tma_k), decltype(tma_v)>;
  const int smem = int(sizeof(typename T::Smem));
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "attention_sm90_fwd", "shared memory");
  static_assert(T::kBlockM == kAttentionFwdBlockM && kBlockN == kAttentionFwdBlockN,
                "the host's work list is cut in other tiles");
  // Persistent CTAs: one per SM (the kernel keeps one resident: its registers), at most one per
  // item.
  dim3 grid(unsigned(std::min<int64_t>(a.tile_count * a.heads, detail::sm_count())));
  kernel<<<grid, T::kThreads, smem, reinterpret_cast<cudaStream_t>(stream)>>>(p, tma_q, tma_k,
                                                                              tma_v);
  check(cudaGetLastError(), "attention_sm90_fwd", "launch");
}

template <int kD, bool kCausal>
void dispatch_fwd(const AttentionFwdArgs& a, Stream stream) {
  switch (a.schedule) {
    case AttentionFwdSchedule::plain:
      return launch_fwd<kD, 128, kFwdStages, kCausal, false, false>(a, stream);
    case AttentionFwdSchedule::overlap:
      return launch_fwd<kD, 128, kFwdStages, kCausal, true, false>(a, stream);
    case AttentionFwdSchedule::pingpong:
      return launch_fwd<kD, 128, kFwdStages, kCausal, true, true>(a, stream);
  }
  throw std::runtime_error("attention_sm90_fwd: unknown schedule " +
                           std::to_string(static_cast<int>(a.schedule)));
}

}  // namespace

namespace sm90 {
namespace {
HangRecord* g_hang_host = nullptr;
HangRecord* g_hang_device = nullptr;
std::once_flag g_hang_once;
}  // namespace

HangRecord* hang_record_device() {
  std::call_once(g_hang_once, [] {
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(HangRecord), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // no record: a hang still traps, unnamed
      return;
    }
    std::memset(host, 0, sizeof(HangRecord));
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      cudaFreeHost(host);
      return;
    }
    g_hang_host = static_cast<HangRecord*>(host);
    g_hang_device = static_cast<HangRecord*>(device);
  });
  return g_hang_device;
}

HangRecord* hang_record_host() {
  return g_hang_host;
}
}  // namespace sm90

std::string attention_sm90_hang_report() {
  const volatile sm90::HangRecord* r = sm90::hang_record_host();
  if (r == nullptr || r->set == 0) return "";
  static const char* waits[] = {"bar_q",
                                "full_k",
                                "full_v",
                                "empty_k",
                                "empty_v",
                                "bar_kv",
                                "full_q",
                                "full_do",
                                "full_stat",
                                "empty",
                                "the dQ order counter",
                                "empty_q"};
  static_assert(sizeof(waits) / sizeof(waits[0]) == sm90::kWaitEmptyQ + 1,
                "a name for every HangWait");
  const int w = r->wait;
  const std::string what = w >= 0 && w < int(sizeof(waits) / sizeof(waits[0]))
                               ? std::string(waits[w])
                               : "wait " + std::to_string(w);
  return std::string(r->kernel == sm90::kHangFwd ? "attention_sm90_fwd" : "attention_sm90_bwd") +
         ": CTA " + std::to_string(r->block) + " thread " + std::to_string(r->thread) +
         " waited for " + what + "[" + std::to_string(r->index) + "] (phase " +
         std::to_string(r->phase) +
         ") through 2^26 tries (seconds) and stopped the launch: a barrier protocol bug";
}

bool attention_sm90_built() {
  return true;
}

bool attention_sm90_supported(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128;
}

void attention_sm90_fwd(const AttentionFwdArgs& a, Stream stream) {
  if (a.head_dim == 64) {
    a.causal ? dispatch_fwd<64, true>(a, stream) : dispatch_fwd<64, false>(a, stream);
  } else if (a.head_dim == 128) {
    a.causal ? dispatch_fwd<128, true>(a, stream) : dispatch_fwd<128, false>(a, stream);
  } else {
    throw std::runtime_error("attention_sm90_fwd: head_dim " + std::to_string(a.head_dim) +
                             " is not 64 or 128");
  }
}

}  // namespace colossal::kernels::cuda
