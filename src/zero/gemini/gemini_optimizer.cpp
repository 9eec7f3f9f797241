// Gemini's optimizer side of the ChunkManager: binding the user's AdamW, the global norm through
// the injected reducer, HybridAdam on the chunk shards (fused AdamW on device chunks, CPU Adam
// on host chunks, deferred to a background thread beside the next forward), and the full-shape
// optimizer state dict.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <limits>
#include <map>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/zero/gemini/chunk_manager.h"
#include "zero/gemini/manager_internal.h"

namespace colossal::zero::gemini {

using namespace detail;

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
  ShardedNorm norm(reducer_);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = *chunks_[i];
    const OptimChunk& oc = optim_[i];
    if (!oc.grad.defined()) continue;
    // A replicated chunk's gradient is the same on every rank: rank 0 counts it.
    if (!(c.sharded() && c.shards() > 1) && rank_ != 0) continue;
    bool per_tensor = false;  // some parameter of the chunk is replicated over another axis
    if (replicated_)
      for (const ChunkTensor& t : c.tensors())
        per_tensor = per_tensor || !replicated_(t.name).empty();
    if (!per_tensor) {
      norm.add(oc.grad, oc.grad_sq);
      continue;
    }
    for (const ChunkTensor& t : c.tensors()) {
      auto [a, b] = own_range(c, t);
      if (a < b) norm.add(oc.grad.narrow(0, a - c.shard_begin(), b - a), {}, replicated_(t.name));
    }
  }
  return norm.global(scale);
}

void ChunkManager::set_norm_reducer(amp::GradReducer reducer, ReplicatedAxes replicated_over) {
  reducer_ = std::move(reducer);
  replicated_ = std::move(replicated_over);
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
  std::map<AdamWKey, AdamWBatch> on_device, on_host;  // updated here
  // Chunks whose update may run beside the next forward: optimizer data and parameter shard on
  // the host, the shard released between steps (so nothing reads it except through an access,
  // which waits). Keyed by chunk.
  std::map<size_t, std::map<AdamWKey, AdamWBatch>> deferred;
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
      const AdamWKey key{static_cast<size_t>(ti.group), ti.step};
      AdamWBatch& l = defer ? deferred[i][key] : host ? on_host[key] : on_device[key];
      l.add(oc.master.narrow(0, s, n), oc.grad.narrow(0, s, n), oc.exp_avg.narrow(0, s, n),
            oc.exp_avg_sq.narrow(0, s, n),
            out.defined() ? out.narrow(0, s, n) : c.shard().narrow(0, s, n));
    }
  }
  auto hyper = [&](size_t group) { return hyper_of(groups[group].options); };
  // Device chunks first (the fused kernels are queued and run while the host works): one
  // multi-tensor pass, master update and the cast into the working shard.
  for (auto& [key, l] : on_device) l.run(AdamWPath::Fused, hyper(key.group), key.step, divisor);
  for (auto& [key, l] : on_host) l.run(AdamWPath::Host, hyper(key.group), key.step, divisor);
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

std::vector<checkpoint::TensorDecl> ChunkManager::state_plan(json::Value* scalars) {
  COLOSSAL_CHECK(inner_, "gemini: state_plan() without an optimizer");
  finish_updates();
  optim::StateDict out = inner_->state_dict();  // groups only (see state_dict())
  json::Value steps = json::Value::object();
  std::vector<checkpoint::TensorDecl> decls;
  plan_.clear();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = *chunks_[i];
    const OptimChunk& oc = optim_[i];
    if (!oc.master.defined()) continue;
    for (size_t k = 0; k < c.tensors().size(); ++k) {
      const ChunkTensor& t = c.tensors()[k];
      const TensorInfo& ti = info_[i][k];
      if (ti.group < 0) continue;
      auto add = [&](const char* key, int which) {
        decls.push_back({t.name + "." + key, at::kFloat, t.param.sizes().vec()});
        plan_.push_back({i, k, which});
      };
      if (ti.step > 0) {
        steps.set(t.name, ti.step);
        add("exp_avg", 1);
        add("exp_avg_sq", 2);
      }
      if (is_half(c.dtype())) add("master", 0);
    }
  }
  out.scalars.set("steps", std::move(steps));
  if (scalars) *scalars = std::move(out.scalars);
  return decls;
}

