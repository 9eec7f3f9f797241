// Gemini chunk manager: construction (grouping, packing, masters), the forward and gradient
// hooks, and the per-chunk gradient reduction -- the forward/backward state machine. The chunk
// size search is in chunk_search.cpp, placement and accounting in placement.cpp, the optimizer
// (norm, HybridAdam step, the CPU-Adam thread, state dict) in gemini_optimizer.cpp.
#include "colossal/zero/gemini/chunk_manager.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/models/llama/model.h"
#include "zero/gemini/manager_internal.h"

namespace colossal::zero::gemini {

using namespace detail;

// ---- construction -----------------------------------------------------------------------------

namespace {

// Calls the nearest colossal::nn::Module at or above each parameter (the one whose forward
// hooks will access it); `fn(module or null, name, param)`.
void walk_params(
    torch::nn::Module& root,
    const std::function<void(nn::Module*, const std::string&, const at::Tensor&)>& fn) {
  std::function<void(torch::nn::Module&, nn::Module*, const std::string&)> walk =
      [&](torch::nn::Module& m, nn::Module* nearest, const std::string& prefix) {
        if (auto* cm = dynamic_cast<nn::Module*>(&m)) nearest = cm;
        for (auto& item : m.named_parameters(false)) fn(nearest, prefix + item.key(), item.value());
        for (auto& child : m.named_children())
          walk(*child.value(), nearest, prefix + child.key() + ".");
      };
  walk(root, nullptr, "");
}

}  // namespace

std::vector<std::string> unhooked_parameters(torch::nn::Module& model) {
  std::vector<std::string> out;
  walk_params(model, [&](nn::Module* m, const std::string& name, const at::Tensor&) {
    if (!m) out.push_back(name);
  });
  return out;
}

ChunkManager::ChunkManager(torch::nn::Module& model, dist::Communicator comm, GeminiOptions options,
                           std::vector<std::pair<std::string, at::Tensor>> masters)
    : options_(std::move(options)), comm_(std::move(comm)), alive_(std::make_shared<bool>(true)) {
  const auto t_start = std::chrono::steady_clock::now();
  const auto& o = options_;
  COLOSSAL_CHECK_INPUT(o.placement_policy == "static" || o.placement_policy == "auto",
                       "gemini: placement_policy must be static or auto, got '", o.placement_policy,
                       "'");
  for (auto [name, v] : {std::pair<const char*, double>{"shard_param_frac", o.shard_param_frac},
                         {"offload_optim_frac", o.offload_optim_frac},
                         {"offload_param_frac", o.offload_param_frac},
                         {"steady_cuda_cap_ratio", o.steady_cuda_cap_ratio},
                         {"warmup_non_model_data_ratio", o.warmup_non_model_data_ratio}})
    COLOSSAL_CHECK_INPUT(v >= 0.0 && v <= 1.0, "gemini: ", name, " must be in [0, 1], got ", v);
  COLOSSAL_CHECK_INPUT(o.max_prefetch >= 0, "gemini: max_prefetch must be >= 0, got ",
                       o.max_prefetch);
  COLOSSAL_CHECK_INPUT(o.device_capacity_mb >= 0, "gemini: device_capacity_mb must be >= 0, got ",
                       o.device_capacity_mb);
  if (o.communication_dtype == "fp32") {
    comm_dtype_ = at::kFloat;
  } else if (o.communication_dtype == "bf16") {
    comm_dtype_ = at::kBFloat16;
  } else if (o.communication_dtype == "fp16") {
    comm_dtype_ = at::kHalf;
  } else {
    COLOSSAL_CHECK_INPUT(o.communication_dtype.empty(), "gemini: unknown communication_dtype '",
                         o.communication_dtype, "' (expected fp32, fp16 or bf16)");
  }
  if (comm_.valid()) {
    world_ = comm_.size();
    rank_ = comm_.rank();
  }

  // Parameters in registration order (deduplicated), grouped by (dtype, requires_grad, hooked).
  std::set<std::string> unhooked;
  for (auto& n : unhooked_parameters(model)) unhooked.insert(n);
  std::set<const void*> seen;
  struct Group {
    at::ScalarType dtype;
    bool grad, hooked;
    std::vector<std::pair<std::string, at::Tensor>> params;
  };
  std::vector<Group> groups;
  std::vector<int64_t> numels;
  for (auto& item : model.named_parameters(true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    COLOSSAL_CHECK_INPUT(p.is_floating_point(), "gemini: parameter '", item.key(),
                         "' is not floating point");
    const bool hooked = !unhooked.count(item.key());
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
      return g.dtype == p.scalar_type() && g.grad == p.requires_grad() && g.hooked == hooked;
    });
    if (it == groups.end()) {
      groups.push_back({p.scalar_type(), p.requires_grad(), hooked, {}});
      it = groups.end() - 1;
    }
    it->params.emplace_back(item.key(), p);
    numels.push_back(p.numel());
  }
  COLOSSAL_CHECK_INPUT(!numels.empty(), "gemini: the model has no parameters");
  device_ = groups.front().params.front().second.device();
  pin_ = device_.is_cuda();
  if (device_.is_cuda()) mover_ = std::make_shared<CopyStream>(device_);

