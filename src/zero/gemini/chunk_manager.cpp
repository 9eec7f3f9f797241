// Gemini chunk manager: chunk search and construction, placement (static / auto), forward and
// gradient hooks, per-chunk gradient reduction, HybridAdam on the shards, full-shape optimizer
// state, memory accounting.
#include "colossal/zero/gemini/chunk_manager.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>

#include "colossal/amp/grad_scaler.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/kernels/fused.h"
#include "colossal/models/llama/model.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/cpu_adam.h"

namespace colossal::zero::gemini {

namespace {

constexpr double kM = 1024.0 * 1024.0;

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

bool is_half(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf;
}

int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// One AdamW call of step(): the shards of one (group, step count) as tensor lists.
struct AdamKey {
  size_t group;
  int64_t step;
  bool operator<(const AdamKey& o) const {
    return std::tie(group, step) < std::tie(o.group, o.step);
  }
};
struct AdamLists {
  std::vector<at::Tensor> P, G, M, V, W;  // masters, gradients, moments, working (cast) out
};

}  // namespace

// The CPU Adam of the host chunks of one step, on its own thread: chunk by chunk in next-use
// order, each flag cleared once that chunk's masters, moments and working shard are written.
struct ChunkManager::HostUpdate {
  struct Call {
    optim::AdamWHyper hyper;
    int64_t step;
    AdamLists lists;
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
          for (Call& c : j.calls) {
            AdamLists& l = c.lists;
            optim::cpu_adam_update(l.P, l.G, l.M, l.V, c.step, c.hyper, divisor, l.W);
          }
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

// ---- chunk size search ----------------------------------------------------------------------

std::pair<int64_t, int64_t> pack(const std::vector<int64_t>& numels, int64_t size, int dp) {
  int64_t chunks = 0, wasted = 0, used = 0;
  bool open = false;
  for (int64_t n : numels) {
    if (n > size) {  // an oversize tensor gets a chunk of its own, rounded up to dp
      chunks += 1;
      wasted += round_up(n, dp) - n;
      continue;
    }
    if (!open || used + n > size) {
      if (open) wasted += size - used;
      chunks += 1;
      used = 0;
      open = true;
    }
    used += n;
  }
  if (open) wasted += size - used;
  return {chunks, wasted};
}

ChunkSearchResult search_chunk_size(const std::vector<int64_t>& numels, int dp,
                                    const ChunkSearchOptions& o) {
  COLOSSAL_CHECK_INPUT(o.search_range_m >= 0, "gemini: search_range_m must be >= 0, got ",
                       o.search_range_m);
  COLOSSAL_CHECK_INPUT(o.min_chunk_size_m > 0, "gemini: min_chunk_size_m must be > 0, got ",
                       o.min_chunk_size_m);
  COLOSSAL_CHECK_INPUT(o.hidden_dim >= 0, "gemini: hidden_dim must be >= 0, got ", o.hidden_dim);
  COLOSSAL_CHECK_INPUT(dp >= 1, "gemini: dp size must be >= 1, got ", dp);
  ChunkSearchResult r;
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  const int64_t min_size = std::max<int64_t>(1, static_cast<int64_t>(o.min_chunk_size_m * kM));
  if (numels.empty()) {
    r.chunk_size = round_up(1, dp);
    return r;
  }
  if (total <= min_size) {  // the whole model is one chunk
    r.chunk_size = round_up(total, dp);
    r.num_chunks = 1;
    r.wasted = r.chunk_size - total;
    r.candidates = 1;
    return r;
  }
  const int64_t interval = o.hidden_dim > 0 ? o.hidden_dim : 1024;
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  const int64_t start = round_up(std::max(min_size, largest), interval);
  const int64_t end = start + static_cast<int64_t>(o.search_range_m * kM);
  int64_t best_waste = -1;
  for (int64_t size = start; size <= end; size += interval) {
    const int64_t s = round_up(size, dp);
    auto [chunks, wasted] = pack(numels, s, dp);
    ++r.candidates;
    if (best_waste < 0 || wasted < best_waste) {
      best_waste = wasted;
      r.chunk_size = s;
      r.num_chunks = chunks;
      r.wasted = wasted;
    }
  }
  return r;
}

json::Value MemoryReport::to_json() const {
  json::Value j = json::Value::object();
  auto place = [&](const char* key, int64_t d, int64_t h) {
    json::Value v = json::Value::object();
    v.set("device", d);
    v.set("host", h);
    j.set(key, std::move(v));
  };
  place("params", param_device, param_host);
  place("grads", grad_device, grad_host);
  place("masters", master_device, master_host);
  place("optimizer_states", optim_device, optim_host);
  j.set("chunk_elements", chunk_elements);
  j.set("used_elements", used_elements);
  j.set("chunk_utilisation", chunk_elements > 0 ? static_cast<double>(used_elements) /
                                                      static_cast<double>(chunk_elements)
                                                : 0.0);
  j.set("num_chunks", num_chunks);
  j.set("sharded_chunks", sharded_chunks);
  j.set("gathered_chunks", gathered_chunks);
  j.set("peak_device", peak_device);
  json::Value t = json::Value::object();
  t.set("host_to_device", host_to_device);
  t.set("device_to_host", device_to_host);
  j.set("traffic", std::move(t));
  return j;
}

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

