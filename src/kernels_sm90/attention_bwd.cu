// Issue 25: our attention backward for sm_90a, the companion of attention_fwd.cu (same inputs:
// bf16 q [T, H, D], k / v [T, Hkv, D] or keys of their own lengths [Tk, Hkv, D], packed
// sequences, causal or full, GQA in place), with the forward's log-sum-exp. Written on CuTe after
// the FlashAttention-2/3 papers' key-stationary scheme, not on their code:
//  - preprocess: delta_i = rowsum(dO_i * O_i) per query and head (fp32 [H, T]), and the same
//    threads zero that query's row of dQ's fp32 accumulator;
//  - main kernel: one CTA per (128-key tile of a sequence, kv head), from a host-built work list
//    (tiles with work only, heaviest first, a sequence's key tiles in order) in a host-built
//    launch order (kernels::attention_backward_order), holds K and V in
//    shared memory and walks every query head of its group and every query tile (64 or 128
//    queries, bwd_block_m) that sees its keys; a producer warpgroup streams Q and dO (TMA) and
//    the tile's log-sum-exp and delta (plain loads) through a two-stage ring; two consumer
//    warpgroups (64 keys each) compute
//      S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory),
//      P^T = exp2(S^T * scale * log2 e - lse * log2 e), then dV += P^T dO issued at once
//      (wgmma with P^T from registers) while dS^T = P^T (dP^T - delta) is computed,
//      dK += dS^T Q,
//    writing dS^T into one of two shared-memory buffers (alternate steps: no barrier before
//    the store) for dQ = dS K (each warpgroup half of the queries at 128 a step with dq_tma,
//    else half of the head dim),
//    added to the fp32 accumulator with vector atomics (16 bytes each), or (dq_tma) written
//    to shared memory and added by a TMA reduce-add that the producer warpgroup's last warp
//    issues. dK and dV stay in registers for the whole walk (no atomics: the CTA owns its keys
//    for every head of the group) and are written once;
//  - deterministic mode: the CTAs of one query tile add their dQ in key-tile order (a counter
//    per (query tile, head) in global memory), so the sums are bitwise repeatable;
//  - convert: dQ = bf16(accumulator).
// The accumulator is [heads, total + 128, D] with each row's columns permuted (dq_index,
// attention_traits.cuh): a thread's four values of a chunk are one 16-byte vector, a query tile
// of one head is one contiguous range for the bulk reduce, and the consumers' stores of it into
// shared memory are free of bank conflicts. Rows of a tile past its sequence's end add exact
// zeros (P is 0 there) to the next sequence's rows or to the 128 rows of padding.
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cute/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

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

// Named barriers of the backward: the dS^T buffer's fill (2; 1 was its reuse, gone with the
// second buffer), the deterministic order (3), the dQ tile's fill (4) and reuse (5).
enum : int { kDsFull = 2, kDqOrder = 3, kDqFull = 4, kDqFree = 5 };

struct BwdParams {
  const float* lse;    // [H, T]
  const float* delta;  // [H, T]
  float* dq_accum;     // [H, T + 128, D] in dq_index order
  Bf16* dk;            // [Tk, Hkv, D]
  Bf16* dv;
  int* dq_semaphore;  // [sequences, m_blocks, H] (deterministic), else null
  const int* cu_seqlens;
  const int* cu_seqlens_k;  // the keys' offsets (cu_seqlens's values unless given their own)
  const int* tiles;         // (sequence, key tile) pairs
  const int* order;  // CTA i runs tile_and_head(order[i]) (kernels::attention_backward_order)
  HangRecord* hang;
  int heads, kv_heads, total, total_k, m_blocks_max, tile_count, head_section;
  int64_t dq_rows;  // rows of one head in dq_accum (total + kDqPadRows)
  float scale, scale_log2;
};

// Rows past the batch's end in each head's dQ slab: the largest query tile's (a last tile's
// rows past the end add exact zeros there).
constexpr int64_t kDqPadRows = std::max({bwd_block_m(64, false), bwd_block_m(64, true),
                                         bwd_block_m(128, false), bwd_block_m(128, true)});

