// Communicator: collectives over a group of ranks, on LibTorch's own c10d engines (NCCL for CUDA
// tensors, Gloo for CPU tensors). Everything above dist/ talks to this class only, so ZeRO,
// Gemini, pipeline and MoE never know which engine runs.
//
// Every operation returns a Work; with async_op = false (the default) it has already been waited
// on. A failure or timeout surfaces as colossal::DistError naming the collective, the group and
// the rank — never a hang: each operation carries the communicator's timeout (default 30 min,
// COLOSSAL_DIST_TIMEOUT_S, or set_timeout()). On NCCL, wait() only orders the current CUDA
// stream after the operation (no host blocking) and ProcessGroupNCCL's watchdog enforces the
// timeout: it reports the group by name and ends the process.
//
// fp8 tensors (float8_e4m3fn / e5m2) are moved as bytes by the non-reducing operations
// (all_gather, broadcast, all_to_all, send/recv); reducing them is an error.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace colossal::dist {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* to_string(ReduceOp op);

enum class Backend { Gloo, Nccl };
const char* to_string(Backend b);
// Which engines this build contains (Gloo needs its headers at build time, NCCL a CUDA LibTorch).
bool backend_available(Backend b);
// Version of the NCCL LibTorch was built with ("2.28.9"); "" when this build has no NCCL.
std::string nccl_version();

// Default timeout of new communicators: COLOSSAL_DIST_TIMEOUT_S when set (seconds, > 0), else 30
// min.
std::chrono::milliseconds default_timeout();

// Handle to a possibly still running operation. Copies share the operation.
class Work {
 public:
  Work() = default;  // an already completed no-op
  // Blocks until done; throws DistError (naming collective, group and rank) on failure or timeout.
  // Idempotent: later calls return at once (or rethrow the same error).
  void wait();
  bool is_completed() const;

  struct Impl;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<Impl> impl_;
};

// One point-to-point operation of a batch (see Communicator::batch_p2p).
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind;
  at::Tensor tensor;
  int peer;  // group rank
  int tag = 0;
  static P2POp send(at::Tensor t, int peer, int tag = 0) {
    return {Kind::Send, std::move(t), peer, tag};
  }
  static P2POp recv(at::Tensor t, int peer, int tag = 0) {
    return {Kind::Recv, std::move(t), peer, tag};
  }
};

class Communicator {
 public:
  Communicator() = default;  // not a member of any group: valid() is false

  bool valid() const { return impl_ != nullptr; }
  explicit operator bool() const { return valid(); }
  int rank() const;  // rank inside this group
  int size() const;
  const std::string& name() const;
  Backend backend() const;
  // Global (world) rank of every group rank, in group-rank order.
  const std::vector<int>& ranks() const;
  int global_rank(int group_rank) const;
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);

  // In place over all ranks. Avg on Gloo is a sum then a division; integer Avg is refused.
  Work all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::Sum, bool async_op = false);
  // output holds size() * input.numel() elements: rank r's input lands at [r*n, (r+1)*n) of the
  // flattened output (i.e. concatenated along dim 0).
  Work all_gather(at::Tensor& output, const at::Tensor& input, bool async_op = false);
  // input holds size() * output.numel() elements; rank r receives the reduction of slice r.
  Work reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::Sum,
                      bool async_op = false);
  Work broadcast(at::Tensor& tensor, int src, bool async_op = false);  // src: group rank
  // Equal splits along dim 0: slice j of input goes to rank j; slice i of output came from rank i.
  Work all_to_all(at::Tensor& output, const at::Tensor& input, bool async_op = false);
  // Uneven splits along dim 0: input_splits[j] rows go to rank j, output_splits[i] rows come from
  // rank i (each rank's output_splits[i] must equal rank i's input_splits[this rank]).
  Work all_to_all(at::Tensor& output, const at::Tensor& input,
                  const std::vector<int64_t>& output_splits,
                  const std::vector<int64_t>& input_splits, bool async_op = false);
  Work send(const at::Tensor& tensor, int dst, int tag = 0, bool async_op = false);
  Work recv(at::Tensor& tensor, int src, int tag = 0, bool async_op = false);
  // Issues every op, then returns one Work for all of them (NCCL: one group call). Sends and
  // receives may be mixed freely, e.g. a ring exchange without ordering tricks.
  Work batch_p2p(const std::vector<P2POp>& ops, bool async_op = false);
  void barrier();

  // Builds a communicator over `global_ranks` (sorted or not; the order gives the group ranks).
  // Only members need to call it; non-members get an invalid Communicator back when they do.
  // The engine connects on the group's first operation, so creating groups never blocks and
  // their creation order does not matter; members must only agree on the (name, members) pair.
  Communicator new_group(const std::vector<int>& global_ranks, const std::string& name) const;

  struct Impl;
  explicit Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<Impl>& impl() const { return impl_; }

 private:
  Impl& self() const;
  std::shared_ptr<Impl> impl_;
};

}  // namespace colossal::dist