at::Tensor ChunkManager::gather_state(size_t k, int dst) {
  COLOSSAL_CHECK(k < plan_.size(), "gather_state: tensor ", k, " of a plan of ", plan_.size());
  const PlanEntry e = plan_[k];
  const Chunk& c = *chunks_[e.chunk];
  const OptimChunk& oc = optim_[e.chunk];
  const ChunkTensor& t = c.tensors()[e.tensor];
  const at::Tensor& shard = e.which == 0 ? oc.master : e.which == 1 ? oc.exp_avg : oc.exp_avg_sq;
  COLOSSAL_CHECK(shard.defined(), "gather_state: ", t.name, " has no state buffer ", e.which);
  if (c.shards() == 1) {  // replicated: every rank holds the whole tensor
    if (rank_ != dst) return at::Tensor();
    return shard.narrow(0, t.offset, t.numel).to(at::kFloat).view(t.param.sizes());
  }
  // The part of the tensor rank r's shard holds, in chunk coordinates.
  const int64_t S = c.shard_size();
  auto part = [&](int r) {
    const int64_t a = std::max(t.offset, S * r);
    const int64_t b = std::min(t.offset + t.numel, S * (r + 1));
    return std::pair<int64_t, int64_t>(a, std::max(a, b));
  };
  // Point to point from each rank, not an all-gather: only the writer holds the full tensor.
  if (rank_ != dst) {
    auto [a, b] = part(rank_);
    if (a < b)
      comm_.send(shard.narrow(0, a - S * rank_, b - a).to(device_, at::kFloat).contiguous(), dst);
    return at::Tensor();
  }
  at::Tensor out = at::empty({t.numel}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (int r = 0; r < world_; ++r) {
    auto [a, b] = part(r);
    if (a >= b) continue;
    at::Tensor view = out.narrow(0, a - t.offset, b - a);
    if (r == rank_)
      view.copy_(shard.narrow(0, a - S * r, b - a));
    else
      comm_.recv(view, r);
  }
  return out.view(t.param.sizes());
}

void ChunkManager::load_state_dict(const optim::StateDict& sd) {
  load_state(optim::StateDictSource(sd));
}

void ChunkManager::load_state(const optim::StateSource& src) {
  COLOSSAL_CHECK(inner_, "gemini: load_state_dict() without an optimizer");
  finish_updates();
  release_all(true);  // parameters written from outside (a model load) reach the shards first
  c10::NoGradGuard no_grad;
  optim::StateDict header;
  header.scalars = src.scalars();
  std::vector<optim::GroupOptions> opts = optim::read_state_groups(header, *inner_);
  auto& groups = inner_->param_groups();
  const json::Value& steps = header.scalars.at("steps");
  auto has = [&](const ChunkTensor& t, const std::string& key) {
    std::vector<int64_t> shape;
    if (!src.find(t.name + "." + key, &shape)) return false;
    COLOSSAL_CHECK_INPUT(at::IntArrayRef(shape) == t.param.sizes(), "optimizer state tensor '",
                         t.name, ".", key, "' has shape ", at::IntArrayRef(shape),
                         " but parameter '", t.name, "' needs ", t.param.sizes());
    return true;
  };
  // Every name and shape first: nothing changes unless the whole state fits.
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (!optim_[i].master.defined()) continue;
    for (size_t k = 0; k < chunks_[i]->tensors().size(); ++k) {
      const ChunkTensor& t = chunks_[i]->tensors()[k];
      if (info_[i][k].group < 0) continue;
      if (is_half(chunks_[i]->dtype())) has(t, "master");
      const json::Value* st = steps.find(t.name);
      if (!st) continue;
      st->as_int("steps." + t.name);
      const bool ea = has(t, "exp_avg"), eas = has(t, "exp_avg_sq");
      COLOSSAL_CHECK_INPUT(ea && eas, "optimizer state lacks tensor '", t.name, ".",
                           ea ? "exp_avg_sq" : "exp_avg", "'");
    }
  }
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = *chunks_[i];
    OptimChunk& oc = optim_[i];
    if (!oc.master.defined()) continue;
    for (size_t k = 0; k < c.tensors().size(); ++k) {
      const ChunkTensor& t = c.tensors()[k];
      TensorInfo& ti = info_[i][k];
      if (ti.group < 0) continue;
      auto [a, b] = own_range(c, t);
      const int64_t s0 = a - c.shard_begin(), n = b - a;
      // This rank's elements of a full tensor of the source into a shard buffer.
      auto read_own = [&](const std::string& key, const at::Tensor& dst) {
        if (n > 0) src.read(t.name + "." + key, a - t.offset, dst.narrow(0, s0, n));
      };
      if (n > 0) {
        if (is_half(c.dtype()) && src.find(t.name + ".master", nullptr)) {
          read_own("master", oc.master);
          // Working weights follow their masters.
          c.shard().narrow(0, s0, n).copy_(oc.master.narrow(0, s0, n));
        } else {
          oc.master.narrow(0, s0, n).copy_(c.shard().narrow(0, s0, n));
        }
      }
      const json::Value* st = steps.find(t.name);
      ti.step = st ? st->as_int("steps." + t.name) : 0;
      if (!st) continue;
      if (!oc.exp_avg.defined()) {
        oc.exp_avg = new_f32(*chunks_[i], oc.place);
        oc.exp_avg_sq = new_f32(*chunks_[i], oc.place);
      }
      read_own("exp_avg", oc.exp_avg);
      read_own("exp_avg_sq", oc.exp_avg_sq);
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

}  // namespace colossal::zero::gemini
