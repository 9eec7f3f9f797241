// CPU and CUDA accelerators. CUDA parts compile only against a CUDA LibTorch
// (COLOSSAL_TORCH_CUDA); on a machine without a GPU they report "not available" instead of failing.
#include "colossal/core/accelerator.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>

#include "colossal/core/error.h"

#ifdef COLOSSAL_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace colossal {

c10::Device Accelerator::device(int index) const {
  return c10::Device(device_type(),
                     static_cast<c10::DeviceIndex>(index < 0 ? current_device() : index));
}

// ---- CPU ----------------------------------------------------------------------------------------
namespace {

// Linux /proc/self/status fields in kB (VmRSS, VmHWM, VmSize, VmPeak).
int64_t proc_status_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  size_t n = std::strlen(field);
  while (std::getline(f, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') {
      std::istringstream is(line.substr(n + 1));
      int64_t kb = 0;
      is >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

class CpuEvent final : public Event {
 public:
  explicit CpuEvent(bool timing) : timing_(timing) {}
  void record() override { at_ = std::chrono::steady_clock::now(), recorded_ = true; }
  void record(const c10::Stream&) override { record(); }
  void synchronize() override {}  // CPU work is synchronous
  bool query() override { return true; }
  void block(const c10::Stream&) override {}
  double elapsed_ms(const Event& end) const override {
    auto* e = dynamic_cast<const CpuEvent*>(&end);
    COLOSSAL_CHECK(e, "elapsed_ms: both events must be CPU events");
    COLOSSAL_CHECK(timing_ && e->timing_,
                   "elapsed_ms needs events created with enable_timing = true");
    COLOSSAL_CHECK(recorded_ && e->recorded_, "elapsed_ms: both events must be recorded first");
    return std::chrono::duration<double, std::milli>(e->at_ - at_).count();
  }

 private:
  bool timing_;
  bool recorded_ = false;
  std::chrono::steady_clock::time_point at_{};
};

class CpuAccelerator final : public Accelerator {
 public:
  const char* name() const override { return "cpu"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }
  const char* communication_backend() const override { return "gloo"; }
  bool available() const override { return true; }
  int device_count() const override { return 1; }
  int current_device() const override { return 0; }
  void set_device(int index) override {
    COLOSSAL_CHECK(index == 0 || index == -1, "the CPU accelerator has only device 0, got ", index);
  }
  void synchronize(int) override {}
  void synchronize_stream(int) override {}
  c10::Stream current_stream(int) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  }
  c10::Stream new_stream(int, bool) override { return current_stream(0); }  // CPU has one stream
  void set_stream(const c10::Stream& s) override {
    COLOSSAL_CHECK(s.device_type() == c10::DeviceType::CPU, "set_stream: ", s,
                   " is not a CPU stream");
  }
  std::unique_ptr<Event> new_event(bool timing) override {
    return std::make_unique<CpuEvent>(timing);
  }

  // The CPU allocator keeps no statistics: report the process's resident memory instead.
  MemoryStats memory_stats(int) const override {
    MemoryStats m;
    m.allocated = proc_status_kb("VmRSS");
    m.peak_allocated = proc_status_kb("VmHWM");
    m.reserved = proc_status_kb("VmSize");
    m.peak_reserved = proc_status_kb("VmPeak");
    m.exact = false;
    m.note =
        "CPU: process resident set (VmRSS/VmHWM) and virtual size (VmSize/VmPeak) from /proc, not "
        "tensor bytes";
    return m;
  }
  void reset_peak_memory_stats(int) override {
    std::ofstream f("/proc/self/clear_refs");
    if (f) f << "5";  // resets VmHWM to the current RSS (Linux >= 4.0)
  }
  void empty_cache() override {}

  at::Tensor get_rng_state(int) const override {
    return at::detail::getDefaultCPUGenerator().get_state();
  }
  void set_rng_state(const at::Tensor& state, int) override {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  void manual_seed(uint64_t seed) override {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  uint64_t initial_seed(int) const override {
    return at::detail::getDefaultCPUGenerator().current_seed();
  }
};

// ---- CUDA ---------------------------------------------------------------------------------------
#ifdef COLOSSAL_TORCH_CUDA
class CudaEvent final : public Event {
 public:
  explicit CudaEvent(bool timing) : ev_(timing ? cudaEventDefault : cudaEventDisableTiming) {}
  void record() override { ev_.record(); }
  void record(const c10::Stream& s) override { ev_.record(c10::cuda::CUDAStream(s)); }
  void synchronize() override { ev_.synchronize(); }
  bool query() override { return ev_.query(); }
  void block(const c10::Stream& s) override { ev_.block(c10::cuda::CUDAStream(s)); }
  double elapsed_ms(const Event& end) const override {
    auto* e = dynamic_cast<const CudaEvent*>(&end);
    COLOSSAL_CHECK(e, "elapsed_ms: both events must be CUDA events");
    return ev_.elapsed_time(e->ev_);
  }

 private:
  at::cuda::CUDAEvent ev_;
};
#endif

class CudaAccelerator final : public Accelerator {
 public:
  const char* name() const override { return "cuda"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }
  const char* communication_backend() const override { return "nccl"; }
  bool available() const override { return device_count() > 0; }
  int device_count() const override {
#ifdef COLOSSAL_TORCH_CUDA
    return static_cast<int>(c10::cuda::device_count());
#else
    return 0;
#endif
  }
  int current_device() const override {
    need();
#ifdef COLOSSAL_TORCH_CUDA
    return c10::cuda::current_device();
#else
    return 0;
#endif
  }
  void set_device(int index) override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(idx));
#else
    (void)idx;
#endif
  }
  void synchronize(int index) override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(idx));
    c10::cuda::device_synchronize();
#else
    (void)idx;
#endif
  }
  void synchronize_stream(int index) override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(idx)).synchronize();