template <class Traits, bool kCausal, bool kDeterministic, bool kDqTma, class TmaQ, class TmaDO,
          class TmaK, class TmaV>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_bwd_kernel(CUTE_GRID_CONSTANT BwdParams const p, CUTE_GRID_CONSTANT TmaQ const tma_q,
                         CUTE_GRID_CONSTANT TmaDO const tma_do, CUTE_GRID_CONSTANT TmaK const tma_k,
                         CUTE_GRID_CONSTANT TmaV const tma_v) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = Traits;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kD = T::D::value;
  // Each thread's log-sum-exp (and at head dim 64 delta) read once per query slot into
  // registers: at 64 queries a step; at 128 those registers would spill, so each element reads
  // its own from shared memory. Delta at head dim 128 spilled 12 bytes even at 64 queries.
  constexpr bool kHoistLse = kBlockM == 64, kHoistDelta = kHoistLse && kD == 64;
  extern __shared__ __align__(1024) char smem_raw[];  // 128-byte swizzles need 1024
  auto& s = *reinterpret_cast<typename T::Smem*>(smem_raw);

  const TileHead th = tile_and_head(p.order[blockIdx.x], p.tile_count, p.kv_heads, p.head_section);
  const int tile = th.tile, kv_head = th.head;
  const int seq = p.tiles[2 * tile], n_block = p.tiles[2 * tile + 1];
  // The queries' first row and count, and the keys' (the same unless given their own).
  const int start = p.cu_seqlens[seq];
  const int len = p.cu_seqlens[seq + 1] - start;
  const int k_start = p.cu_seqlens_k[seq];
  const int k_len = p.cu_seqlens_k[seq + 1] - k_start;
  if (n_block * kBlockN >= k_len) return;
  const int group = p.heads / p.kv_heads;
  const int m_begin = kCausal ? (n_block * kBlockN) / kBlockM : 0;
  const int m_end = (len + kBlockM - 1) / kBlockM;
  const int m_count = m_end - m_begin;  // >= 1: the tile's own queries
  const int steps = group * m_count;    // head-major: step i is head i / m_count

  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    FullBarrier::init(&s.bar_kv, 1);
    for (int i = 0; i < kStages; ++i) {
      FullBarrier::init(&s.full_q[i], 1);
      FullBarrier::init(&s.full_do[i], 1);
      FullBarrier::init(&s.full_stat[i], T::kStatThreads);
      EmptyBarrier::init(&s.empty[i], T::kConsumers);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(s.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(s.v.data()), typename T::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(s.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(s.dout.data()), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(s.q.data()), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(s.dout.data()), typename T::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(s.k.data()), typename T::SmemLayoutKt{});
  constexpr int kDsElems = cosize_v<typename T::SmemLayoutDS>;  // one of the two dS^T buffers

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (warp == 0) {
      if (cute::elect_one_sync()) {
        Tensor mQ = tma_q.get_tma_tensor(make_shape(p.total, typename T::D{}, p.heads));
        Tensor mdO = tma_do.get_tma_tensor(make_shape(p.total, typename T::D{}, p.heads));
        Tensor mK = tma_k.get_tma_tensor(make_shape(p.total_k, typename T::D{}, p.kv_heads));
        Tensor mV = tma_v.get_tma_tensor(make_shape(p.total_k, typename T::D{}, p.kv_heads));
        Tensor gK = local_tile(domain_offset(make_coord(k_start, _0{}), mK(_, _, kv_head)),
                               Shape<typename T::BN, typename T::D>{}, make_coord(n_block, _0{}));
        Tensor gV = local_tile(domain_offset(make_coord(k_start, _0{}), mV(_, _, kv_head)),
                               Shape<typename T::BN, typename T::D>{}, make_coord(n_block, _0{}));
        auto [tKg, tKs] = tma_partition(tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                        group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(gV));
        FullBarrier::arrive_and_expect_tx(&s.bar_kv, 2 * T::kBytesK);
        copy(tma_k.with(s.bar_kv), tKg, tKs);
        copy(tma_v.with(s.bar_kv), tVg, tVs);
        for (int i = 0; i < steps; ++i) {
          const int head = kv_head * group + i / m_count, m = m_begin + i % m_count;
          const int stage = i % kStages;
          const uint32_t phase = (i / kStages) & 1;
          Tensor gQ = local_tile(domain_offset(make_coord(start, _0{}), mQ(_, _, head)),
                                 Shape<typename T::BM, typename T::D>{}, make_coord(m, _0{}));
          Tensor gdO = local_tile(domain_offset(make_coord(start, _0{}), mdO(_, _, head)),
                                  Shape<typename T::BM, typename T::D>{}, make_coord(m, _0{}));
          auto [tQg, tQs] = tma_partition(tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                          group_modes<0, 2>(gQ));
          auto [tdOg, tdOs] = tma_partition(tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                                            group_modes<0, 2>(gdO));
          watched_wait(&s.empty[stage], phase ^ 1, p.hang, kHangBwd, kWaitEmpty, stage);
          FullBarrier::arrive_and_expect_tx(&s.full_q[stage], T::kBytesQ);
          copy(tma_q.with(s.full_q[stage]), tQg, tQs(_, stage));
          FullBarrier::arrive_and_expect_tx(&s.full_do[stage], T::kBytesQ);
          copy(tma_do.with(s.full_do[stage]), tdOg, tdOs(_, stage));
        }
      }
    } else if (warp == 1 || warp == 2) {
      // The step's log-sum-exp (times log2 e) and delta, kBlockM / kStatThreads queries per
      // thread.
      constexpr int kRows = kBlockM / T::kStatThreads;
      const int t = threadIdx.x - 32;
      for (int i = 0; i < steps; ++i) {
        const int head = kv_head * group + i / m_count, m = m_begin + i % m_count;
        const int stage = i % kStages;
        const uint32_t phase = (i / kStages) & 1;
        float l[kRows], d[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = m * kBlockM + t + r * T::kStatThreads;
          l[r] = INFINITY;
          d[r] = 0.f;
          if (row < len) {
            l[r] = p.lse[int64_t(head) * p.total + start + row] * float(M_LOG2E);
            d[r] = p.delta[int64_t(head) * p.total + start + row];
          }
        }
        watched_wait(&s.empty[stage], phase ^ 1, p.hang, kHangBwd, kWaitEmpty, stage);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          s.lse2[stage][t + r * T::kStatThreads] = l[r];
          s.delta[stage][t + r * T::kStatThreads] = d[r];
        }
        FullBarrier::arrive(&s.full_stat[stage]);
      }
    } else if (kDqTma) {
      // Warp 3: each step's dQ tile, once the consumers have written it, added to the
      // accumulator by one bulk reduce-add; the buffer is handed back when TMA has read it.
      const bool leader = cute::elect_one_sync();
      float* head_tile =
          p.dq_accum + (int64_t(kv_head) * group * p.dq_rows + start + m_begin * kBlockM) * kD;
      int i = 0;
      for (int h = 0; h < group; ++h, head_tile += p.dq_rows * kD) {
        float* tile = head_tile;
        for (int mm = 0; mm < m_count; ++mm, ++i, tile += kBlockM * kD) {
          NamedBarrier::sync(T::kConsumers + 32, kDqFull);
          if (leader) {
            asm volatile(
                "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::
                    "l"(tile),
                "r"(cute::cast_smem_ptr_to_uint(s.dq)), "r"(int(sizeof(s.dq)))
                : "memory");
            cute::tma_store_arrive();
            cute::tma_store_wait<0>();  // the buffer is read
          }
          __syncwarp();
          if (i + 1 < steps) NamedBarrier::arrive(T::kConsumers + 32, kDqFree);
        }
      }
      if (leader) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // and written
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ct = threadIdx.x - 128;
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmaKV mma_kv;
  typename T::TiledMmaQ mma_q;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_kv = mma_kv.get_thread_slice(ct);
  auto thr_q = mma_q.get_thread_slice(ct);
  Tensor tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK));    // (MMA, 1, D/16)
  Tensor tSrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV));    // (MMA, 1, D/16)
  Tensor tSrQ = thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ));    // (MMA, 1, D/16, S)
  Tensor tSrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO));  // (MMA, 1, D/16, S)
  Tensor tKVrdO = thr_kv.make_fragment_B(thr_kv.partition_B(sdOt));  // (MMA, 1, BM/16, S)
  Tensor tKVrQ = thr_kv.make_fragment_B(thr_kv.partition_B(sQt));    // (MMA, 1, BM/16, S)
  Tensor tQrK = thr_q.make_fragment_B(thr_q.partition_B(sKt));       // (MMA, 1, BN/16)
  Tensor accdV = partition_fragment_C(mma_kv, Shape<typename T::BN, typename T::D>{});
  Tensor accdK = partition_fragment_C(mma_kv, Shape<typename T::BN, typename T::D>{});
  Tensor cS = make_identity_tensor(Shape<typename T::BN, typename T::BM>{});
  Tensor tScS = thr_sdp.partition_C(cS);  // (key, query) of each S^T register
  Tensor cKV = make_identity_tensor(Shape<typename T::BN, typename T::D>{});
  Tensor tKVc = thr_kv.partition_C(cKV);
  Tensor cQ = make_identity_tensor(Shape<typename T::BM, typename T::D>{});
  Tensor tQc = thr_q.partition_C(cQ);
  using FragA = decltype(thr_kv.partition_fragment_A(
      make_tensor(make_smem_ptr((Bf16*)nullptr),
                  make_layout(Shape<typename T::BN, typename T::BM>{}, LayoutRight{}))));
  static_assert(std::is_same_v<typename FragA::layout_type, typename T::LayoutP>,
                "the S^T accumulator does not read as the dV / dK wgmma's A fragment");
  clear(accdV);
  clear(accdK);
  const int k_row0 = n_block * kBlockN;

  watched_wait(&s.bar_kv, 0, p.hang, kHangBwd, kWaitBarKV, 0);
  for (int i = 0; i < steps; ++i) {
    const int head = kv_head * group + i / m_count, m = m_begin + i % m_count;
    const int stage = i % kStages;
    const uint32_t phase = (i / kStages) & 1;
    const int q_row0 = m * kBlockM;
    Tensor accS = partition_fragment_C(mma_sdp, Shape<typename T::BN, typename T::BM>{});
    Tensor accdP = partition_fragment_C(mma_sdp, Shape<typename T::BN, typename T::BM>{});
    watched_wait(&s.full_q[stage], phase, p.hang, kHangBwd, kWaitFullQ, stage);
    sm90::gemm_batch<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), accS);
    watched_wait(&s.full_do[stage], phase, p.hang, kHangBwd, kWaitFullDO, stage);
    sm90::gemm_batch<true>(mma_sdp, tSrV, tSrdO(_, _, _, stage), accdP);
    watched_wait(&s.full_stat[stage], phase, p.hang, kHangBwd, kWaitFullStat, stage);
    // The log-sum-exp of this thread's queries, one per column slot (bwd_query_slot), read
    // while S^T computes (read after the wait, ncu showed the loads' latency in the
    // exponentials' first instructions).
    constexpr int kCols = decltype(size(accS))::value / 2;
    float lse_col[kCols];
    if constexpr (kHoistLse) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c)
        lse_col[c] = s.lse2[stage][get<1>(tScS(bwd_slot_register(c)))];
    }
    warpgroup_wait<1>();  // S^T done (dP^T may still run)
    warpgroup_fence_operand(accS);

    // P^T, masked: keys or queries past the sequence's end, (causal) keys after the query.
    const bool need_mask = k_row0 + kBlockN > k_len || q_row0 + kBlockM > len ||
                           (kCausal && k_row0 + kBlockN - 1 > q_row0);
    CUTE_UNROLL
    for (int j = 0; j < size(accS); ++j) {
      const int kr = get<0>(tScS(j)), qc = get<1>(tScS(j));
      const float l = kHoistLse ? lse_col[bwd_query_slot(j)] : s.lse2[stage][get<1>(tScS(j))];
      float e = sm90::exp2_approx(accS(j) * p.scale_log2 - l);
      if (need_mask) {
        const int key = k_row0 + kr, query = q_row0 + qc;
        if (key >= k_len || query >= len || (kCausal && key > query)) e = 0.f;
      }
      accS(j) = e;
    }
    // dV += P^T dO goes to the tensor cores at once (it needs P only), so they have work while
    // dS^T is computed and stored.
    Tensor rP = make_tensor<Bf16>(accS.layout());
    CUTE_UNROLL
    for (int j = 0; j < size(accS); ++j) rP(j) = Bf16(accS(j));
    Tensor tP = make_tensor(rP.data(), typename T::LayoutP{});
    warpgroup_fence_operand(tP);
    sm90::gemm_batch<false>(mma_kv, tP, tKVrdO(_, _, _, stage), accdV);
    // delta of this thread's queries, read before the wait as well where the registers allow.
    float delta_col[kCols];
    if constexpr (kHoistDelta) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c)
        delta_col[c] = s.delta[stage][get<1>(tScS(bwd_slot_register(c)))];
    }
    warpgroup_wait<1>();  // dP^T done (dV may still run)
    warpgroup_fence_operand(accdP);
    // dS^T = P^T (dP^T - delta), kept in accdP.
    CUTE_UNROLL
    for (int j = 0; j < size(accdP); ++j) {
      const float d = kHoistDelta ? delta_col[bwd_query_slot(j)] : s.delta[stage][get<1>(tScS(j))];
      accdP(j) = accS(j) * (accdP(j) - d);
    }
    Tensor rdS = make_tensor<Bf16>(accdP.layout());
    CUTE_UNROLL
    for (int j = 0; j < size(accdP); ++j) rdS(j) = Bf16(accdP(j));
    // dS^T into this step's buffer (of two). No wait for the other warpgroup: its last reader,
    // the dQ GEMM two steps back, finished before that warpgroup reached the previous step's
    // kDsFull barrier, which this one passed.
    Bf16* ds_buf = s.ds.data() + (i & 1) * kDsElems;
    {
      // stmatrix through the accumulator's own partition (element-wise swizzled stores
      // would cost a register per address and spill).
      Tensor sdS = make_tensor(make_smem_ptr(ds_buf), typename T::SmemLayoutDS{});
      auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Bf16>{}, mma_sdp);
      auto thr_r2s = r2s.get_thread_slice(ct);
      cute::copy(r2s, thr_r2s.retile_S(rdS), thr_r2s.partition_D(sdS));
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by wgmma

    Tensor tdS = make_tensor(rdS.data(), typename T::LayoutP{});
    warpgroup_fence_operand(tdS);

    // dQ first, then dK: dQ's result is stored below while dK still computes.
    NamedBarrier::sync(T::kConsumers, kDsFull);  // all of dS^T written
    Tensor accdQ = partition_fragment_C(mma_q, Shape<typename T::BM, typename T::D>{});
    Tensor sdSt = make_tensor(make_smem_ptr(ds_buf), typename T::SmemLayoutDSt{});
    Tensor tQrdS = thr_q.make_fragment_A(thr_q.partition_A(sdSt));  // (MMA, 1, BN/16)
    sm90::gemm_batch<true>(mma_q, tQrdS, tQrK, accdQ);
    sm90::gemm_batch<false>(mma_kv, tdS, tKVrQ(_, _, _, stage), accdK);
    warpgroup_wait<1>();  // dV and dQ done (dK may still run)
    warpgroup_fence_operand(tP);
    warpgroup_fence_operand(accdV);
    warpgroup_fence_operand(accdQ);

    if constexpr (kDqTma) {
      // The tile into shared memory (after the previous tile's reduce-add has read it), then
      // handed to the dQ warp. Rows past the sequence's end hold exact zeros.
      // A thread's rows are equal modulo 8 (the accumulator's rows are i, i + 8, ...), so one
      // swizzle serves all of them (test_attention_layouts checks it).
      const int64_t swz_row = start + get<0>(tQc(0));
      if (i > 0) NamedBarrier::sync(T::kConsumers + 32, kDqFree);
      CUTE_UNROLL
      for (int j = 0; j < size(accdQ); j += 2) {
        const int r = get<0>(tQc(j)), c = get<1>(tQc(j));
        *reinterpret_cast<float2*>(s.dq + r * kD + dq_column(c, swz_row)) =
            make_float2(accdQ(j) * p.scale, accdQ(j + 1) * p.scale);
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by TMA
      NamedBarrier::arrive(T::kConsumers + 32, kDqFull);
    } else {
      float* dq = p.dq_accum + int64_t(head) * p.dq_rows * kD;
      int* sem = nullptr;
      if constexpr (kDeterministic) {
        // Key tiles add in order: tile n waits for the n tiles before it (0 .. n-1 all see
        // this query tile: causal starts at key tile 0). The work list puts those n tiles
        // earlier, and CTAs start in list order, so they are resident or done.
        sem = p.dq_semaphore + (int64_t(seq) * p.m_blocks_max + m) * p.heads + head;
        if (ct == 0) {
          for (uint32_t tries = 0; atomicAdd(sem, 0) != n_block;) {
            __nanosleep(64);
            if (++tries == kHangTries) report_hang(p.hang, kHangBwd, kWaitDqOrder, m, 0);
          }
          __threadfence();
        }
        NamedBarrier::sync(T::kConsumers, kDqOrder);
      }
      // One vector atomic a chunk (16 bytes; red.global.add.v4.f32): a warp's adds fill whole
      // 32-byte sectors. The address is t * kD + (dq_column & ~3), equal to dq_index & ~3: that
      // form made ptxas spill 4-16 bytes more in this schedule at head dim 64.
      CUTE_UNROLL
      for (int k = 0; k < size(accdQ) / 4; ++k) {
        const int r = get<0>(tQc(dq_chunk_register(k, 0))),
                  c = get<1>(tQc(dq_chunk_register(k, 0)));
        const int64_t t = start + q_row0 + r;
        float4 v;
        v.x = accdQ(dq_chunk_register(k, 0)) * p.scale;
        v.y = accdQ(dq_chunk_register(k, 1)) * p.scale;
        v.z = accdQ(dq_chunk_register(k, 2)) * p.scale;
        v.w = accdQ(dq_chunk_register(k, 3)) * p.scale;
        if (q_row0 + r < len)
          atomicAdd(reinterpret_cast<float4*>(dq + t * kD + (dq_column(c, t) & ~3)),
                    dq_chunk_vector(v, t));
      }
      if constexpr (kDeterministic) {
        __threadfence();
        NamedBarrier::sync(T::kConsumers, kDqOrder);
        if (ct == 0) atomicExch(sem, n_block + 1);
      }
    }
    warpgroup_wait<0>();  // dK done
    // dS^T's registers stay live until the dK GEMM has read them.
    warpgroup_fence_operand(tdS);
    warpgroup_fence_operand(accdK);
    EmptyBarrier::arrive(&s.empty[stage]);  // Q, dO and the statistics of this stage are read
  }

  // dV and scale * dK, written once (the CTA owns these keys for every head of the group).
  const int64_t ld = int64_t(p.kv_heads) * kD;
  CUTE_UNROLL
  for (int j = 0; j < size(accdV); j += 2) {
    const int r = get<0>(tKVc(j)), c = get<1>(tKVc(j));
    if (k_row0 + r < k_len) {
      const int64_t off = (int64_t(k_start) + k_row0 + r) * ld + int64_t(kv_head) * kD + c;
      *reinterpret_cast<__nv_bfloat162*>(p.dv + off) =
          __floats2bfloat162_rn(accdV(j), accdV(j + 1));
      *reinterpret_cast<__nv_bfloat162*>(p.dk + off) =
          __floats2bfloat162_rn(accdK(j) * p.scale, accdK(j + 1) * p.scale);
    }
  }
