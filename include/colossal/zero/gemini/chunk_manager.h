// Gemini's chunk manager: builds the chunks of a model, drives them from module forward hooks
// and gradient hooks (ZeRO-3), places them (static or auto policy), and holds the optimizer's
// chunk data (fp32 master / gradient / AdamW moment shards) with HybridAdam's update: chunks
// whose optimizer data is on the host run the SIMD CPU Adam, device chunks the fused AdamW.
//
// Lifecycle of one training step (sharded chunk):
//   forward pre hook of a layer   -> access its chunks (all-gather; prefetch the next
//                                    max_prefetch chunks of the recorded compute order, async)
//   forward post hook             -> COMPUTE -> HOLD; under no_grad the chunk is released
//                                    (with grad on, the autograd graph still reads the weights)
//   each parameter's gradient     -> copied into the chunk's gradient buffer, .grad dropped
//   chunk complete                -> reduce-scatter (average); this rank's part becomes the
//                                    gradient shard (kept in its dtype; fp32 once a second
//                                    micro-step adds to it), the chunk is released
//   end of backward               -> chunks not complete are reduced (ranks agree which, by a
//                                    MAX all-reduce of one byte per parameter), all released
//   step                          -> AdamW on the shards, working shard = master cast down;
//                                    chunks whose optimizer data and parameter shard are both
//                                    on the host (released between steps) are updated by the
//                                    CPU Adam on a background thread in next-use order while the
//                                    next forward runs: accessing such a chunk (or its next
//                                    gradient) first waits for its own update (overlap_cpu_adam)
// With activation checkpointing (layers recomputed in backward) the decoder layers' forwards
// run under no_grad, so their chunks are released right after forward and gathered again by
// the recompute: the full weights of a layer then live only while it computes.
//
// Gradient accumulation (no_sync): every micro-step is reduced and added to the gradient shard
// (in fp32 from the second micro-step on), so accumulation is exact and memory stays at the
// shard (ColossalAI's Gemini refuses accumulation with its default settings).
//
// The implementation is split by concern under src/zero/gemini/: chunk_manager.cpp (building
// the chunks, the hooks and the reduction: the forward/backward state machine), chunk_search.cpp,
// placement.cpp (static and auto placement, accounting) and gemini_optimizer.cpp (norm through
// the injected reducer, the HybridAdam step with its CPU-Adam thread, the state dict); the
// update and norm of a shard are zero/sharded_adamw.h, shared with ZeRO-1/2.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/amp/grad_reducer.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/json.h"
#include "colossal/dist/communicator.h"
#include "colossal/nn/module.h"
#include "colossal/optim/optimizer.h"
#include "colossal/zero/gemini/chunk.h"
#include "colossal/zero/gemini/options.h"

namespace torch::nn {
class Module;
}

namespace colossal::zero::gemini {

struct ChunkSearchResult {
  int64_t chunk_size = 0;
  int64_t num_chunks = 0;
  int64_t wasted = 0;  // padding elements over all chunks
  int64_t candidates = 0;
};
ChunkSearchResult search_chunk_size(const std::vector<int64_t>& numels, int dp,
                                    const ChunkSearchOptions& options);
// Greedy packing in order: how many chunks of `size` and how many elements wasted.
std::pair<int64_t, int64_t> pack(const std::vector<int64_t>& numels, int64_t size, int dp);

struct MemoryReport {
  int64_t param_device = 0, param_host = 0;    // working parameter shards (+ gathered buffers)
  int64_t grad_device = 0, grad_host = 0;      // gradient shards (+ live gradient buffers)
  int64_t master_device = 0, master_host = 0;  // fp32 master shards
  int64_t optim_device = 0, optim_host = 0;    // AdamW moments
  int64_t chunk_elements = 0, used_elements = 0;
  int64_t num_chunks = 0, sharded_chunks = 0, gathered_chunks = 0;
  int64_t peak_device = 0;  // highest device bytes of model data seen (CUDA: max allocated)
  // Chunk traffic since construction (on a CPU run: what would cross PCIe with these places).
  int64_t host_to_device = 0, device_to_host = 0;
  json::Value to_json() const;
};

class ChunkManager {
 public:
  // `masters`: (name, fp32 value) of parameters cast to half before (others use their values);
  // each is dropped as soon as its chunk has taken its master shard.
  // Parameters are grouped by (dtype, requires_grad, hooked); `hooked(name)` says whether a
  // forward pre hook will access it (unhooked chunks stay replicated: nothing would gather them).
  ChunkManager(torch::nn::Module& model, dist::Communicator comm, GeminiOptions options,
               std::vector<std::pair<std::string, at::Tensor>> masters);
  ~ChunkManager();
  ChunkManager(const ChunkManager&) = delete;
  ChunkManager& operator=(const ChunkManager&) = delete;

