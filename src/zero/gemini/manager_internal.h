// What chunk_manager.cpp, placement.cpp and gemini_optimizer.cpp share inside the Gemini
// ChunkManager (private to src/zero/gemini): small helpers, the initial placement rule and the
// deferred CPU-Adam update of the host chunks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "colossal/optim/adamw.h"
#include "colossal/zero/gemini/chunk_manager.h"
#include "colossal/zero/sharded_adamw.h"

namespace colossal::zero::gemini {

namespace detail {

constexpr double kM = 1024.0 * 1024.0;

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

inline bool is_half(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf;
}

inline int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Where a chunk starts (placement.cpp). static, by position in chunk memory (ColossalAI's rule):
// the last shard_param_frac is sharded, the first offload_optim_frac keeps its optimizer data on
// the host, the last offload_param_frac of the sharded chunks keeps its parameter shard on the
// host. auto shards every hooked chunk and starts it on the host; its warm-up placement brings
// what fits to the device. `start` and `total`: bytes of chunk memory before this chunk and in
// all chunks; `hooked`: a forward hook gathers it (else it stays replicated).
struct InitialPlace {
  bool sharded;
  Place optim;
  Place param;
};
InitialPlace initial_place(const GeminiOptions& o, double start, double total, bool hooked);

}  // namespace detail

// The CPU Adam of the host chunks of one step, on its own thread: chunk by chunk in next-use
// order, each flag cleared once that chunk's masters, moments and working shard are written.
struct ChunkManager::HostUpdate {
  struct Call {
    optim::AdamWHyper hyper;
    int64_t step;
    AdamWBatch lists;
  };
  struct Job {
    size_t chunk;
    std::vector<Call> calls;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<char> pending;  // per chunk
  std::exception_ptr error;
  std::thread thread;

  void run(std::vector<Job> jobs, double divisor) {
    thread = std::thread([this, jobs = std::move(jobs), divisor]() mutable {
      c10::NoGradGuard no_grad;
      try {
        for (Job& j : jobs) {
          for (Call& c : j.calls) c.lists.run(AdamWPath::Host, c.hyper, c.step, divisor);
          j.calls.clear();  // the gradient references go with the update
          std::lock_guard<std::mutex> lk(mu);
          pending[j.chunk] = 0;
          cv.notify_all();
        }
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        error = std::current_exception();
        cv.notify_all();
      }
    });
  }
};

}  // namespace colossal::zero::gemini