#endif
}

// delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (fp32), kD / 8 threads per (t, h), each with one
// 16-byte load of each; they also zero row t of head h in the dQ accumulator (one pass instead
// of a memset of its own; the padding rows past the batch only ever receive exact zeros and are
// never read, so they stay as they are).
template <int kD>
__global__ void attention_bwd_delta_kernel(const __nv_bfloat16* __restrict__ out,
                                           const __nv_bfloat16* __restrict__ dout,
                                           float* __restrict__ delta, float* __restrict__ dq_accum,
                                           int64_t total, int heads, int64_t dq_rows,
                                           int64_t out_row_stride, int64_t dout_row_stride) {
  constexpr int kLanes = kD / 8;  // threads per row: 8 or 16, within one warp
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = i / kLanes;  // t * heads + h
  const int part = int(i % kLanes);
  const bool live = row < total * heads;  // the rest still take part in the shuffles
  const int64_t t = live ? row / heads : 0;
  const int h = live ? int(row % heads) : 0;
  float acc = 0.f;
  if (live) {
    float4* z = reinterpret_cast<float4*>(dq_accum + (int64_t(h) * dq_rows + t) * kD) + 2 * part;
    z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    const uint4 a = *reinterpret_cast<const uint4*>(out + t * out_row_stride + h * kD + 8 * part);
    const uint4 b = *reinterpret_cast<const uint4*>(dout + t * dout_row_stride + h * kD + 8 * part);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {
      const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&av[k]));
      const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bv[k]));
      acc += x.x * y.x + x.y * y.y;
    }
  }
  for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
  if (live && part == 0) delta[int64_t(h) * total + t] = acc;
}