  ChunkSearchResult sr = search_chunk_size(numels, world_, o.search);
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

  // Static placement by position in chunk memory (ColossalAI's rule): the last shard_param_frac
  // is sharded, the first offload_optim_frac keeps its optimizer data on the host, the last
  // offload_param_frac of the sharded chunks keeps its parameter shard on the host. auto shards
  // every chunk and decides places from a memory budget.
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
    const bool sharded = g.hooked && (is_auto || s >= T * (1.0 - o.shard_param_frac) - 0.5);
    // Every chunk is rounded to a multiple of dp (the search does it; oversize ones above).
    auto chunk =
        std::make_unique<Chunk>(static_cast<int>(ci), pl.size, g.dtype, device_, sharded, comm_);
    for (size_t k : pl.members) chunk->append(g.params[k].first, g.params[k].second);
    chunk->set_mover(mover_);
    OptimChunk oc;
    // auto starts on the host; its warm-up placement below brings what fits to the device.
    oc.place = (is_auto || s < T * o.offload_optim_frac - 0.5) ? Place::Host : Place::Device;
    param_place.push_back((!is_auto && sharded && s >= T * (1.0 - o.offload_param_frac) - 0.5 &&
                           o.offload_param_frac > 0)
                              ? Place::Host
                              : Place::Device);
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

at::Device ChunkManager::place_device(const Chunk& c, Place p) const {
  return p == Place::Device ? c.device() : at::Device(at::kCPU);
}

at::Tensor ChunkManager::new_f32(const Chunk& c, Place p) const {
  if (p == Place::Host && pin_) return empty_pinned({c.shard_size()}, at::kFloat).zero_();
  return at::zeros({c.shard_size()},
                   at::TensorOptions().dtype(at::kFloat).device(place_device(c, p)));
}

void ChunkManager::finish_updates() {
  if (!host_update_) return;
  std::unique_ptr<HostUpdate> hu = std::move(host_update_);
  hu->thread.join();
  if (hu->error) std::rethrow_exception(hu->error);
}

bool ChunkManager::update_pending(size_t c) const {
  if (!host_update_) return false;
  std::lock_guard<std::mutex> lk(host_update_->mu);
  return host_update_->pending[c] != 0 && !host_update_->error;
}

void ChunkManager::wait_update(size_t c) {
  if (!host_update_) return;
  HostUpdate& hu = *host_update_;
  bool failed = false;
  {
    std::unique_lock<std::mutex> lk(hu.mu);
    hu.cv.wait(lk, [&] { return hu.pending[c] == 0 || hu.error; });
    failed = hu.error != nullptr;
  }
  if (failed) finish_updates();  // joins and rethrows the update's error
}

void ChunkManager::move_optim(size_t ci, Place to) {
  finish_updates();
  OptimChunk& oc = optim_[ci];
  if (oc.place == to) return;
  oc.place = to;
  const at::Device d = place_device(*chunks_[ci], to);
  int64_t moved = 0;
  for (at::Tensor* t : {&oc.master, &oc.grad, &oc.exp_avg, &oc.exp_avg_sq}) moved += bytes_of(*t);
  (to == Place::Host ? d2h_bytes_ : h2d_bytes_) += moved;
  for (at::Tensor* t : {&oc.master, &oc.grad, &oc.exp_avg, &oc.exp_avg_sq}) {
    if (!t->defined()) continue;
    *t = to == Place::Host && pin_ ? to_pinned(*t) : t->to(d);
  }
  oc.host_working = at::Tensor();
  oc.host_grad = at::Tensor();
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
  in_flight_.push_back({c, ch.reduce_grad_async(options_.communication_dtype)});
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
          // One pass over the reduced gradient on the device (microseconds per chunk) instead
          // of one over the host copy on the CPU in grad_norm (seconds at 13b).
          oc.grad_sq = amp::sum_of_squares({part});
          if (mover_) {
            mover_->copy(oc.grad, part);  // read on the host after finish_reduces(0)
          } else {
            oc.grad.copy_(part);
          }
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
  for (auto& c : chunks_) c->start_gather();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i]->releasable() && !chunks_[i]->gathered()) external_[i] = 1;
    if (chunks_[i]->gather_in_flight()) external_[i] = 1;
    chunks_[i]->wait_gather();
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

// ---- accounting -------------------------------------------------------------------------------

int64_t ChunkManager::device_bytes() const {
  MemoryReport r = memory_report(/*device_stats=*/false);
  return r.param_device + r.grad_device + r.master_device + r.optim_device;
}

void ChunkManager::update_peak() {
  int64_t transient = 0;
  for (auto& c : chunks_)
    transient +=
        c->full_bytes() +
        (c->has_grad_buffer() ? c->size() * static_cast<int64_t>(c10::elementSize(c->dtype())) : 0);
  transient_peak_ = std::max(transient_peak_, transient);
  peak_device_ = std::max(peak_device_, device_bytes());
}

MemoryReport ChunkManager::memory_report(bool device_stats) const {
  MemoryReport r;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = *chunks_[i];
    const OptimChunk& oc = optim_[i];
    const bool replicated = !(c.sharded() && c.shards() > 1);
    const bool pdev = !c.releasable() || c.param_place() == Place::Device;
    (pdev ? r.param_device : r.param_host) += c.shard_bytes();
    r.param_device += c.full_bytes();
    if (c.has_grad_buffer())
      r.grad_device += c.size() * static_cast<int64_t>(c10::elementSize(c.dtype()));
    const bool odev = oc.place == Place::Device;
    (odev ? r.grad_device : r.grad_host) += bytes_of(oc.grad);
    (odev ? r.master_device : r.master_host) += bytes_of(oc.master);
    (odev ? r.optim_device : r.optim_host) += bytes_of(oc.exp_avg) + bytes_of(oc.exp_avg_sq);
    if (oc.host_working.defined()) r.param_host += bytes_of(oc.host_working);
    if (oc.host_grad.defined() && !oc.host_grad.is_same(oc.grad))
      r.grad_host += bytes_of(oc.host_grad);
    r.chunk_elements += c.size();
    r.used_elements += c.used();
    r.num_chunks += 1;
    r.sharded_chunks += replicated ? 0 : 1;
    r.gathered_chunks += (c.releasable() && c.gathered()) ? 1 : 0;
  }
  r.peak_device = peak_device_;
  r.host_to_device = h2d_bytes_;
  r.device_to_host = d2h_bytes_;
  for (const auto& c : chunks_) {
    r.host_to_device += c->h2d_bytes();
    r.device_to_host += c->d2h_bytes();
  }
  if (device_stats && device_.is_cuda())
    r.peak_device = std::max(r.peak_device, Accelerator::cuda().memory_stats().peak_allocated);
  return r;
}

// auto: the device budget is capacity * ratio minus the non-model memory seen in warm-up (CUDA:
// peak allocated minus the model data's own peak; CPU: none measurable). Chunks are placed on
// the device in compute order while they fit; the rest (furthest from their next use, which
// after a step is the next forward in compute order) keep their parameter shard and optimizer
// data on the host. In warm-up (no order, no measurement yet) the budget is
// capacity * (1 - warmup_non_model_data_ratio) in chunk order.
void ChunkManager::auto_place(bool warmup) {
  double capacity = options_.device_capacity_mb * kM;
  if (capacity <= 0) {
    if (device_.is_cuda()) {
      for (auto& d : cuda_devices())
        if (d.index == device_.index() || (device_.index() < 0 && d.index == 0))
          capacity = static_cast<double>(d.total_memory);
    } else {
      capacity = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                 static_cast<double>(::sysconf(_SC_PAGESIZE));
    }
  }
  int64_t non_model = 0;
  if (!warmup && device_.is_cuda())
    non_model =
        std::max<int64_t>(0, Accelerator::cuda().memory_stats().peak_allocated - peak_device_);
  double budget = warmup
                      ? capacity * (1.0 - options_.warmup_non_model_data_ratio)
                      : capacity * options_.steady_cuda_cap_ratio - static_cast<double>(non_model);
  std::vector<int> order = order_;
  for (size_t i = 0; i < chunks_.size(); ++i)
    if (order_pos_[i] < 0) order.push_back(static_cast<int>(i));  // never accessed: last
  // A replicated chunk (shard_param_frac < 1, or no hook to gather it) computes in its own
  // buffer: its parameters are on the device whatever the plan, so they are charged up front and
  // only its optimizer data can move.
  auto movable_params = [&](size_t i) { return chunks_[i]->sharded(); };
  // The gradient shard is kept in the reduce's dtype (fp32 only when micro-steps accumulate).
  auto need = [&](size_t i) {
    const Chunk& c = *chunks_[i];
    int64_t b = movable_params(i) ? c.shard_bytes() : 0;
    const int64_t grad_elem = at::elementSize(options_.communication_dtype.value_or(c.dtype()));
    if (optim_[i].master.defined())
      b += (12 + grad_elem) * c.shard_size();  // master, moments, grad
    return b;
  };
  const double ram =
      static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  const double host_cap =
      options_.host_capacity_mb > 0 ? options_.host_capacity_mb * kM : 0.85 * ram;
  double used = static_cast<double>(transient_peak_);
  if (warmup)
    used = static_cast<double>(chunk_size_) * 4.0 * 2.0;  // one gathered chunk + its grads, roughly
  for (size_t i = 0; i < chunks_.size(); ++i)
    if (!movable_params(i)) used += static_cast<double>(chunks_[i]->shard_bytes());
  const double fixed = used;
  double total = 0;
  for (int c : order) total += static_cast<double>(need(static_cast<size_t>(c)));
  // What the host cannot hold must be on the device, warm-up or not; a model that fits neither
  // side is refused before anything is allocated.
  const double steady = capacity * options_.steady_cuda_cap_ratio;
  const double forced = fixed + total - host_cap;
  COLOSSAL_CHECK_INPUT(
      forced <= steady, "gemini auto placement: the chunks need ", static_cast<int64_t>(total),
      " bytes (parameter shards, fp32 masters, moments, gradients) plus ",
      static_cast<int64_t>(fixed), " of gathered buffers, more than the device budget ",
      static_cast<int64_t>(steady), " (capacity x steady_cuda_cap_ratio) and the host's ",
      static_cast<int64_t>(host_cap), " (host_capacity_mb; default 85 % of RAM) together: use ",
      "more ranks, a smaller model or more host memory");
  // In warm-up a chunk the host cannot take goes to the device while the steady budget allows.
  const double hard = warmup ? std::max(budget, steady) : budget;
  int64_t on_device = 0, on_host = 0;
  double host_bytes = 0;
  std::vector<std::pair<size_t, Place>> plan;
  for (int c : order) {
    const size_t i = static_cast<size_t>(c);
    const double b = static_cast<double>(need(i));
    const bool fits = used + b <= budget || (host_bytes + b > host_cap && used + b <= hard);
    const Place p = fits ? Place::Device : Place::Host;
    (p == Place::Device ? used : host_bytes) += b;
    plan.emplace_back(i, p);
    (p == Place::Device ? on_device : on_host) += 1;
  }
  // The host side must fit too (this rank's share when ranks share the host is not known here;
  // the check catches plans that cannot fit at all), checked before anything moves.
  COLOSSAL_CHECK_INPUT(host_bytes <= host_cap,
                       "gemini auto placement: ", static_cast<int64_t>(host_bytes),
                       " bytes of chunk data would go to the host, ", "more than its ",
                       static_cast<int64_t>(host_cap),
                       " (host_capacity_mb; default 85 % of RAM), with the device budget ",
                       static_cast<int64_t>(budget), " full: use more ranks or a smaller model");
  const auto t_moves = std::chrono::steady_clock::now();
  // Device-bound chunks last: what leaves the device first makes room for what arrives.
  for (const Place want : {Place::Host, Place::Device})
    for (auto [i, p] : plan) {
      if (p != want) continue;
      chunks_[i]->move_param_shard(p);
      if (optim_[i].master.defined()) move_optim(i, p);
    }
  if (!warmup) {
    COLOSSAL_CHECK_INPUT(
        fixed <= budget, "gemini auto placement: the gathered chunks and gradient buffers (",
        transient_peak_, " bytes) and the parameters of unsharded chunks need ",
        static_cast<int64_t>(fixed), " bytes of device memory, more than the budget ",
        static_cast<int64_t>(budget), " (capacity ", static_cast<int64_t>(capacity),
        " x steady_cuda_cap_ratio ", options_.steady_cuda_cap_ratio, " - non-model ", non_model,
        "); use smaller chunks, more ranks or activation checkpointing");
    warmed_up_ = true;
  }
  if (rank_ == 0)
    log_info("gemini auto placement (", warmup ? "warm-up" : "after warm-up", "): budget ",
             static_cast<int64_t>(budget), " bytes, non-model ", non_model, ", transient ",
             transient_peak_, "; ", on_device, " chunks on the device, ", on_host, " on the host (",
             static_cast<int64_t>(host_bytes), " bytes); moved in ",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t_moves).count(),
             " s");
}

