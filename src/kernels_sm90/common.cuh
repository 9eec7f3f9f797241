// What the sm_90a kernels share (src/kernels_sm90/*.cu): issuing one batch of wgmma over the
// k-blocks of a tile, and waits that name a hang instead of hanging.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace colossal::kernels::cuda::sm90 {

// c (= when kZeroInit, else +=) sum over k-blocks kb of a(_, _, kb) b(_, _, kb): the operands'
// fragments as CuTe's thread slices give them ((MMA, MMA_M|N, MMA_K), A from registers or
// shared memory), issued as one committed wgmma batch, not waited for (warpgroup_wait<n>).
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void gemm_batch(TiledMma& mma, const TA& a, const TB& b, TC& c) {
  using namespace cute;
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// 2^x as one MUFU.EX2 (PTX ex2.approx.ftz, relative error about 2^-22). exp2f compiles to the
// same instruction wrapped in a range check and two multiplies, there so that results below
// 2^-126 keep their denormal value: three extra FP32 instructions per softmax element, which the
// H100 run of 2026-12-05 14:19Z showed in the forward's inner loop. A probability that small is
// 0 to any sum or bf16 rounding that follows; exp2(-inf) is still 0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as one bf16 pair (lo in the low half, as in memory), one F2FP: building a
// __nv_bfloat162 from __floats2bfloat162_rn added two byte permutes a pair.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// stmatrix .x4: four 8 x 8 bf16 matrices from the mma accumulator layout (lane l holds row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i in r[i], the low column in the low half);
// lanes 8i .. 8i + 7 give the shared-memory addresses of matrix i's rows (16 bytes each).
__device__ __forceinline__ void stmatrix_x4(const void* smem, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   cute::cast_smem_ptr_to_uint(smem)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// CTA b of a launch over `tiles` work-list entries times `heads` heads, run in sections of
// `section` heads (0: one section; the last section may be smaller): within a section entry by
// entry, the section's heads adjacent. Entry and head of b.
struct TileHead {
  int tile, head;
};
__host__ __device__ __forceinline__ TileHead tile_and_head(int b, int tiles, int heads,
                                                           int section) {
  if (section <= 0 || section >= heads) return {b / heads, b % heads};
  const int per = tiles * section, sec = b / per, rest = b - sec * per;
  const int n = section < heads - sec * section ? section : heads - sec * section;
  return {rest / n, sec * section + rest % n};
}

// ---- Hangs --------------------------------------------------------------------------------
// A wait that does not end is a protocol bug (a barrier's phase, an arrival count). Instead of
// a process hung until something kills it, the waiting thread writes what it waited for into a
// record in mapped host memory (readable by the host after the failed launch has taken the
// device's memory with it) and traps; kernels::attention_hang_report() formats the record.
enum HangKernel : int { kHangFwd = 1, kHangBwd = 2 };
enum HangWait : int {
  kWaitBarQ,
  kWaitFullK,
  kWaitFullV,
  kWaitEmptyK,
  kWaitEmptyV,
  kWaitBarKV,
  kWaitFullQ,
  kWaitFullDO,
  kWaitFullStat,
  kWaitEmpty,
  kWaitDqOrder,
  kWaitEmptyQ,
};
struct HangRecord {
  int set, kernel, wait, index, block, thread;
  unsigned phase;
};
// Tries of a wait before it is called a hang. Each try suspends the thread for up to a
// hardware time limit, so this is seconds at the least; no legitimate wait in these kernels
// lasts a millisecond.
constexpr uint32_t kHangTries = 1u << 26;

// Out of line: the kernels' hot loops keep their registers; this runs once, at a hang.
static __device__ __noinline__ void report_hang(HangRecord* rec, int kernel, int wait, int index,
                                                uint32_t phase) {
  if (rec != nullptr) {
    volatile HangRecord* r = rec;
    r->kernel = kernel;
    r->wait = wait;
    r->index = index;
    r->block = int(blockIdx.x);
    r->thread = int(threadIdx.x);
    r->phase = phase;
    __threadfence_system();
    r->set = 1;
    __threadfence_system();
  }
  __trap();
}

// mbarrier wait for phase parity `phase` (ClusterBarrier::wait's), watched.
__device__ __forceinline__ void watched_wait(const uint64_t* bar, uint32_t phase, HangRecord* rec,
                                             int kernel, int wait, int index) {
  for (uint32_t tries = 0; !cutlass::arch::ClusterBarrier::try_wait(bar, phase);)
    if (++tries == kHangTries) report_hang(rec, kernel, wait, index, phase);
}

// Host: a CUDA error of a launcher as the exception the kernels' callers catch ("op: what: ...").
inline void check(cudaError_t err, const char* op, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(op) + ": " + what + ": " + cudaGetErrorString(err));
}

// The device address of the process's hang record (mapped pinned memory, allocated once; null
// when it cannot be), and the host's view of it (attention_fwd.cu).
HangRecord* hang_record_device();
HangRecord* hang_record_host();

}  // namespace colossal::kernels::cuda::sm90