#else
    (void)idx;
#endif
  }
  c10::Stream current_stream(int index) const override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(idx)).unwrap();
#else
    (void)idx;
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
#endif
  }
  c10::Stream new_stream(int index, bool high_priority) override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    return c10::cuda::getStreamFromPool(high_priority, static_cast<c10::DeviceIndex>(idx)).unwrap();
#else
    (void)idx, (void)high_priority;
    return current_stream(0);
#endif
  }
  void set_stream(const c10::Stream& s) override {
    need();
    COLOSSAL_CHECK(s.device_type() == c10::DeviceType::CUDA, "set_stream: ", s,
                   " is not a CUDA stream");
#ifdef COLOSSAL_TORCH_CUDA
    c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(s));
#endif
  }
  std::unique_ptr<Event> new_event(bool timing) override {
    need();
#ifdef COLOSSAL_TORCH_CUDA
    return std::make_unique<CudaEvent>(timing);
#else
    (void)timing;
    return nullptr;
#endif
  }
  MemoryStats memory_stats(int index) const override {
    int idx = resolve(index);
    MemoryStats m;
#ifdef COLOSSAL_TORCH_CUDA
    auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(idx));
    auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    m.allocated = st.allocated_bytes[agg].current;
    m.peak_allocated = st.allocated_bytes[agg].peak;
    m.reserved = st.reserved_bytes[agg].current;
    m.peak_reserved = st.reserved_bytes[agg].peak;
#else
    (void)idx;
#endif
    m.note = "CUDA caching allocator";
    return m;
  }
  void reset_peak_memory_stats(int index) override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(idx));
#else
    (void)idx;
#endif
  }
  void empty_cache() override {
    need();
#ifdef COLOSSAL_TORCH_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }
  at::Tensor get_rng_state(int index) const override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    return at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(idx))
        .get_state();
#else
    (void)idx;
    return {};
#endif
  }
  void set_rng_state(const at::Tensor& state, int index) override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(idx));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
#else
    (void)idx, (void)state;
#endif
  }
  void manual_seed(uint64_t seed) override {
    need();
#ifdef COLOSSAL_TORCH_CUDA
    for (int i = 0; i < device_count(); ++i) {
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(i));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(seed);
    }
#else
    (void)seed;
#endif
  }
  uint64_t initial_seed(int index) const override {
    int idx = resolve(index);
#ifdef COLOSSAL_TORCH_CUDA
    return at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(idx))
        .current_seed();
#else
    (void)idx;
    return 0;
#endif
  }

 private:
  void need() const {
    COLOSSAL_CHECK(
        torch_has_cuda(),
        "CUDA is not in this LibTorch build (a CPU-only torch); use the CPU accelerator");
    COLOSSAL_CHECK(device_count() > 0,
                   "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)");
    // The caching allocator's stats (and the generators) need CUDA initialised; a memory query
    // before the first CUDA tensor must not fail with "Invalid device argument" (seen on H200).
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  }
  int resolve(int index) const {
    need();
    if (index < 0) return current_device();
    COLOSSAL_CHECK(index < device_count(), "CUDA device ", index, " does not exist (",
                   device_count(), " visible)");
    return index;
  }
};

}  // namespace

Accelerator& Accelerator::cpu() {
  static CpuAccelerator a;
  return a;
}
Accelerator& Accelerator::cuda() {
  static CudaAccelerator a;
  return a;
}
Accelerator& Accelerator::current() {
  return cuda().available() ? cuda() : cpu();
}

