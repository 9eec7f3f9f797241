// The weight-gradient store of zero-bubble schedules (ZB-H1, ZB-V): while a store is open (the
// interpreter's B instruction), layers that can defer their weight-gradient GEMM (nn::Linear with
// set_defer_weight_grad) push it here instead of computing it; W runs them. So B computes the
// input gradient and every other parameter's gradient, W exactly the deferred dW = dy^T x GEMMs,
// each accumulated into its weight's .grad as autograd would.
#pragma once

#include <functional>
#include <mutex>
#include <vector>

namespace colossal::pipeline {

class WeightGradStore {
 public:
  // Makes `store` the open one for this scope (one at a time; the autograd engine's threads see
  // it too, hence a process-wide pointer rather than a thread-local one).
  class Scope {
   public:
    explicit Scope(WeightGradStore& store);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WeightGradStore* previous_;
  };

  // The open store, or nullptr: a deferrable layer computes its weight gradient at once then.
  static WeightGradStore* active();

  void push(std::function<void()> weight_grad);
  // Runs every deferred GEMM in push order, then empties the store.
  void run();
  size_t size() const;
  void clear();

 private:
  mutable std::mutex mu_;
  std::vector<std::function<void()>> pending_;
};

}  // namespace colossal::pipeline