  const GeminiOptions& options() const { return options_; }
  size_t num_chunks() const { return chunks_.size(); }
  Chunk& chunk(size_t i) { return *chunks_[i]; }
  const Chunk& chunk(size_t i) const { return *chunks_[i]; }
  int64_t chunk_size() const { return chunk_size_; }
  int world() const { return world_; }
  Place optim_place(size_t chunk) const { return optim_[chunk].place; }
  const std::vector<int>& compute_order() const { return order_; }

  // Hooks (installed on every colossal::nn::Module of the model).
  void pre_forward(const std::vector<std::pair<int, size_t>>& tensors);
  void post_forward(const std::vector<std::pair<int, size_t>>& tensors);
  void on_grad(int chunk, size_t tensor);
  void finish_backward();
  void set_in_backward(bool b) { in_backward_ = b; }

  // Gathers every chunk (collective) so the parameters can be read or written from outside
  // (checkpoint save/load); such chunks write their slice back to the shard on release.
  void gather_all();
  // Releases every sharded chunk that is not in use.
  void release_all(bool write_back);
  // Streamed checkpoint reads (collective, same order on every rank): makes `param` readable,
  // gathering its chunk (a tensor in no chunk is readable already), and releases the chunk the
  // previous call gathered (if another); end_reads() releases the last one. Chunks gathered before
  // stay as they are.
  // write: the caller writes into the parameter; the change reaches the shard on release.
  void read_param(const at::Tensor& param, bool write = false);
  void end_reads();

  // Optimizer side.
  void bind_optimizer(std::shared_ptr<optim::Optimizer> inner);
  double grad_norm(double scale);  // global, fp64, inf/nan when any rank overflowed
  // The norm reducer (default: over the chunks' group, axis "dp"); a composed one also sums
  // over tensor / pipeline ranks. `replicated_over(name)`: the reducer axes over which that
  // parameter is the same on every rank (counted on rank 0 of each; default: none).
  using ReplicatedAxes = std::function<std::vector<std::string>(const std::string& name)>;
  void set_norm_reducer(amp::GradReducer reducer, ReplicatedAxes replicated_over = {});
  void step(double divisor);
  void zero_grad();
  optim::StateDict state_dict();
  void load_state_dict(const optim::StateDict& state);
  // Streamed checkpoints, as LowLevelZeroOptimizer's (bounded memory): state_plan() declares the
  // tensors of state_dict() without communicating; gather_state(i) assembles tensor i on group
  // rank `dst` only, from each rank's part of the chunk shards (collective); load_state() reads
  // each rank's slices into its shards.
  std::vector<checkpoint::TensorDecl> state_plan(json::Value* scalars);
  at::Tensor gather_state(size_t i, int dst);
  void load_state(const optim::StateSource& source);
  void sync_masters_from_params();

  // Placement.
  void move_optim(size_t chunk, Place to);
  // `device_stats`: also read the CUDA allocator's peak (off for the internal bookkeeping).
  MemoryReport memory_report(bool device_stats = true) const;
  int64_t device_bytes() const;  // model data on the device now
  bool warmed_up() const { return warmed_up_; }
  // Chunks whose CPU Adam the last step() left running beside the next forward.
  int64_t deferred_updates() const { return deferred_updates_; }
  // Waits for every deferred host update (rethrows its error); step(), checkpoints and
  // gather_all() call it themselves.
  void finish_updates();

