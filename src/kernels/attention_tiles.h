// The tiles of our sm_90a attention kernels (src/kernels_sm90/): the forward's CTA takes 128
// queries against 128-key tiles, the backward's 128 keys against query tiles of 64 or 128
// (bwd_block_m in attention_traits.cuh). The host's work lists (kernels/attention.cpp) are cut
// in these (the backward's weighs its key tiles' work in 64-query units, which orders them as
// 128 would); the kernels static_assert that their traits agree. Plain constants, so builds without
// CUDA compile the work lists (and their tests) too.
#pragma once

namespace colossal::kernels::cuda {

constexpr int kAttentionFwdBlockM = 128, kAttentionFwdBlockN = 128;
constexpr int kAttentionBwdBlockM = 64, kAttentionBwdBlockN = 128;

}  // namespace colossal::kernels::cuda