// dq[t, h, :] = bf16(the accumulator's row t of head h), one 16-byte chunk (columns c, c + 1,
// c + 8, c + 9, or c + 8, c + 9, c, c + 1: dq_chunk_column, dq_chunk_swap) per thread.
template <int kD>
__global__ void attention_bwd_convert_kernel(const float* __restrict__ acc,
                                             __nv_bfloat16* __restrict__ dq, int64_t total,
                                             int heads, int64_t dq_rows) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk of dq
  if (i >= total * heads * (kD / 4)) return;
  const int k = int(i % (kD / 4));
  const int64_t row = i / (kD / 4);
  const int64_t t = row / heads;
  const int h = int(row % heads);
  const float4 v = dq_chunk_vector(
      *reinterpret_cast<const float4*>(acc + (int64_t(h) * dq_rows + t) * kD + 4 * k), t);
  __nv_bfloat16* out = dq + row * kD + dq_chunk_column(k, t);
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(v.x, v.y);
  *reinterpret_cast<__nv_bfloat162*>(out + 8) = __floats2bfloat162_rn(v.z, v.w);
}

void check(cudaError_t err, const char* what) {
  sm90::check(err, "attention_sm90_bwd", what);
}

template <int kD, bool kCausal, bool kDeterministic, bool kDqTma>
void launch_bwd(const AttentionBwdArgs& a, Stream stream) {
  static_assert(!(kDeterministic && kDqTma), "the deterministic order runs on atomics");
  using T = BwdTraits<kD, bwd_block_m(kD, kDeterministic), kDqTma>;
  using D = typename T::D;
  auto st = reinterpret_cast<cudaStream_t>(stream);
  const int total = int(a.total);
  // 1. delta = rowsum(dO * O) and the dQ accumulator's rows zeroed in one pass (with a memset
  //    of its own, W1's forward+backward was 1.5 % slower and W2 B1's 1.1 %; H100,
  //    docs/benchmarks.md 2026-12-06 16:5xZ); deterministic mode's order counters zeroed.
  {
    const int64_t lanes = a.total * a.heads * (kD / 8);
    const int threads = 256;
    const int64_t blocks = (lanes + threads - 1) / threads;
    if (blocks > 0)
      attention_bwd_delta_kernel<kD><<<unsigned(blocks), threads, 0, st>>>(
          reinterpret_cast<const __nv_bfloat16*>(a.out),
          reinterpret_cast<const __nv_bfloat16*>(a.dout), a.delta, a.dq_accum, a.total,
          int(a.heads), a.total + kDqPadRows, a.heads * kD, a.dout_row_stride);
    check(cudaGetLastError(), "delta");
    if (kDeterministic)
      check(cudaMemsetAsync(a.dq_semaphore, 0, sizeof(int) * a.semaphore_count, st), "memset");
  }
  // 2. dK, dV and the dQ accumulator.
  const auto* q = reinterpret_cast<const Bf16*>(a.q);
  const auto* k = reinterpret_cast<const Bf16*>(a.k);
  const auto* v = reinterpret_cast<const Bf16*>(a.v);
  const auto* dout = reinterpret_cast<const Bf16*>(a.dout);
  Tensor mQ = make_tensor(make_gmem_ptr(q), make_shape(total, D{}, int(a.heads)),
                          make_stride(a.q_row_stride, _1{}, int64_t(kD)));
  Tensor mdO = make_tensor(make_gmem_ptr(dout), make_shape(total, D{}, int(a.heads)),
                           make_stride(a.dout_row_stride, _1{}, int64_t(kD)));
  const int total_k = a.cu_seqlens_k != nullptr ? int(a.total_k) : total;
  Tensor mK = make_tensor(make_gmem_ptr(k), make_shape(total_k, D{}, int(a.kv_heads)),
                          make_stride(a.kv_row_stride, _1{}, int64_t(kD)));
  Tensor mV = make_tensor(make_gmem_ptr(v), make_shape(total_k, D{}, int(a.kv_heads)),
                          make_stride(a.v_row_stride, _1{}, int64_t(kD)));
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(typename T::SmemLayoutQ{}));
  auto tma_do = make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(typename T::SmemLayoutQ{}));
  auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutK{});
  auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutK{});
  BwdParams p;
  p.lse = a.lse;
  p.delta = a.delta;
  p.dq_accum = a.dq_accum;
  p.dk = reinterpret_cast<Bf16*>(a.dk);
  p.dv = reinterpret_cast<Bf16*>(a.dv);
  p.dq_semaphore = kDeterministic ? a.dq_semaphore : nullptr;
  p.cu_seqlens = a.cu_seqlens;
  p.cu_seqlens_k = a.cu_seqlens_k != nullptr ? a.cu_seqlens_k : a.cu_seqlens;
  p.heads = int(a.heads);
  p.kv_heads = int(a.kv_heads);
  p.total = total;
  p.total_k = total_k;
  p.m_blocks_max = int((a.max_seqlen + T::kBlockM - 1) / T::kBlockM);
  p.tiles = a.bwd_tiles;
  p.order = a.bwd_order;
  p.tile_count = int(a.bwd_tile_count);
  p.head_section = int(a.kv_head_section);
  p.hang = hang_record_device();
  p.dq_rows = a.total + kDqPadRows;
  p.scale = float(a.scale);
  p.scale_log2 = float(a.scale * M_LOG2E);
  auto* kernel = &attention_bwd_kernel<T, kCausal, kDeterministic, kDqTma, decltype(tma_q),
                                       decltype(tma_do), decltype(tma_k), decltype(tma_v)>;
  const int smem = int(sizeof(typename T::Smem));
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "shared memory");
  static_assert(T::kBlockM % kAttentionBwdBlockM == 0 && T::kBlockN == kAttentionBwdBlockN,
                "the host's work list is cut in other tiles");
  dim3 grid(unsigned(a.bwd_tile_count * a.kv_heads));
  kernel<<<grid, T::kThreads, smem, st>>>(p, tma_q, tma_do, tma_k, tma_v);
  check(cudaGetLastError(), "main kernel");
  // 3. dQ in bf16.
  const int64_t chunks = a.total * a.heads * (kD / 4);
  if (chunks > 0)
    attention_bwd_convert_kernel<kD><<<unsigned((chunks + 255) / 256), 256, 0, st>>>(
        a.dq_accum, reinterpret_cast<__nv_bfloat16*>(a.dq), a.total, int(a.heads), p.dq_rows);
  check(cudaGetLastError(), "convert");
}

