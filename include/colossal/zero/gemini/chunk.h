// Gemini chunks: flat buffers of one dtype holding many parameters, each data-parallel rank
// owning 1/dp of every sharded chunk (ColossalAI's zero/gemini/chunk, rebuilt on LibTorch).
//
// A chunk of `size` elements (a multiple of the group size W; the tail is zero padding) holds
// parameters end to end. A *sharded* chunk keeps only this rank's `size / W` elements between
// uses (its shard); accessing it all-gathers the full buffer and re-points every parameter's
// data at its slice of that buffer (param.set_data(view): the parameter keeps its identity for
// optimizers and hooks); releasing it drops the full buffer and points the parameters at a
// one-element placeholder expanded to their shape (numel() and sizes() stay right, memory is
// one element, any value read is NaN). A *replicated* chunk (shard_param_frac < 1) keeps the
// full buffer on every rank and is never released.
//
// Every parameter of a chunk has a TensorState; only these transitions are legal (anything
// else throws an Error naming the chunk, the parameter and both states):
//   FREE -> HOLD                (chunk gathered)       FREE -> COMPUTE            (accessed)
//   HOLD -> COMPUTE             (module runs)          HOLD -> FREE               (released)
//   COMPUTE -> HOLD             (module done)          COMPUTE -> HOLD_AFTER_BWD  (grad arrived)
//   HOLD -> HOLD_AFTER_BWD      (grad arrived)         HOLD_AFTER_BWD -> COMPUTE  (recompute)
//   HOLD_AFTER_BWD -> READY_FOR_REDUCE (chunk complete)  READY_FOR_REDUCE -> HOLD (reduced)
// A gradient arriving for a FREE parameter (its chunk never gathered) or a READY_FOR_REDUCE one
// (reduced twice) is therefore an error, not silent corruption.
//
// Placement is bookkeeping plus real moves: the shard of the working parameters and the
// optimizer's chunk data (fp32 master, fp32 gradient shard, moments) each live on the compute
// device or on the host (pinned CPU memory when the device is a GPU). On a CPU-only run device
// and host are the same memory; the places and the bytes per place are still tracked.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "colossal/dist/communicator.h"

namespace colossal {
class Event;
}

namespace colossal::zero::gemini {

// Host <-> device chunk copies on a side stream of a CUDA device, so that chunk traffic runs on
// the copy engines while the compute stream keeps computing. A copy first waits for the work
// queued on the compute stream so far (it produced the source, or had the destination's memory
// before the caching allocator handed it out), and a device source is recorded on the side
// stream (its memory is not reused before the copy has read it). The caller makes the compute
// stream wait for the returned event before using the destination, and the host calls
// synchronize() before the CPU reads or writes a host buffer that a copy may still be using.
class CopyStream {
 public:
  explicit CopyStream(at::Device device);
  ~CopyStream();
  std::unique_ptr<Event> copy(at::Tensor& dst, const at::Tensor& src);
  // Makes the current (compute) stream wait for `done`.
  void wait_on_compute(Event& done);
  void synchronize();  // every copy issued so far has finished

 private:
  at::Device device_;
  c10::Stream side_;
};

enum class TensorState { Free, Compute, Hold, HoldAfterBwd, ReadyForReduce };
const char* to_string(TensorState s);
bool legal_transition(TensorState from, TensorState to);

enum class Place { Device, Host };
const char* to_string(Place p);

struct ChunkTensor {
  std::string name;
  at::Tensor param;    // the model's parameter (re-pointed on access/release)
  int64_t offset = 0;  // first element in the chunk
  int64_t numel = 0;
  TensorState state = TensorState::Free;
  bool requires_grad = true;
  bool grad_ready = false;  // its gradient of this backward has been copied into the chunk
};

class Chunk {
 public:
  // `size`: elements (multiple of `world` when sharded). `device`: where computation happens.
  Chunk(int id, int64_t size, at::ScalarType dtype, at::Device device, bool sharded,
        dist::Communicator comm);

  int id() const { return id_; }
  int64_t size() const { return size_; }
  int64_t shard_size() const { return size_ / shards_; }
  int shards() const { return shards_; }  // W when sharded, else 1
  int shard_index() const { return shard_index_; }
  int64_t shard_begin() const { return shard_size() * shard_index_; }
  bool sharded() const { return sharded_; }
  // Whether release() drops the full buffer: sharded over several ranks, or (one rank) with its
  // parameters placed on the host. Otherwise the full buffer is the shard and stays.
  bool releasable() const { return sharded_ && (shards_ > 1 || param_place_ == Place::Host); }
  at::ScalarType dtype() const { return dtype_; }
  at::Device device() const { return device_; }
  int64_t used() const { return used_; }  // elements holding parameters
  bool gathered() const { return full_.defined(); }
  bool gather_in_flight() const { return pending_; }
  std::vector<ChunkTensor>& tensors() { return tensors_; }
  const std::vector<ChunkTensor>& tensors() const { return tensors_; }
  int num_grad_tensors() const;

