// cuDNN frontend SDPA graphs at our shapes (bench/cudnn_sdpa.cpp; bench_kernels --op sdpa_fe).
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace colossal::bench {

struct FeRow {
  std::string name, shape, dir;
  double ms = -1;    // median; -1: not run (note says why)
  double flops = 0;  // useful FLOPs (causal: half; documents: within each)
  std::string note;
};
using Timer = std::function<double(const std::function<void()>&)>;

// Forward and forward+backward (also with the deterministic backward) of W1 (seq 2048, 32/4
// heads, dim 64, batch 8) and W2 (seq 4096, 32/32 heads, dim 128, batch 1), dense causal and as
// packed documents, timed by `time_ms`.
std::vector<FeRow> cudnn_frontend_sdpa(const Timer& time_ms);

}  // namespace colossal::bench