  ChunkSearchResult sr = search_chunk_size(numels, world_, o);
  chunk_size_ = sr.chunk_size;

  // Packing plan: greedy in order within each group; an oversize parameter gets its own chunk.
  struct Plan {
    size_t group;
    int64_t size;
    std::vector<size_t> members;
    int64_t used = 0;
  };
  std::vector<Plan> plan;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    int open = -1;
    for (size_t k = 0; k < groups[gi].params.size(); ++k) {
      const int64_t n = groups[gi].params[k].second.numel();
      if (n > chunk_size_) {
        plan.push_back({gi, round_up(n, world_), {k}, n});
        continue;
      }
      if (open < 0 || plan[static_cast<size_t>(open)].used + n > chunk_size_) {
        plan.push_back({gi, chunk_size_, {}, 0});
        open = static_cast<int>(plan.size()) - 1;
      }
      plan[static_cast<size_t>(open)].members.push_back(k);
      plan[static_cast<size_t>(open)].used += n;
    }
  }

  // Initial places (placement.cpp): static by position in chunk memory, auto all on the host
  // until its warm-up placement below.
  int64_t total_bytes = 0;
  for (auto& pl : plan)
    total_bytes += pl.size * static_cast<int64_t>(c10::elementSize(groups[pl.group].dtype));
  const bool is_auto = o.placement_policy == "auto";
  std::map<std::string, at::Tensor*> fp32;  // dropped as soon as its chunk has its masters
  for (auto& [n, t] : masters) fp32[n] = &t;
  int64_t start_bytes = 0;
  std::vector<Place> param_place;
  for (size_t ci = 0; ci < plan.size(); ++ci) {
    const Plan& pl = plan[ci];
    const Group& g = groups[pl.group];
    const double s = static_cast<double>(start_bytes), T = static_cast<double>(total_bytes);
    start_bytes += pl.size * static_cast<int64_t>(c10::elementSize(g.dtype));
    const InitialPlace ip = initial_place(o, s, T, g.hooked);
    const bool sharded = ip.sharded;
    // Every chunk is rounded to a multiple of dp (the search does it; oversize ones above).
    auto chunk =
        std::make_unique<Chunk>(static_cast<int>(ci), pl.size, g.dtype, device_, sharded, comm_);
    for (size_t k : pl.members) chunk->append(g.params[k].first, g.params[k].second);
    chunk->set_mover(mover_);
    chunk->set_fp8_communication(o.fp8_communication);
    OptimChunk oc;
    oc.place = ip.optim;
    param_place.push_back(ip.param);
    if (g.grad) {
      // fp32 masters from the values before the cast (or the parameters themselves).
      // Allocated where it will live: a model whose fp32 state does not fit the device never
      // has it there, even during construction.
      oc.master = new_f32(*chunk, oc.place);
      // The fp32 gradient shard is allocated by the first reduction (construction peak).
      for (auto& t : chunk->tensors()) {
        auto [a, b] = own_range(*chunk, t);
        if (a >= b) continue;
        auto it = fp32.find(t.name);
        at::Tensor full = (it != fp32.end() ? *it->second : t.param).detach().reshape({-1});
        oc.master.narrow(0, a - chunk->shard_begin(), b - a)
            .copy_(full.narrow(0, a - t.offset, b - a));
      }
    }
    for (auto& t : chunk->tensors()) {  // the fp32 originals are no longer needed
      auto it = fp32.find(t.name);
      if (it != fp32.end()) *it->second = at::Tensor();
    }
    chunks_.push_back(std::move(chunk));
    optim_.push_back(std::move(oc));
  }
  info_.resize(chunks_.size());
  external_.assign(chunks_.size(), 0);
  for (size_t ci = 0; ci < chunks_.size(); ++ci) {
    Chunk& c = *chunks_[ci];
    c.finalize();
    info_[ci].resize(c.tensors().size());
    for (size_t k = 0; k < c.tensors().size(); ++k)
      where_[c.tensors()[k].param.unsafeGetTensorImpl()] = {static_cast<int>(ci), k};
    c.release();
    c.move_param_shard(param_place[ci]);
    if (c.num_grad_tensors() > 0) reduce_order_.push_back(static_cast<int>(ci));
  }
  std::reverse(reduce_order_.begin(), reduce_order_.end());  // backward meets the last chunks first
  reduced_.assign(chunks_.size(), 0);
  order_pos_.assign(chunks_.size(), -1);
  if (is_auto) auto_place(/*warmup=*/true);
  update_peak();
  // The norm agrees over the sharding group by default; set_norm_reducer() widens it.
  reducer_ = amp::over(comm_, device_, "dp");

  int64_t sharded = 0, used = 0, all = 0;
  for (auto& c : chunks_) {
    sharded += c->sharded() && c->shards() > 1 ? 1 : 0;
    used += c->used();
    all += c->size();
  }
  if (rank_ == 0)
    log_info("gemini: chunk size ", chunk_size_, " elements (", sr.candidates,
             " candidates searched); ", all - used, " elements of padding = ",
             all > 0 ? 100.0 * static_cast<double>(all - used) / static_cast<double>(all) : 0.0,
             "%; ", chunks_.size(), " chunks, ", sharded, " sharded over ", world_,
             " rank(s), placement ", o.placement_policy, "; built in ",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(),
             " s");
}

