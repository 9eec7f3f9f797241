// A region recorded with PyTorch's Kineto profiler (CPU operators and CUDA kernels), summarised
// kernel by kernel: `colossal bench --profile` uses it to say where a step's device time goes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "colossal/core/json.h"

namespace colossal {

struct KernelStat {
  std::string name;  // demangled kernel (or memcpy/memset) name
  std::string
      category;  // gemm | attention | colossal | elementwise | reduce | ... (kernel_category)
  int64_t count = 0;
  double total_ms = 0;
};

struct ProfileSummary {
  std::vector<KernelStat> kernels;     // by total time, largest first
  std::vector<KernelStat> categories;  // the same, summed per category
  double kernel_ms = 0;  // sum of device-activity durations (overlapping streams count twice)
  double busy_ms = 0;    // union of device-activity intervals (time the GPU was doing something)
  double span_ms = 0;    // first device activity start to last end
  std::string to_text(double step_ms, size_t top) const;
  // {"step_ms", "busy_ms", "kernel_ms", "categories_ms": {category: ms}, "top_kernels": [...]}
  json::Value to_json(double step_ms, size_t top) const;
};

// Which bucket a kernel name falls in (by substrings of cuBLAS/cuDNN/ATen/our kernel names).
std::string kernel_category(const std::string& name);

// Records from construction to stop(). One at a time per process.
class Profiler {
 public:
  explicit Profiler(bool cuda);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;
  // Stops recording; writes a Chrome trace to trace_path unless it is empty.
  ProfileSummary stop(const std::string& trace_path);

 private:
  bool running_ = false;
};

}  // namespace colossal
