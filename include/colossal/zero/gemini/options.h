// The options of Gemini's chunk manager: the chunk size search and the placement, prefetch and
// update settings. Kept apart from chunk_manager.h so the plugin's public header can derive its
// options from them without pulling in the manager.
#pragma once

#include <cstdint>
#include <string>

namespace colossal::zero::gemini {

// ColossalAI's search: candidate sizes from max(min_chunk_size, largest parameter) rounded up
// to `interval` (hidden_dim, or 1024) through that + search_range, in steps of `interval`; the
// one with the fewest wasted elements under greedy packing in parameter order wins (ties: the
// smaller size). A model smaller than min_chunk_size gets one chunk of its own size. The size
// is rounded up to a multiple of the dp size. Sizes in elements; *_m options are 2^20 elements.
struct ChunkSearchOptions {
  double search_range_m = 32;
  double min_chunk_size_m = 32;
  int64_t hidden_dim = 0;  // 0: 1024
};

// The options of the gemini plugin that the chunk manager reads (booster::GeminiPluginOptions
// derives from this struct and adds precision, device, clipping and loss scale), with the chunk
// search's fields inherited under their plugin names (min_chunk_size_m, ...).
struct GeminiOptions : ChunkSearchOptions {
  std::string placement_policy = "static";  // static | auto
  double shard_param_frac = 1.0;    // static: fraction of chunk memory sharded (last chunks)
  double offload_optim_frac = 0.0;  // static: fraction whose optimizer data is on the host (first)
  double offload_param_frac = 0.0;  // static: fraction whose parameter shard is on the host (last)
  // auto: share of the device kept for non-model data in warm-up
  double warmup_non_model_data_ratio = 0.8;
  double steady_cuda_cap_ratio = 0.9;  // auto: device budget after warm-up
  double device_capacity_mb = 0;       // auto: device memory (0: the GPU's total; CPU: the RAM)
  // auto: host memory the host-placed chunks may take (0: 85 % of the physical RAM). Chunks the
  // host cannot hold go to the device even in warm-up; a plan that fits neither is an error.
  double host_capacity_mb = 0;
  int64_t max_prefetch = 0;  // chunks gathered ahead in the recorded compute order
  // Host chunks (optimizer data and parameter shard on the host) take their CPU Adam on a
  // background thread beside the next forward instead of inside step(); the arithmetic is the
  // same. Off: step() returns with every chunk updated.
  bool overlap_cpu_adam = true;
  // Gradients are reduced in this dtype: "" (the chunk's dtype), fp32, bf16 or fp16.
  std::string communication_dtype;
  // ColossalAI's fp8_communication: the compute all-gathers of sharded chunks travel in FP8 e4m3
  // and the gradient reduce-scatter / all-reduce in FP8 e5m2, with per-rank scales
  // (dist/fp8_collectives.h). Checkpoint reads and writes (gather_all, read_param) gather
  // exactly; fp32 masters and optimizer states never see FP8.
  bool fp8_communication = false;
};

}  // namespace colossal::zero::gemini