 private:
  struct HostUpdate;  // the deferred CPU Adam of the last step: its thread and per-chunk flags
  struct OptimChunk {
    Place place = Place::Device;
    at::Tensor master, exp_avg, exp_avg_sq;  // fp32, shard_size
    at::Tensor grad;          // reduce -> step only: the reduced dtype, fp32 when accumulated
    at::Tensor host_working;  // host optim + device params: CPU Adam writes the cast here
    at::Tensor host_grad;     // host optim on CUDA: the pinned buffer grad lives in, kept
    // Host optim on CUDA: grad's sum of squares (fp64, on the device), taken on the GPU before
    // the copy down so the norm never reads the host copy; undefined once micro-steps add.
    at::Tensor grad_sq;
  };
  struct TensorInfo {    // per (chunk, tensor)
    int64_t group = -1;  // optimizer group, -1: not in the optimizer
    int64_t step = 0;
    bool had_grad = false;    // some rank produced a gradient since the last step
    bool local_grad = false;  // this rank produced one in this backward
    bool needed = false;      // read by a forward with grad on; its backward has not run yet
    int compute_refs = 0;     // modules inside whose forward it is
  };
  at::Device host_device() const { return at::Device(at::kCPU); }
  at::Device place_device(const Chunk& c, Place p) const;
  at::Tensor new_f32(const Chunk& chunk, Place p) const;
  void record_access(int chunk);
  void wait_update(size_t chunk);           // that chunk's deferred update has been written
  bool update_pending(size_t chunk) const;  // without waiting
  void prefetch_after(int chunk);
  void reduce_chunk(int chunk);
  void finish_reduces(size_t keep);  // completes in-flight reductions until `keep` remain
  void update_peak();
  void arm_finish();
  void auto_place(bool warmup);
  std::pair<int64_t, int64_t> own_range(const Chunk& c, const ChunkTensor& t) const;
  at::Tensor gather_f32(size_t chunk, const at::Tensor& shard);
  struct PlanEntry {
    size_t chunk, tensor;
    int which;  // 0 master, 1 exp_avg, 2 exp_avg_sq
  };
  std::vector<PlanEntry> plan_;  // state_plan()
  int read_chunk_ = -1;          // read_param(): the chunk it gathered, -1: none
  bool read_write_ = false;      // ... and whether it was written

  GeminiOptions options_;
  c10::optional<at::ScalarType> comm_dtype_;  // options_.communication_dtype parsed
  dist::Communicator comm_;
  amp::GradReducer reducer_;
  ReplicatedAxes replicated_;
  int world_ = 1, rank_ = 0;
  at::Device device_{at::kCPU};
  int64_t chunk_size_ = 0;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::vector<OptimChunk> optim_;
  std::vector<std::vector<TensorInfo>> info_;
  std::map<const void*, std::pair<int, size_t>> where_;  // TensorImpl -> (chunk, tensor)
  std::shared_ptr<optim::Optimizer> inner_;
  std::vector<int> order_;  // chunk ids in first-access order (warm-up)
  std::vector<int> order_pos_;
  bool order_frozen_ = false;
  bool in_backward_ = false;
  std::vector<char> external_;  // gathered by gather_all(): write back on release
  std::vector<char> reduced_;   // this backward
  size_t next_reduce_ = 0;      // into reduce_order_
  std::vector<int> reduce_order_;
  struct InFlight {
    int chunk;
    Chunk::PendingReduce r;
  };
  std::vector<InFlight> in_flight_;  // launch order
  bool armed_ = false;
  bool warmed_up_ = false;
  bool pin_ = false;
  std::shared_ptr<CopyStream> mover_;  // CUDA: host <-> device chunk copies off the compute stream
  int64_t peak_device_ = 0;
  int64_t transient_peak_ = 0;             // gathered + gradient buffers, highest seen
  int64_t h2d_bytes_ = 0, d2h_bytes_ = 0;  // optimizer-side moves (chunks count their own)
  std::unique_ptr<HostUpdate> host_update_;
  int64_t deferred_updates_ = 0;
  std::shared_ptr<bool> alive_;
};

// Installs the forward hooks (pre: access, post: hold/release) on every colossal::nn::Module
// of `model` and the gradient hooks on every chunked parameter; returns the hook handles.
// Parameters whose nearest colossal::nn::Module ancestor is none are reported by
// `unhooked_names` before the manager is built (they go to replicated chunks).
std::vector<std::string> unhooked_parameters(torch::nn::Module& model);
std::vector<nn::HookHandle> install_hooks(torch::nn::Module& model,
                                          const std::shared_ptr<ChunkManager>& manager);

}  // namespace colossal::zero::gemini