ChunkManager::~ChunkManager() {
  alive_.reset();
  try {
    finish_updates();
  } catch (const std::exception& e) {
    log_error("gemini: the CPU Adam of the host chunks failed at shutdown: ", e.what());
  }
  try {
    finish_reduces(0);
  } catch (const std::exception& e) {
    log_error("gemini: in-flight gradient reduction failed at shutdown: ", e.what());
  }
  for (auto& c : chunks_) {
    try {
      c->wait_gather();
    } catch (const std::exception& e) {
      log_error("gemini: in-flight chunk gather failed at shutdown: ", e.what());
    }
  }
}

std::pair<int64_t, int64_t> ChunkManager::own_range(const Chunk& c, const ChunkTensor& t) const {
  const int64_t a = std::max(t.offset, c.shard_begin());
  const int64_t b = std::min(t.offset + t.numel, c.shard_begin() + c.shard_size());
  return {a, std::max(a, b)};
}

// ---- forward / backward -----------------------------------------------------------------------

void ChunkManager::record_access(int c) {
  if (order_frozen_ || order_pos_[static_cast<size_t>(c)] >= 0) return;
  order_pos_[static_cast<size_t>(c)] = static_cast<int>(order_.size());
  order_.push_back(c);
}

void ChunkManager::prefetch_after(int c) {
  if (options_.max_prefetch <= 0 || !order_frozen_) return;
  const int pos = order_pos_[static_cast<size_t>(c)];
  if (pos < 0) return;
  const int dir = in_backward_ ? -1 : 1;
  for (int64_t i = 1; i <= options_.max_prefetch; ++i) {
    const int64_t q = pos + dir * i;
    if (q < 0 || q >= static_cast<int64_t>(order_.size())) break;
    const auto next = static_cast<size_t>(order_[static_cast<size_t>(q)]);
    if (update_pending(next)) continue;  // gathered at its access, once its update is written
    chunks_[next]->start_gather();
  }
}

