// What the sm_90a kernels share (src/kernels_sm90/*.cu): issuing one batch of wgmma over the
// k-blocks of a tile.
#pragma once

#include <cute/tensor.hpp>

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

}  // namespace colossal::kernels::cuda::sm90
