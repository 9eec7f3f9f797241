// Kineto through LibTorch's C++ profiler API (torch/csrc/autograd/profiler_kineto.h).
#include "colossal/core/profiler.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>

#include "colossal/core/error.h"

namespace colossal {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

namespace {
// libkineto::ActivityType values of device-side activities (libkineto/include/ActivityType.h).
constexpr uint8_t kGpuMemcpy = 3, kGpuMemset = 4, kConcurrentKernel = 5;

bool contains(const std::string& s, const char* sub) {
  return s.find(sub) != std::string::npos;
}
}  // namespace

std::string kernel_category(const std::string& n) {
  if (contains(n, "Memcpy") || contains(n, "memcpy")) return "memcpy";
  if (contains(n, "Memset") || contains(n, "memset")) return "memset";
  if (contains(n, "nccl")) return "nccl";
  if (contains(n, "colossal")) return "colossal (fused)";
  if (contains(n, "flash") || contains(n, "fmha") || contains(n, "cudnn") ||
      contains(n, "attention") || contains(n, "sdpa"))
    return "attention";
  if (contains(n, "gemm") || contains(n, "nvjet") || contains(n, "cutlass") ||
      contains(n, "xmma") || contains(n, "sm90_") || contains(n, "cublas"))
    return "gemm";
  if (contains(n, "softmax") || contains(n, "nll_loss") || contains(n, "cross_entropy"))
    return "softmax/loss";
  if (contains(n, "multi_tensor") || contains(n, "foreach") || contains(n, "fused_adam"))
    return "optimizer (ATen)";
  if (contains(n, "reduce") || contains(n, "Reduce") || contains(n, "norm")) return "reduce";
  if (contains(n, "cat") || contains(n, "Cat")) return "cat/copy";
  if (contains(n, "elementwise") || contains(n, "vectorized") || contains(n, "unrolled"))
    return "elementwise";
  return "other";
}

Profiler::Profiler(bool cuda) {
  COLOSSAL_CHECK(!prof::isProfilerEnabledInMainThread(), "a profiler is already recording");
  // Kineto logs an ERROR line when it finds no GPU; keep its own logging to fatal unless the
  // user asked for more.
  ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  running_ = true;
}

Profiler::~Profiler() {
  if (running_) {
    try {
      prof::disableProfiler();
    } catch (...) {  // a destructor must not throw; the result is discarded anyway
    }
  }
}

ProfileSummary Profiler::stop(const std::string& trace_path) {
  COLOSSAL_CHECK(running_, "Profiler::stop called twice");
  running_ = false;
  std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  ProfileSummary s;
  std::map<std::string, KernelStat> by_name;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const prof::KinetoEvent& e : result->events()) {
    const uint8_t t = e.activityType();
    if (t != kGpuMemcpy && t != kGpuMemset && t != kConcurrentKernel) continue;
    KernelStat& k = by_name[e.name()];
    k.name = e.name();
    k.count += 1;
    const double ms = static_cast<double>(e.durationNs()) / 1e6;
    k.total_ms += ms;
    s.kernel_ms += ms;
    spans.emplace_back(e.startNs(), e.endNs());
  }
  std::sort(spans.begin(), spans.end());
  uint64_t busy = 0, cur_start = 0, cur_end = 0;
  bool open = false;
  for (auto [a, b] : spans) {
    if (!open || a > cur_end) {
      if (open) busy += cur_end - cur_start;
      cur_start = a;
      cur_end = b;
      open = true;
    } else {
      cur_end = std::max(cur_end, b);
    }
  }
  if (open) busy += cur_end - cur_start;
  s.busy_ms = static_cast<double>(busy) / 1e6;
  if (!spans.empty()) {
    uint64_t last = 0;
    for (auto [a, b] : spans) last = std::max(last, b);
    s.span_ms = static_cast<double>(last - spans.front().first) / 1e6;
  }
  std::map<std::string, KernelStat> by_cat;
  for (auto& [name, k] : by_name) {
    k.category = kernel_category(name);
    KernelStat& c = by_cat[k.category];
    c.name = c.category = k.category;
    c.count += k.count;
    c.total_ms += k.total_ms;
    s.kernels.push_back(k);
  }
  for (auto& [name, c] : by_cat) s.categories.push_back(c);
  auto larger = [](const KernelStat& a, const KernelStat& b) { return a.total_ms > b.total_ms; };
  std::sort(s.kernels.begin(), s.kernels.end(), larger);
  std::sort(s.categories.begin(), s.categories.end(), larger);
  if (!trace_path.empty()) result->save(trace_path);
  return s;
}

json::Value ProfileSummary::to_json(double step_ms, size_t top) const {
  json::Value j = json::Value::object();
  j.set("step_ms", step_ms);
  j.set("busy_ms", busy_ms);
  j.set("kernel_ms", kernel_ms);
  json::Value cats = json::Value::object();
  for (const KernelStat& c : categories) cats.set(c.category, c.total_ms);
  j.set("categories_ms", cats);
  json::Value list = json::Value::array();
  for (size_t i = 0; i < kernels.size() && i < top; ++i) {
    json::Value k = json::Value::object();
    k.set("name", kernels[i].name);
    k.set("category", kernels[i].category);
    k.set("count", kernels[i].count);
    k.set("total_ms", kernels[i].total_ms);
    list.push_back(k);
  }
  j.set("top_kernels", list);
  return j;
}

std::string ProfileSummary::to_text(double step_ms, size_t top) const {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line,
                "profile of one step: %.2f ms wall, device busy %.2f ms (%.1f %%), kernel time "
                "%.2f ms, first-to-last device activity %.2f ms\n",
                step_ms, busy_ms, step_ms > 0 ? 100.0 * busy_ms / step_ms : 0.0, kernel_ms,
                span_ms);
  out += line;
  if (kernels.empty()) {
    out +=
        "  no device activity recorded (a CPU run): the Chrome trace has the operator timeline\n";
    return out;
  }
  out += "  by category:\n";
  for (const KernelStat& c : categories) {
    std::snprintf(line, sizeof line, "    %-20s %8.2f ms %5.1f %% %7lld launches\n",
                  c.category.c_str(), c.total_ms,
                  kernel_ms > 0 ? 100.0 * c.total_ms / kernel_ms : 0.0,
                  static_cast<long long>(c.count));
    out += line;
  }
  std::snprintf(line, sizeof line, "  top %zu kernels:\n", std::min(top, kernels.size()));
  out += line;
  for (size_t i = 0; i < kernels.size() && i < top; ++i) {
    const KernelStat& k = kernels[i];
    std::string name = k.name;
    if (name.size() > 150) {
      name.resize(147);
      name.append("...");
    }
    std::snprintf(line, sizeof line, "    %8.2f ms %5.1f %% %6lld x %8.3f ms  [%s] %s\n",
                  k.total_ms, kernel_ms > 0 ? 100.0 * k.total_ms / kernel_ms : 0.0,
                  static_cast<long long>(k.count), k.total_ms / static_cast<double>(k.count),
                  k.category.c_str(), name.c_str());
    out += line;
  }
  return out;
}

}  // namespace colossal