void ChunkManager::pre_forward(const std::vector<std::pair<int, size_t>>& tensors) {
  int last = -1;
  for (auto [c, k] : tensors) {
    Chunk& ch = *chunks_[static_cast<size_t>(c)];
    if (c != last) {
      record_access(c);
      wait_update(static_cast<size_t>(c));
      ch.access();
      last = c;
    }
    TensorInfo& ti = info_[static_cast<size_t>(c)][k];
    ti.compute_refs += 1;
    ch.set_state(k, TensorState::Compute);
    if (c10::GradMode::is_enabled()) ti.needed = true;  // the autograd graph reads it
  }
  if (last >= 0) prefetch_after(last);
  update_peak();
}

void ChunkManager::post_forward(const std::vector<std::pair<int, size_t>>& tensors) {
  for (auto [c, k] : tensors) {
    TensorInfo& ti = info_[static_cast<size_t>(c)][k];
    ti.compute_refs = std::max(0, ti.compute_refs - 1);
    Chunk& ch = *chunks_[static_cast<size_t>(c)];
    if (ti.compute_refs == 0 && ch.tensors()[k].state == TensorState::Compute)
      ch.set_state(k, TensorState::Hold);
  }
  if (c10::GradMode::is_enabled()) return;
  // Under no_grad nothing keeps the weights for later: release what no one needs.
  int last = -1;
  for (auto [c, k] : tensors) {
    if (c == last) continue;
    last = c;
    Chunk& ch = *chunks_[static_cast<size_t>(c)];
    bool busy = false;
    for (size_t j = 0; j < ch.tensors().size(); ++j) {
      const auto s = ch.tensors()[j].state;
      busy = busy || info_[static_cast<size_t>(c)][j].needed ||
             (s != TensorState::Hold && s != TensorState::Free);
    }
    if (!busy) {
      ch.release(external_[static_cast<size_t>(c)] != 0);
      external_[static_cast<size_t>(c)] = 0;
    }
  }
}

void ChunkManager::arm_finish() {
  if (armed_) return;
  armed_ = true;
  std::weak_ptr<bool> alive = alive_;
  torch::autograd::Engine::get_default_engine().queue_callback([this, alive] {
    if (!alive.expired()) finish_backward();
  });
}

void ChunkManager::on_grad(int c, size_t k) {
  Chunk& ch = *chunks_[static_cast<size_t>(c)];
  ChunkTensor& t = ch.tensors()[k];
  arm_finish();
  COLOSSAL_CHECK(!reduced_[static_cast<size_t>(c)], "gemini chunk ", c, " parameter '", t.name,
                 "': a gradient arrived after the chunk was reduced in this backward");
  at::Tensor g = t.param.grad();
  if (!g.defined()) return;
  ch.set_state(k, TensorState::HoldAfterBwd);
  ch.add_grad(k, g);
  t.param.mutable_grad() = at::Tensor();
  TensorInfo& ti = info_[static_cast<size_t>(c)][k];
  ti.local_grad = true;
  ti.needed = false;
  update_peak();
  // Reduce complete chunks strictly in the fixed order, so every rank issues the same sequence.
  while (next_reduce_ < reduce_order_.size()) {
    const int r = reduce_order_[next_reduce_];
    if (!chunks_[static_cast<size_t>(r)]->grad_complete()) break;
    for (auto& ti2 : info_[static_cast<size_t>(r)]) ti2.had_grad = true;
    reduce_chunk(r);
    ++next_reduce_;
  }
}

