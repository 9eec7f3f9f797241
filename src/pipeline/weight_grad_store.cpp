// The weight-gradient store (see weight_grad_store.h).
#include "colossal/pipeline/weight_grad_store.h"

#include <atomic>

#include "colossal/core/error.h"

namespace colossal::pipeline {

namespace {
std::atomic<WeightGradStore*> g_active{nullptr};
}  // namespace

WeightGradStore::Scope::Scope(WeightGradStore& store) : previous_(g_active.exchange(&store)) {}
WeightGradStore::Scope::~Scope() {
  g_active.store(previous_);
}

WeightGradStore* WeightGradStore::active() {
  return g_active.load();
}

void WeightGradStore::push(std::function<void()> weight_grad) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(std::move(weight_grad));
}

void WeightGradStore::run() {
  std::vector<std::function<void()>> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    work.swap(pending_);
  }
  for (auto& f : work) f();
}

size_t WeightGradStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void WeightGradStore::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.clear();
}

}  // namespace colossal::pipeline