// ---- optimizer ----------------------------------------------------------------------------------

void ChunkManager::bind_optimizer(std::shared_ptr<optim::Optimizer> inner) {
  COLOSSAL_CHECK(inner, "gemini: optimizer is null");
  COLOSSAL_CHECK_INPUT(std::string(inner->type()) == "adamw",
                       "the gemini plugin updates chunks with AdamW "
                       "(HybridAdam) only; got a '",
                       inner->type(), "' optimizer");
  auto& groups = inner->param_groups();
  for (size_t gi = 0; gi < groups.size(); ++gi)
    for (size_t k = 0; k < groups[gi].params.size(); ++k) {
      auto it = where_.find(groups[gi].params[k].unsafeGetTensorImpl());
      COLOSSAL_CHECK_INPUT(it != where_.end(), "optimizer parameter '", groups[gi].names[k],
                           "' is not a parameter of the boosted model");
      auto [c, t] = it->second;
      COLOSSAL_CHECK_INPUT(chunks_[static_cast<size_t>(c)]->tensors()[t].requires_grad,
                           "optimizer parameter '", groups[gi].names[k], "' does not require grad");
      COLOSSAL_CHECK_INPUT(
          chunks_[static_cast<size_t>(c)]->tensors()[t].name == groups[gi].names[k],
          "optimizer parameter '", groups[gi].names[k], "' is the model's '",
          chunks_[static_cast<size_t>(c)]->tensors()[t].name,
          "': name the optimizer's parameters as the model does (checkpoints are by name)");
      info_[static_cast<size_t>(c)][t].group = static_cast<int64_t>(gi);
    }
  inner_ = std::move(inner);
}