void ChunkManager::reduce_chunk(int c) {
  Chunk& ch = *chunks_[static_cast<size_t>(c)];
  for (size_t k = 0; k < ch.tensors().size(); ++k) {
    if (ch.tensors()[k].state == TensorState::Free) ch.set_state(k, TensorState::Hold);
    ch.set_state(k, TensorState::HoldAfterBwd);
    ch.set_state(k, TensorState::ReadyForReduce);
  }
  // Asynchronous (NCCL: on the communicator's stream, overlapping the rest of backward); at
  // most two in flight, the rest finished by finish_backward().
  in_flight_.push_back({c, ch.reduce_grad_async(comm_dtype_)});
  ch.set_all(TensorState::ReadyForReduce, TensorState::Hold);
  for (auto& ti : info_[static_cast<size_t>(c)]) ti.needed = false;
  bool busy = false;
  for (size_t k = 0; k < ch.tensors().size(); ++k)
    busy = busy || info_[static_cast<size_t>(c)][k].compute_refs > 0;
  if (!busy) {
    ch.release(external_[static_cast<size_t>(c)] != 0);
    external_[static_cast<size_t>(c)] = 0;
  }
  reduced_[static_cast<size_t>(c)] = 1;
  finish_reduces(2);
}

void ChunkManager::finish_reduces(size_t keep) {
  size_t done = 0;
  while (in_flight_.size() - done > keep) {
    InFlight& f = in_flight_[done++];
    f.r.work.wait();
    wait_update(static_cast<size_t>(f.chunk));  // its CPU Adam may still read the host gradient
    OptimChunk& oc = optim_[static_cast<size_t>(f.chunk)];
    if (oc.master.defined()) {
      c10::NoGradGuard no_grad;
      const at::Tensor& part = f.r.out;
      if (oc.place == Place::Host) d2h_bytes_ += bytes_of(part);
      const at::Device d = place_device(*chunks_[static_cast<size_t>(f.chunk)], oc.place);
      if (!oc.grad.defined()) {
        // The first reduction of a step is kept as it arrives (the working or communication
        // dtype: exact, and half the bytes of fp32 for bf16/fp16); on the device it is the
        // reduced buffer itself. Both Adams read bf16/fp16 gradients.
        if (part.device() == d) {
          oc.grad = part;
        } else if (d.is_cpu() && pin_) {
          // One exact-size pinned buffer per host chunk, kept across steps (no allocation, no
          // power-of-two rounding per step).
          if (!oc.host_grad.defined() || oc.host_grad.numel() != part.numel() ||
              oc.host_grad.scalar_type() != part.scalar_type())
            oc.host_grad = empty_pinned(part.sizes(), part.scalar_type());
          oc.grad = oc.host_grad;
          // Its sum of squares is taken on the device first, so grad_norm never reads the host
          // copy. The copy goes on the side stream: read on the host after finish_reduces(0).
          std::function<void(at::Tensor&, const at::Tensor&)> side;
          if (mover_)
            side = [this](at::Tensor& dst, const at::Tensor& src) { mover_->copy(dst, src); };
          oc.grad_sq = copy_grad_to_host(oc.grad, part, side);
        } else {
          oc.grad = at::empty(part.sizes(), part.options().device(d));
          oc.grad.copy_(part);
        }
      } else {
        // Accumulation (no_sync micro-steps): the sum is kept in fp32.
        if (mover_) mover_->synchronize();  // the first part may still be on its way down
        oc.grad_sq = at::Tensor();          // the sum is new: grad_norm reads it
        if (oc.grad.scalar_type() != at::kFloat) {
          at::Tensor f32 = at::empty(oc.grad.sizes(), oc.grad.options().dtype(at::kFloat));
          f32.copy_(oc.grad);
          oc.grad = f32;
        }
        oc.grad.add_(part.to(d, at::kFloat));
      }
    }
  }
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
  // Everything reduced: the host gradients have landed, and no copy up still reads a host shard
  // that the CPU Adam or a checkpoint is about to touch.
  if (keep == 0 && mover_) mover_->synchronize();
}

