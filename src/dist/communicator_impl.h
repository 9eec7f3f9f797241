// Internal: what a Communicator and a Work hold.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <mutex>

#include "colossal/dist/communicator.h"

namespace colossal::dist {

struct Communicator::Impl {
  // The engine is created on first use (Gloo's constructor blocks until every member connects),
  // so groups come up in the order members first use them -- the order their collectives
  // already have to agree on -- and creating a group never deadlocks on creation order.
  const c10::intrusive_ptr<c10d::Backend>& get() {
    std::call_once(once, [this] { backend = factory(); });
    return backend;
  }
  bool created() const { return backend.defined(); }
  c10::intrusive_ptr<c10d::Backend> backend;
  std::function<c10::intrusive_ptr<c10d::Backend>()> factory;
  std::once_flag once;
  c10::intrusive_ptr<c10d::Store> store;  // the world's store (unprefixed); sub-groups prefix it
  Backend kind = Backend::Gloo;
  std::string name;
  int rank = 0;
  int size = 1;
  int world_rank = 0;
  std::vector<int> ranks;  // global rank of each group rank
  std::chrono::milliseconds timeout{0};
};

// Creates a communicator over `store` (the world's) for the given members; the group's keys live
// under a prefix derived from its name and members.
Communicator make_communicator(const c10::intrusive_ptr<c10d::Store>& store, Backend kind,
                               const std::string& name, const std::vector<int>& global_ranks,
                               int world_rank, std::chrono::milliseconds timeout, bool lazy);

struct Work::Impl {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> finish;  // runs once after success (e.g. the division of a Gloo Avg)
  std::string what;              // "all_reduce(sum) on group 'tp' (rank 1 of 2, global rank 3)"
  std::chrono::milliseconds timeout{0};
  bool blocking_wait = true;  // Gloo: wait(timeout) on the host; NCCL: stream-ordered wait
  std::mutex mu;
  bool done = false;
  std::string error;
};

}  // namespace colossal::dist