  // Builds the chunk from the parameters' current values (all ranks hold the same values).
  // After it the chunk is gathered; call release() to keep only the shard.
  bool fits(int64_t numel) const { return used_ + numel <= size_; }
  void append(const std::string& name, const at::Tensor& param);
  void finalize();  // copies the parameters into the full buffer and takes the shard

  // Starts the all-gather (async) into a fresh full buffer; wait_gather() finishes it and
  // re-points the parameters. access() = both, synchronously. No-ops when already gathered.
  // With FP8 communication on, the gather moves FP8 (every rank, the owner too, then holds the
  // dequantized values) unless `exact`.
  void start_gather(bool exact = false);
  // FP8 communication (set_fp8_communication): compute gathers in e4m3, gradient reductions in
  // e5m2.
  void set_fp8_communication(bool on) { fp8_ = on; }
  bool gathered_fp8() const { return full_fp8_; }
  // A full buffer gathered in FP8 is gathered again exactly, in place (the parameters keep
  // pointing at it). Collective over the chunk's group; a no-op otherwise.
  void make_exact();
  void wait_gather();
  void access() {
    start_gather();
    wait_gather();
  }
  // Drops the full buffer (sharded chunks only; every tensor must be HOLD or FREE). With
  // `write_back` the own slice of the full buffer is first copied into the shard (after the
  // parameters were written from outside, e.g. a checkpoint load).
  void release(bool write_back = false);

  void set_state(size_t tensor, TensorState to);
  void set_all(TensorState from, TensorState to);  // every tensor in `from`

  // This rank's shard of the working parameters (size shard_size()): for a replicated chunk it
  // is the full buffer itself.
  at::Tensor& shard() { return shard_; }
  const at::Tensor& full() const { return full_; }
  Place param_place() const { return param_place_; }
  // Bytes this chunk moved host -> device (gathers from a host shard, shard moves) and back.
  int64_t h2d_bytes() const { return h2d_bytes_; }
  int64_t d2h_bytes() const { return d2h_bytes_; }
  // Real copy between device and host. A one-rank chunk moved to the host is released (its
  // parameters are copied up at each access, ColossalAI's offload_param on one GPU); moved back,
  // it becomes its own compute buffer again. Tensors must be HOLD or FREE.
  void move_param_shard(Place to);

  // Gradient intake: copies `grad` (full shape of tensor k) into the chunk's gradient buffer
  // (allocated at the first gradient of a backward, zero-filled).
  void add_grad(size_t k, const at::Tensor& grad);
  bool grad_complete() const;  // every requires_grad tensor delivered its gradient
  bool has_grad_buffer() const { return grad_full_.defined(); }
  // Reduces the gradient buffer over the group (reduce-scatter average when sharded, all-reduce
  // average when replicated) and returns this rank's averaged part (shard_size elements, chunk
  // dtype or `comm_dtype`); the full gradient buffer is freed. A rank with no gradient
  // contributes zeros.
  at::Tensor reduce_grad(c10::optional<at::ScalarType> comm_dtype = c10::nullopt);
  // The same, launched asynchronously: `out` is valid once `work` is waited for (`in` must stay
  // alive until then).
  struct PendingReduce {
    dist::Work work;
    at::Tensor in, out;
  };
  PendingReduce reduce_grad_async(c10::optional<at::ScalarType> comm_dtype = c10::nullopt);

  // Copies up from a host shard (one rank) go through `mover` (CUDA), not the compute stream.
  void set_mover(std::shared_ptr<CopyStream> mover) { mover_ = std::move(mover); }

  // Byte counts (for the manager's accounting).
  int64_t shard_bytes() const;
  int64_t full_bytes() const;  // held now (0 unless gathered; replicated: == shard)

 private:
  void point_params_at_full();
  void point_params_at_placeholder();
  std::string describe(size_t k) const;

  int id_;
  int64_t size_;
  at::ScalarType dtype_;
  at::Device device_;
  bool sharded_;
  dist::Communicator comm_;
  int shards_ = 1, shard_index_ = 0;
  int64_t used_ = 0;
  std::vector<ChunkTensor> tensors_;
  at::Tensor shard_;  // own slice (device or host)
  at::Tensor full_;   // gathered buffer (device), undefined when released
  at::Tensor placeholder_;
  at::Tensor grad_full_;
  Place param_place_ = Place::Device;
  dist::Work gather_work_;
  at::Tensor gather_src_;
  bool pending_ = false;
  bool fp8_ = false;       // FP8 communication
  bool full_fp8_ = false;  // full_ came from an FP8 gather
  std::shared_ptr<CopyStream> mover_;
  std::unique_ptr<Event> up_done_;  // the side-stream copy filling full_
  int64_t h2d_bytes_ = 0, d2h_bytes_ = 0;
};

}  // namespace colossal::zero::gemini