bool torch_has_cuda() {
#ifdef COLOSSAL_TORCH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {
std::string cuda_version_string(int v) {
  return v > 0 ? std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10) : std::string();
}
}  // namespace

std::string cuda_runtime_version() {
#ifdef COLOSSAL_TORCH_CUDA
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return "";
  return cuda_version_string(v);
#else
  return "";
#endif
}

std::string cuda_driver_version() {
#ifdef COLOSSAL_TORCH_CUDA
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return cuda_version_string(v);
#else
  return "";
#endif
}

std::vector<CudaDeviceInfo> cuda_devices() {
  std::vector<CudaDeviceInfo> out;
#ifdef COLOSSAL_TORCH_CUDA
  int n = Accelerator::cuda().device_count();
  for (int i = 0; i < n; ++i) {
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(i));
    out.push_back({i, p->name, static_cast<int64_t>(p->totalGlobalMem), p->major, p->minor,
                   p->multiProcessorCount});
  }
#endif
  return out;
}

namespace {
std::mutex& kernels_mu() {
  static std::mutex m;
  return m;
}
std::vector<std::string>& kernels() {
  static std::vector<std::string> k;
  return k;
}
}  // namespace

#ifdef COLOSSAL_TORCH_CUDA
struct CudaGraph::Impl {
  at::cuda::CUDAGraph graph;
  bool captured = false;
};
#else
struct CudaGraph::Impl {
  bool captured = false;
};
#endif

CudaGraph::CudaGraph() {
  COLOSSAL_CHECK_INPUT(Accelerator::cuda().available(),
                       "CUDA graphs need a CUDA build of LibTorch and a visible GPU");
  impl_ = std::make_unique<Impl>();
}
CudaGraph::~CudaGraph() = default;

void CudaGraph::capture(const std::function<void()>& fn) {
  COLOSSAL_CHECK(!impl_->captured, "CudaGraph::capture: this graph is already captured");
#ifdef COLOSSAL_TORCH_CUDA
  COLOSSAL_CHECK(c10::cuda::getCurrentCUDAStream() != c10::cuda::getDefaultCUDAStream(),
                 "CudaGraph::capture: set a side stream first (CUDA cannot capture the default "
                 "stream)");
  impl_->graph.capture_begin();
  try {
    fn();
  } catch (...) {
    // End the capture so the stream is usable again, then report the original error.
    try {
      impl_->graph.capture_end();
    } catch (...) {
    }
    throw;
  }
  impl_->graph.capture_end();
  impl_->captured = true;
#else
  (void)fn;
#endif
}

void CudaGraph::replay() {
  COLOSSAL_CHECK(impl_->captured, "CudaGraph::replay before capture");
#ifdef COLOSSAL_TORCH_CUDA
  impl_->graph.replay();
#endif
}

bool CudaGraph::captured() const {
  return impl_->captured;
}

at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, bool pinned) {
  return pinned ? empty_pinned(sizes, dtype) : at::empty(sizes, at::TensorOptions().dtype(dtype));
}

at::Tensor empty_pinned(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
#ifdef COLOSSAL_TORCH_CUDA
  if (Accelerator::cuda().available()) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t bytes = static_cast<size_t>(numel) * at::elementSize(dtype);
    if (bytes == 0) return at::empty(sizes, opts);
    void* ptr = nullptr;
    const cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(str("cannot allocate ", bytes,
                      " bytes of page-locked host memory: ", cudaGetErrorString(err)));
    }
    return at::from_blob(
        ptr, sizes,
        [](void* p) {
          (void)cudaDeviceSynchronize();  // an asynchronous copy may still read or write it
          (void)cudaFreeHost(p);
        },
        opts);
  }
#endif
  return at::empty(sizes, opts);
}

at::Tensor to_pinned(const at::Tensor& t) {
  at::Tensor out = empty_pinned(t.sizes(), t.scalar_type());
  out.copy_(t);
  return out;
}

at::Tensor upload_async(const at::Tensor& host, const at::Device& device) {
  if (!device.is_cuda()) return host.to(device);
  return host.pin_memory().to(at::TensorOptions().device(device).dtype(host.scalar_type()),
                              /*non_blocking=*/true);
}

bool register_cuda_kernel(const char* name) {
  std::lock_guard<std::mutex> lock(kernels_mu());
  kernels().emplace_back(name);
  return true;
}

std::vector<std::string> cuda_kernels() {
  std::lock_guard<std::mutex> lock(kernels_mu());
  auto k = kernels();
  std::sort(k.begin(), k.end());
  return k;
}

}  // namespace colossal