void ChunkManager::finish_backward() {
  armed_ = false;
  // Chunks still waiting (a parameter without a gradient on this rank): every rank learns which
  // parameters got a gradient anywhere, then reduces the same chunks in the same order.
  std::vector<std::pair<int, size_t>> pending;
  for (size_t i = next_reduce_; i < reduce_order_.size(); ++i) {
    const int c = reduce_order_[i];
    for (size_t k = 0; k < chunks_[static_cast<size_t>(c)]->tensors().size(); ++k)
      pending.emplace_back(c, k);
  }
  if (!pending.empty()) {
    at::Tensor flags = at::zeros({static_cast<int64_t>(pending.size())}, at::kByte);
    auto* f = flags.data_ptr<uint8_t>();
    for (size_t i = 0; i < pending.size(); ++i)
      f[i] = info_[static_cast<size_t>(pending[i].first)][pending[i].second].local_grad ? 1 : 0;
    if (world_ > 1) {
      at::Tensor d = flags.to(device_);
      comm_.all_reduce(d, dist::ReduceOp::Max);
      flags = d.to(at::kCPU);
      f = flags.data_ptr<uint8_t>();
    }
    size_t i = 0;
    for (size_t r = next_reduce_; r < reduce_order_.size(); ++r) {
      const int c = reduce_order_[r];
      bool any = false;
      for (size_t k = 0; k < chunks_[static_cast<size_t>(c)]->tensors().size(); ++k, ++i) {
        TensorInfo& ti = info_[static_cast<size_t>(c)][k];
        if (f[i]) ti.had_grad = true;
        any = any || f[i];
      }
      if (any) reduce_chunk(c);
    }
  }
  finish_reduces(0);
  next_reduce_ = 0;
  std::fill(reduced_.begin(), reduced_.end(), 0);
  for (auto& v : info_)
    for (auto& ti : v) {
      ti.local_grad = false;
      ti.needed = false;
    }
  in_backward_ = false;
  release_all(true);
}

void ChunkManager::gather_all() {
  finish_updates();
  // Saves and loads read exact weights: new gathers are exact, FP8 ones are redone.
  for (auto& c : chunks_) c->start_gather(/*exact=*/true);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i]->releasable() && !chunks_[i]->gathered()) external_[i] = 1;
    if (chunks_[i]->gather_in_flight()) external_[i] = 1;
    chunks_[i]->wait_gather();
    chunks_[i]->make_exact();
  }
  update_peak();
}

void ChunkManager::release_all(bool write_back) {
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& ch = *chunks_[i];
    bool busy = false;
    for (size_t k = 0; k < ch.tensors().size(); ++k) {
      const auto s = ch.tensors()[k].state;
      busy = busy || info_[i][k].compute_refs > 0 || info_[i][k].needed ||
             (s != TensorState::Hold && s != TensorState::Free);
    }
    if (busy) continue;
    ch.release(write_back && external_[i] != 0);
    external_[i] = 0;
  }
}