double ChunkManager::grad_norm(double scale) {
  finish_reduces(0);
  std::vector<at::Tensor> grads, sums;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = *chunks_[i];
    const OptimChunk& oc = optim_[i];
    if (!oc.grad.defined()) continue;
    // A replicated chunk's gradient is the same on every rank: rank 0 counts it.
    if (!(c.sharded() && c.shards() > 1) && rank_ != 0) continue;
    if (oc.grad_sq.defined())
      sums.push_back(oc.grad_sq);
    else
      grads.push_back(oc.grad);
  }
  amp::GradReducer reducer;
  if (world_ > 1) {
    dist::Communicator c = comm_;
    at::Device dev = device_;
    reducer.all_reduce_sum = [c, dev](at::Tensor& t) mutable {
      at::Tensor d = t.to(dev);
      c.all_reduce(d, dist::ReduceOp::Sum);
      t.copy_(d);
    };
    reducer.all_reduce_max = [c, dev](at::Tensor& t) mutable {
      at::Tensor d = t.to(dev);
      c.all_reduce(d, dist::ReduceOp::Max);
      t.copy_(d);
    };
  }
  return amp::global_grad_norm(grads, scale, reducer, sums);
}

void ChunkManager::step(double divisor) {
  COLOSSAL_CHECK(inner_, "gemini: step() without an optimizer");
  finish_updates();
  finish_reduces(0);
  release_all(true);  // gathered copies would be stale after the update
  if (options_.placement_policy == "auto" && !warmed_up_) {
    order_frozen_ = true;
    auto_place(/*warmup=*/false);
  }
  order_frozen_ = true;
  c10::NoGradGuard no_grad;
  auto& groups = inner_->param_groups();
  std::map<AdamKey, AdamLists> on_device, on_host;  // updated here
  // Chunks whose update may run beside the next forward: optimizer data and parameter shard on
  // the host, the shard released between steps (so nothing reads it except through an access,
  // which waits). Keyed by chunk.
  std::map<size_t, std::map<AdamKey, AdamLists>> deferred;
  std::vector<std::pair<at::Tensor, at::Tensor>>
      copies;  // (dst working shard, src) after the update
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = *chunks_[i];
    OptimChunk& oc = optim_[i];
    if (!oc.master.defined()) continue;
    bool any = false;
    for (auto& ti : info_[i]) any = any || (ti.group >= 0 && ti.had_grad);
    if (!any) continue;
    if (!oc.exp_avg.defined()) {
      oc.exp_avg = new_f32(*chunks_[i], oc.place);
      oc.exp_avg_sq = new_f32(*chunks_[i], oc.place);
    }
    const bool host = oc.place == Place::Host;
    bool defer = false;
    // Where the CPU Adam writes the cast weights: straight into a host parameter shard, else a
    // host staging buffer copied to the device shard afterwards.
    at::Tensor out;
    if (host) {
      const bool param_on_host = c.releasable() && c.param_place() == Place::Host;
      if (!param_on_host) h2d_bytes_ += c.shard_bytes();  // the updated weights go up
      if (c.shard().device().is_cpu()) {
        out = c.shard();
        defer = options_.overlap_cpu_adam && c.releasable() && !c.gathered();
      } else {
        if (!oc.host_working.defined())
          oc.host_working = host_empty({c.shard_size()}, c.dtype(), pin_);
        out = oc.host_working;
        copies.emplace_back(c.shard(), out);
      }
    } else if (c.shard().device() != oc.master.device()) {
      // Optimizer data on the device, parameter shard on the host (static offload_param_frac
      // beyond offload_optim_frac): the fused kernel writes a device staging shard, copied down.
      out = at::empty({c.shard_size()}, oc.master.options().dtype(c.dtype()));
      d2h_bytes_ += c.shard_bytes();
      copies.emplace_back(c.shard(), out);
    }
    for (size_t k = 0; k < c.tensors().size(); ++k) {
      TensorInfo& ti = info_[i][k];
      if (ti.group < 0 || !ti.had_grad) continue;
      ti.step += 1;
      auto [a, b] = own_range(c, c.tensors()[k]);
      if (a >= b) continue;
      const int64_t s = a - c.shard_begin(), n = b - a;
      const AdamKey key{static_cast<size_t>(ti.group), ti.step};
      AdamLists& l = defer ? deferred[i][key] : host ? on_host[key] : on_device[key];
      l.P.push_back(oc.master.narrow(0, s, n));
      l.G.push_back(oc.grad.narrow(0, s, n));
      l.M.push_back(oc.exp_avg.narrow(0, s, n));
      l.V.push_back(oc.exp_avg_sq.narrow(0, s, n));
      l.W.push_back(out.defined() ? out.narrow(0, s, n) : c.shard().narrow(0, s, n));
    }
  }
  auto hyper = [&](size_t group) {
    const optim::GroupOptions& g = groups[group].options;
    return optim::AdamWHyper{g.lr, g.beta1, g.beta2, g.eps, g.weight_decay};
  };
  // Device chunks first (the fused kernels are queued and run while the host works).
  for (auto& [key, l] : on_device) {
    const optim::AdamWHyper h = hyper(key.group);
    // One multi-tensor pass: master update and the cast into the working shard.
    kernels::AdamWStep k{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, key.step, divisor};
    kernels::fused_adamw(l.P, l.G, l.M, l.V, l.W, k);
  }
  for (auto& [key, l] : on_host)
    optim::cpu_adam_update(l.P, l.G, l.M, l.V, key.step, hyper(key.group), divisor, l.W);
  // Up (pinned host -> device) without a host wait: later device work is stream-ordered after
  // it. Down (device -> host) blocking: the host shard may be read by the CPU (a checkpoint).
  for (auto& [dst, src] : copies) dst.copy_(src, /*non_blocking=*/pin_ && src.is_cpu());
  deferred_updates_ = static_cast<int64_t>(deferred.size());
  if (!deferred.empty()) {
    // In the order the next forward meets them (chunks never accessed last).
    std::vector<size_t> ids;
    for (auto& [i, lists] : deferred) ids.push_back(i);
    auto pos = [&](size_t i) {
      return order_pos_[i] < 0 ? std::numeric_limits<int>::max() : order_pos_[i];
    };
    std::stable_sort(ids.begin(), ids.end(), [&](size_t a, size_t b) { return pos(a) < pos(b); });
    std::vector<HostUpdate::Job> jobs;
    for (size_t i : ids) {
      HostUpdate::Job j{i, {}};
      for (auto& [key, l] : deferred[i])
        j.calls.push_back({hyper(key.group), key.step, std::move(l)});
      jobs.push_back(std::move(j));
    }
    host_update_ = std::make_unique<HostUpdate>();
    host_update_->pending.assign(chunks_.size(), 0);
    for (size_t i : ids) host_update_->pending[i] = 1;
    host_update_->run(std::move(jobs), divisor);
  }
  zero_grad();
  update_peak();
}

