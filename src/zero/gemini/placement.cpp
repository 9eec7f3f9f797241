// Gemini placement: where each chunk's parameter shard and optimizer data live -- the initial
// (static) rule, the auto policy's budgeted plan after warm-up, the moves between device and
// host -- and the memory accounting both policies and the memory report read.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/zero/gemini/chunk_manager.h"
#include "zero/gemini/manager_internal.h"

namespace colossal::zero::gemini {

using namespace detail;

namespace detail {

InitialPlace initial_place(const GeminiOptions& o, double s, double T, bool hooked) {
  const bool is_auto = o.placement_policy == "auto";
  InitialPlace p;
  p.sharded = hooked && (is_auto || s >= T * (1.0 - o.shard_param_frac) - 0.5);
  // auto starts on the host; its warm-up placement brings what fits to the device.
  p.optim = (is_auto || s < T * o.offload_optim_frac - 0.5) ? Place::Host : Place::Device;
  p.param = (!is_auto && p.sharded && s >= T * (1.0 - o.offload_param_frac) - 0.5 &&
             o.offload_param_frac > 0)
                ? Place::Host
                : Place::Device;
  return p;
}

}  // namespace detail

at::Device ChunkManager::place_device(const Chunk& c, Place p) const {
  return p == Place::Device ? c.device() : at::Device(at::kCPU);
}

at::Tensor ChunkManager::new_f32(const Chunk& c, Place p) const {
  if (p == Place::Host && pin_) return empty_pinned({c.shard_size()}, at::kFloat).zero_();
  return at::zeros({c.shard_size()},
                   at::TensorOptions().dtype(at::kFloat).device(place_device(c, p)));
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
    const int64_t grad_elem = at::elementSize(comm_dtype_.value_or(c.dtype()));
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

}  // namespace colossal::zero::gemini