template <int kD>
void dispatch_bwd(const AttentionBwdArgs& a, Stream stream) {
  if (a.deterministic && a.dq_tma)
    throw std::runtime_error("attention_sm90_bwd: dq_tma does not keep the deterministic order");
  if (a.bwd_tile_count > 0 && a.bwd_order == nullptr)
    throw std::runtime_error("attention_sm90_bwd: no launch order (bwd_order)");
  if (a.causal)
    a.deterministic ? launch_bwd<kD, true, true, false>(a, stream)
    : a.dq_tma      ? launch_bwd<kD, true, false, true>(a, stream)
                    : launch_bwd<kD, true, false, false>(a, stream);
  else
    a.deterministic ? launch_bwd<kD, false, true, false>(a, stream)
    : a.dq_tma      ? launch_bwd<kD, false, false, true>(a, stream)
                    : launch_bwd<kD, false, false, false>(a, stream);
}

}  // namespace

int64_t attention_sm90_bwd_semaphores(int64_t sequences, int64_t max_seqlen, int64_t heads) {
  // Deterministic mode's query tiles, the same at both head dims.
  constexpr int64_t bm = bwd_block_m(64, true);
  static_assert(bwd_block_m(128, true) == bm);
  return sequences * ((max_seqlen + bm - 1) / bm) * heads;
}

int64_t attention_sm90_dq_accum_elements(int64_t total, int64_t heads, int64_t head_dim) {
  return heads * (total + kDqPadRows) * head_dim;
}

void attention_sm90_bwd(const AttentionBwdArgs& a, Stream stream) {
  if (a.head_dim == 64)
    dispatch_bwd<64>(a, stream);
  else if (a.head_dim == 128)
    dispatch_bwd<128>(a, stream);
  else
    throw std::runtime_error("attention_sm90_bwd: head_dim " + std::to_string(a.head_dim) +
                             " is not 64 or 128");
}

}  // namespace colossal::kernels::cuda