void ChunkManager::zero_grad() {
  finish_reduces(0);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    optim_[i].grad = at::Tensor();  // gradient shards live from the reduce to the step
    optim_[i].grad_sq = at::Tensor();
    for (auto& ti : info_[i]) ti.had_grad = false;
    for (auto& t : chunks_[i]->tensors())
      if (t.param.grad().defined()) t.param.mutable_grad() = at::Tensor();
  }
}

at::Tensor ChunkManager::gather_f32(size_t i, const at::Tensor& shard) {
  const Chunk& c = *chunks_[i];
  at::Tensor local = shard.to(device_, at::kFloat).contiguous();
  if (c.shards() == 1) return local;
  at::Tensor out = at::empty({c.size()}, local.options());
  comm_.all_gather(out, local);
  return out;
}

optim::StateDict ChunkManager::state_dict() {
  COLOSSAL_CHECK(inner_, "gemini: state_dict() without an optimizer");
  finish_updates();
  optim::StateDict out = inner_->state_dict();  // groups and hyper-parameters; no state of its own
  out.tensors.clear();
  json::Value steps = json::Value::object();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = *chunks_[i];
    OptimChunk& oc = optim_[i];
    if (!oc.master.defined()) continue;
    // Collective per chunk, in chunk order, on every rank.
    at::Tensor master = gather_f32(i, oc.master).to(at::kCPU);
    at::Tensor ea, eas;
    if (oc.exp_avg.defined()) {
      ea = gather_f32(i, oc.exp_avg).to(at::kCPU);
      eas = gather_f32(i, oc.exp_avg_sq).to(at::kCPU);
    }
    for (size_t k = 0; k < c.tensors().size(); ++k) {
      const ChunkTensor& t = c.tensors()[k];
      const TensorInfo& ti = info_[i][k];
      if (ti.group < 0) continue;
      auto view = [&](const at::Tensor& full) {
        return full.narrow(0, t.offset, t.numel).view(t.param.sizes()).clone();
      };
      if (ti.step > 0) {
        steps.set(t.name, ti.step);
        out.tensors.emplace_back(t.name + ".exp_avg", view(ea));
        out.tensors.emplace_back(t.name + ".exp_avg_sq", view(eas));
      }
      if (is_half(c.dtype())) out.tensors.emplace_back(t.name + ".master", view(master));
    }
  }
  out.scalars.set("steps", std::move(steps));
  return out;
}

