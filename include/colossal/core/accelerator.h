// Accelerator: one interface over the CPU and CUDA devices (current device, streams, events,
// synchronisation, memory statistics, RNG state), so the layers above never branch on the
// device type. Accelerator::current() is CUDA when a GPU is visible, else CPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colossal {

// Bytes. `exact` is false where the numbers are an approximation; `note` then says what they are.
struct MemoryStats {
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  bool exact = true;
  std::string note;
};

// A marker in a stream: elapsed time between two events, or waiting for work to finish.
class Event {
 public:
  virtual ~Event() = default;
  virtual void record() = 0;  // on the current stream
  virtual void record(const c10::Stream& stream) = 0;
  virtual void synchronize() = 0;  // host waits until the recorded work is done
  virtual bool query() = 0;        // done?
  virtual void block(
      const c10::Stream& stream) = 0;  // `stream` waits for this event (host does not)
  // Milliseconds from this event to `end` (both recorded, created with timing enabled).
  virtual double elapsed_ms(const Event& end) const = 0;
};

class Accelerator {
 public:
  virtual ~Accelerator() = default;
  static Accelerator& cpu();
  static Accelerator& cuda();
  // CUDA when this LibTorch has CUDA and a device is visible, else CPU.
  static Accelerator& current();

  virtual const char* name() const = 0;  // "cpu", "cuda"
  virtual c10::DeviceType device_type() const = 0;
  virtual const char* communication_backend() const = 0;  // "gloo", "nccl"
  virtual bool available() const = 0;
  virtual int device_count() const = 0;
  virtual int current_device() const = 0;
  virtual void set_device(int index) = 0;
  c10::Device device(int index = -1) const;  // -1: the current device

  virtual void synchronize(int index = -1) = 0;
  // The host waits for the current stream only (work on side streams may go on: a step's
  // update under overlap_step, which the next forward waits for on the device).
  virtual void synchronize_stream(int index = -1) = 0;
  virtual c10::Stream current_stream(int index = -1) const = 0;
  virtual c10::Stream new_stream(int index = -1, bool high_priority = false) = 0;
  virtual void set_stream(const c10::Stream& stream) = 0;
  virtual std::unique_ptr<Event> new_event(bool enable_timing = false) = 0;

  virtual MemoryStats memory_stats(int index = -1) const = 0;
  virtual void reset_peak_memory_stats(int index = -1) = 0;
  virtual void empty_cache() = 0;

  virtual at::Tensor get_rng_state(int index = -1) const = 0;
  virtual void set_rng_state(const at::Tensor& state, int index = -1) = 0;
  virtual void manual_seed(uint64_t seed) = 0;  // every device of this kind
  virtual uint64_t initial_seed(int index = -1) const = 0;
};

// A CUDA graph: the kernels `fn` launches are captured once and replayed as one launch, which
// removes the per-kernel launch cost of small, launch-bound steps. `fn` must run entirely on the
// current stream (capture() needs a side stream set with Accelerator::set_stream, as CUDA
// forbids capturing the legacy default stream), must not synchronise with the host (no .item(),
// no copies from pageable memory), and must have been run eagerly on that stream before, so
// that libraries have created their handles and workspaces. Tensors `fn` allocates come from
// the graph's private memory pool, live as long as the graph, and are rewritten in place by
// every replay(); inputs must be static tensors the caller refills. Without CUDA in this build,
// or with no GPU, the constructor throws InputError.
class CudaGraph {
 public:
  CudaGraph();
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void capture(const std::function<void()>& fn);
  void replay();  // on the current stream
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Page-locked host memory of exactly the requested size, for host<->device copies that run
// asynchronously at full link speed. With a visible GPU it comes from cudaHostAlloc and is freed
// (cudaFreeHost, after a device synchronisation: no copy may still read it) when the last tensor
// using it dies; otherwise it is ordinary memory. Why not at::empty(.., pinned_memory(true)):
// PyTorch's pinned allocator rounds every request up to a power of two and keeps freed blocks,
// so a 671 MB Gemini chunk shard takes 1 GiB: 1.6x the planned host memory.
at::Tensor empty_pinned(at::IntArrayRef sizes, at::ScalarType dtype);
// Uninitialised host memory: empty_pinned when `pinned`, else ordinary (pageable) memory.
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, bool pinned);
// A copy of `t` (any device) in new exact-size pinned memory, t's shape and dtype, contiguous.
at::Tensor to_pinned(const at::Tensor& t);
// A small host tensor (per-step offsets, work lists) copied to `device` without waiting for it:
// ATen's blocking copy from pageable memory synchronises the stream first. It goes through
// PyTorch's caching pinned allocator, which reuses a block only after the copy has read it
// (empty_pinned frees with a device synchronisation: for long-lived buffers, not these).
at::Tensor upload_async(const at::Tensor& host, const at::Device& device);

// Build and device facts for `colossal check`.
struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int64_t total_memory = 0;
  int major = 0, minor = 0;
  int multiprocessors = 0;
};
bool torch_has_cuda();               // this LibTorch was built with CUDA
std::string cuda_runtime_version();  // "13.0"; "" without CUDA
std::string cuda_driver_version();   // "" when no driver is loaded
std::vector<CudaDeviceInfo> cuda_devices();

// Registry of the CUDA kernels compiled into this build (kernel files add their names with
// COLOSSAL_REGISTER_CUDA_KERNEL at static-initialisation time).
bool register_cuda_kernel(const char* name);
std::vector<std::string> cuda_kernels();

}  // namespace colossal

#define COLOSSAL_REGISTER_CUDA_KERNEL_CAT2(a, b) a##b
#define COLOSSAL_REGISTER_CUDA_KERNEL_CAT(a, b) COLOSSAL_REGISTER_CUDA_KERNEL_CAT2(a, b)
#define COLOSSAL_REGISTER_CUDA_KERNEL(NAME)                             \
  [[maybe_unused]] static const bool COLOSSAL_REGISTER_CUDA_KERNEL_CAT( \
      colossal_kernel_reg_, __LINE__) = ::colossal::register_cuda_kernel(NAME)