void ChunkManager::read_param(const at::Tensor& param, bool write) {
  auto it = where_.find(param.unsafeGetTensorImpl());
  if (it == where_.end()) return;  // in no chunk (a buffer): readable as it is
  const int c = it->second.first;
  if (c == read_chunk_) {
    read_write_ = read_write_ || write;
    return;
  }
  end_reads();
  finish_updates();
  Chunk& ch = *chunks_[static_cast<size_t>(c)];
  if (ch.gathered() && !ch.gather_in_flight()) {
    // Gathered already: left as it is (exact: an FP8 gather is redone); a write reaches the
    // shard on its next release.
    ch.make_exact();
    if (write && ch.releasable()) external_[static_cast<size_t>(c)] = 1;
    return;
  }
  ch.start_gather(/*exact=*/true);
  ch.wait_gather();
  ch.make_exact();  // it was in flight as an FP8 (prefetch) gather
  read_chunk_ = c;
  read_write_ = write;
}

void ChunkManager::end_reads() {
  if (read_chunk_ < 0) return;
  chunks_[static_cast<size_t>(read_chunk_)]->release(/*write_back=*/read_write_);
  read_chunk_ = -1;
  read_write_ = false;
}

// ---- hooks ------------------------------------------------------------------------------------

namespace {

struct GradReady : torch::autograd::PostAccumulateGradHook {
  GradReady(std::weak_ptr<ChunkManager> m, int c, size_t k) : m_(std::move(m)), c_(c), k_(k) {}
  void operator()(const torch::autograd::Variable&) override {
    if (auto m = m_.lock()) m->on_grad(c_, k_);
  }
  std::weak_ptr<ChunkManager> m_;
  int c_;
  size_t k_;
};

}  // namespace

std::vector<nn::HookHandle> install_hooks(torch::nn::Module& model,
                                          const std::shared_ptr<ChunkManager>& manager) {
  std::map<nn::Module*, std::vector<std::pair<int, size_t>>> covered;
  std::vector<nn::Module*> order;
  std::map<const void*, std::pair<int, size_t>> where;
  for (size_t i = 0; i < manager->num_chunks(); ++i) {
    auto& ts = manager->chunk(i).tensors();
    for (size_t k = 0; k < ts.size(); ++k)
      where[ts[k].param.unsafeGetTensorImpl()] = {static_cast<int>(i), k};
  }
  walk_params(model, [&](nn::Module* m, const std::string&, const at::Tensor& p) {
    auto it = where.find(p.unsafeGetTensorImpl());
    if (!m || it == where.end()) return;
    if (!covered.count(m)) order.push_back(m);
    covered[m].push_back(it->second);
  });
  // A tied head reads the embedding's weight inside the CausalLM's own scope.
  if (auto* lm = dynamic_cast<models::CausalLM*>(&model)) {
    if (lm->config().tie_word_embeddings && lm->model && lm->model->embed_tokens) {
      auto it = where.find(lm->model->embed_tokens->param("weight").unsafeGetTensorImpl());
      if (it != where.end()) covered[lm].push_back(it->second);
    }
  }
  std::vector<nn::HookHandle> handles;
  std::weak_ptr<ChunkManager> weak = manager;
  for (auto& [m, list] : covered) {
    std::sort(list.begin(), list.end());
    handles.push_back(m->add_forward_pre_hook([weak, list](nn::Module&) {
      if (auto mgr = weak.lock()) mgr->pre_forward(list);
    }));
    handles.push_back(m->add_forward_post_hook([weak, list](nn::Module&) {
      if (auto mgr = weak.lock()) mgr->post_forward(list);
    }));
  }
  for (size_t i = 0; i < manager->num_chunks(); ++i) {
    auto& ts = manager->chunk(i).tensors();
    for (size_t k = 0; k < ts.size(); ++k)
      if (ts[k].requires_grad)
        torch::autograd::impl::set_post_acc_grad_hooks(
            ts[k].param, std::make_unique<GradReady>(weak, static_cast<int>(i), k));
  }
  return handles;
}

}  // namespace colossal::zero::gemini