void ChunkManager::load_state_dict(const optim::StateDict& sd) {
  COLOSSAL_CHECK(inner_, "gemini: load_state_dict() without an optimizer");
  finish_updates();
  release_all(true);  // parameters written from outside (a model load) reach the shards first
  c10::NoGradGuard no_grad;
  const json::Value& s = sd.scalars;
  std::vector<optim::GroupOptions> opts = optim::read_state_groups(sd, *inner_);
  auto& groups = inner_->param_groups();
  std::map<std::string, const at::Tensor*> by_name;
  for (auto& [n, t] : sd.tensors) by_name[n] = &t;
  const json::Value& steps = s.at("steps");
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = *chunks_[i];
    OptimChunk& oc = optim_[i];
    if (!oc.master.defined()) continue;
    for (size_t k = 0; k < c.tensors().size(); ++k) {
      const ChunkTensor& t = c.tensors()[k];
      TensorInfo& ti = info_[i][k];
      if (ti.group < 0) continue;
      auto full = [&](const std::string& key) -> const at::Tensor* {
        auto it = by_name.find(t.name + "." + key);
        if (it == by_name.end()) return nullptr;
        COLOSSAL_CHECK_INPUT(it->second->sizes() == t.param.sizes(), "optimizer state tensor '",
                             t.name, ".", key, "' has shape ", it->second->sizes(),
                             " but parameter '", t.name, "' needs ", t.param.sizes());
        return it->second;
      };
      auto [a, b] = own_range(c, t);
      const int64_t s0 = a - c.shard_begin(), n = b - a;
      auto own = [&](const at::Tensor& f) { return f.reshape({-1}).narrow(0, a - t.offset, n); };
      const at::Tensor* m = is_half(c.dtype()) ? full("master") : nullptr;
      if (n > 0) {
        if (m) {
          oc.master.narrow(0, s0, n).copy_(own(*m));
          c.shard().narrow(0, s0, n).copy_(own(*m));  // working weights follow their masters
        } else {
          oc.master.narrow(0, s0, n).copy_(c.shard().narrow(0, s0, n));
        }
      }
      const json::Value* st = steps.find(t.name);
      ti.step = st ? st->as_int("steps." + t.name) : 0;
      if (!st) continue;
      const at::Tensor* ea = full("exp_avg");
      const at::Tensor* eas = full("exp_avg_sq");
      COLOSSAL_CHECK_INPUT(ea && eas, "optimizer state lacks tensor '", t.name, ".",
                           ea ? "exp_avg_sq" : "exp_avg", "'");
      if (!oc.exp_avg.defined()) {
        oc.exp_avg = new_f32(*chunks_[i], oc.place);
        oc.exp_avg_sq = new_f32(*chunks_[i], oc.place);
      }
      if (n > 0) {
        oc.exp_avg.narrow(0, s0, n).copy_(own(*ea));
        oc.exp_avg_sq.narrow(0, s0, n).copy_(own(*eas));
      }
    }
  }
  for (size_t gi = 0; gi < groups.size(); ++gi) groups[gi].options = opts[gi];
}

void ChunkManager::sync_masters_from_params() {
  finish_updates();
  release_all(true);
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < chunks_.size(); ++i)
    if (optim_[i].master.defined()) optim_[i].master.copy_(chunks_[i]->shard());
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
