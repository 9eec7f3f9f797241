// ZeRO-1/2 sharded optimizer state: partition, gradient intake, sharded AdamW, all-gather,
// full-shape checkpoints.
#include "colossal/zero/low_level_optim.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/dist/fp8_collectives.h"
#include "colossal/optim/adamw.h"
#include "colossal/zero/sharded_adamw.h"

namespace colossal::zero {

struct LowLevelZeroOptimizer::Gather {
  dist::Work work;
  at::Tensor local, gathered;  // kept alive until the gather is finished
  std::vector<size_t> params;
  int64_t cols = 0;
  bool done = false;
};

LowLevelZeroOptimizer::LowLevelZeroOptimizer(
    std::shared_ptr<optim::Optimizer> inner, dist::Communicator comm,
    const std::vector<std::pair<std::string, at::Tensor>>& masters, ZeroOptimizerOptions options)
    : inner_(std::move(inner)), comm_(std::move(comm)), options_(options) {
  COLOSSAL_CHECK(inner_, "LowLevelZeroOptimizer: optimizer is null");
  COLOSSAL_CHECK_INPUT(std::string(inner_->type()) == "adamw",
                       "the low_level_zero plugin updates sharded states with ",
                       "AdamW only; got a '", inner_->type(), "' optimizer");
  COLOSSAL_CHECK_INPUT(options_.allgather_bucket_numel > 0,
                       "ZeRO all-gather bucket size must be > 0");
  if (comm_.valid()) {
    world_ = comm_.size();
    rank_ = comm_.rank();
  }
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [n, t] : masters) by_name[n] = &t;
  c10::NoGradGuard no_grad;
  auto& groups = inner_->param_groups();
  for (size_t gi = 0; gi < groups.size(); ++gi)
    for (size_t k = 0; k < groups[gi].params.size(); ++k) {
      Param p;
      p.name = groups[gi].names[k];
      p.param = groups[gi].params[k];
      p.group = gi;
      params_.push_back(std::move(p));
    }
  if (!params_.empty()) {
    const at::Tensor& first = params_.front().param;
    shard_device_ = options_.cpu_offload ? at::Device(at::kCPU) : first.device();
    pin_ = options_.cpu_offload && first.is_cuda();
  }
  direct_ = world_ == 1 && !options_.cpu_offload;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = by_name.find(params_[i].name);
    const at::Tensor full = it != by_name.end() ? *it->second : params_[i].param.detach();
    COLOSSAL_CHECK(full.numel() == params_[i].param.numel(), "LowLevelZeroOptimizer: master of '",
                   params_[i].name, "' has ", full.numel(), " elements, the parameter ",
                   params_[i].param.numel());
    params_[i].master = slice_of(full, i);
    if (!direct_) params_[i].grad = new_shard(i);
  }
  gather_of_.assign(params_.size(), nullptr);
  deferrable_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) position_.push_back(static_cast<int64_t>(i));
  // The norm agrees over the sharding group by default; set_norm_reducer() widens it.
  reducer_ = amp::over(
      comm_, params_.empty() ? at::Device(at::kCPU) : params_.front().param.device(), "dp");
  log_debug("ZeRO: ", params_.size(), " parameters sharded over ", world_, " rank(s), ",
            state_bytes(), " optimizer bytes on this rank");
}

LowLevelZeroOptimizer::~LowLevelZeroOptimizer() {
  try {
    wait_all();  // never leave a collective writing into freed buffers
  } catch (const std::exception& e) {
    log_error("ZeRO: in-flight weight all-gather failed at shutdown: ", e.what());
  }
}

void LowLevelZeroOptimizer::set_gather_plan(std::vector<int64_t> position,
                                            std::vector<bool> deferrable) {
  COLOSSAL_CHECK(position.size() == params_.size() && deferrable.size() == params_.size(),
                 "ZeRO: gather plan for ", position.size(), "/", deferrable.size(),
                 " parameters, the optimizer holds ", params_.size());
  wait_all();
  position_ = std::move(position);
  deferrable_ = std::move(deferrable);
}

void LowLevelZeroOptimizer::finish_gather(Gather& g) {
  if (g.done) return;
  g.done = true;  // also on failure: the error is reported once, by the Work
  for (size_t i : g.params) gather_of_[i] = nullptr;
  g.work.wait();
  c10::NoGradGuard no_grad;
  at::Tensor gathered = g.gathered.view({world_, g.cols});
  int64_t off = 0;
  for (size_t i : g.params) {
    at::Tensor& p = params_[i].param;
    const int64_t s = shard_numel(i);
    at::Tensor full = gathered.narrow(1, off, s).reshape({-1}).narrow(0, 0, p.numel());
    p.detach().copy_(full.view(p.sizes()));
    off += s;
  }
  g.local = g.gathered = at::Tensor();
}

void LowLevelZeroOptimizer::wait_params(const std::vector<size_t>& which) {
  for (size_t i : which)
    if (i < gather_of_.size() && gather_of_[i]) finish_gather(*gather_of_[i]);
  // Buckets are finished in any order; drop the finished ones at the front.
  size_t k = 0;
  while (k < gathers_.size() && gathers_[k]->done) ++k;
  gathers_.erase(gathers_.begin(), gathers_.begin() + static_cast<std::ptrdiff_t>(k));
}

void LowLevelZeroOptimizer::wait_all() {
  for (auto& g : gathers_) finish_gather(*g);
  gathers_.clear();
}

void LowLevelZeroOptimizer::exact_weights() {
  wait_all();
  if (!fp8_weights_) return;
  const auto fp8 = options_.fp8_allgather;
  const bool overlap = options_.overlap_allgather;
  options_.fp8_allgather.reset();
  options_.overlap_allgather = false;
  std::vector<size_t> all(params_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  try {
    all_gather_params(all);
  } catch (...) {
    options_.fp8_allgather = fp8;
    options_.overlap_allgather = overlap;
    throw;
  }
  options_.fp8_allgather = fp8;
  options_.overlap_allgather = overlap;
  fp8_weights_ = false;
}

size_t LowLevelZeroOptimizer::gathers_in_flight() const {
  size_t n = 0;
  for (const auto& g : gathers_) n += g->done ? 0 : 1;
  return n;
}

int64_t LowLevelZeroOptimizer::index_of(const at::Tensor& param) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl())
      return static_cast<int64_t>(i);
  return -1;
}

int64_t LowLevelZeroOptimizer::shard_numel(size_t i) const {
  return (params_[i].param.numel() + world_ - 1) / world_;
}

at::Tensor LowLevelZeroOptimizer::new_shard(size_t i) const {
  if (pin_) return empty_pinned({shard_numel(i)}, at::kFloat).zero_();
  return at::zeros({shard_numel(i)}, at::TensorOptions().dtype(at::kFloat).device(shard_device_));
}

at::Tensor LowLevelZeroOptimizer::local_part(const at::Tensor& flat, size_t i) const {
  // This rank's elements of a flat full-size tensor (no padded copy): [r*s, min((r+1)*s, n)).
  const int64_t s = shard_numel(i), start = std::min(s * rank_, flat.numel());
  return flat.narrow(0, start, std::min(s, flat.numel() - start));
}

at::Tensor LowLevelZeroOptimizer::slice_of(const at::Tensor& full, size_t i) const {
  at::Tensor out = new_shard(i);  // zeros: the padding stays 0
  at::Tensor part = local_part(full.detach().reshape({-1}), i);
  if (part.numel() > 0) out.narrow(0, 0, part.numel()).copy_(part);
  return out;
}

at::Tensor LowLevelZeroOptimizer::gather_full(const at::Tensor& shard, size_t i) const {
  const at::Tensor& p = params_[i].param;
  at::Tensor local = shard.to(p.device(), at::kFloat).contiguous();
  if (world_ == 1) return local.narrow(0, 0, p.numel()).view(p.sizes()).clone();
  at::Tensor out = at::empty({shard_numel(i) * world_}, local.options());
  dist::Communicator c = comm_;
  c.all_gather(out, local);
  return out.narrow(0, 0, p.numel()).view(p.sizes()).clone();
}

void LowLevelZeroOptimizer::intake(size_t i, const at::Tensor& g) {
  Param& p = params_[i];
  if (!p.has_grad && direct_ && g.device() == shard_device_) {
    p.held = g;  // one rank: the gradient is already the shard
  } else if (!p.has_grad) {
    // The first gradient of a step is copied (converted in the copy): the shard is never zeroed
    // between steps (zero_grad only clears has_grad). Padding past `g` holds zeros, written only
    // by the zero-padded slices of add_grad_shard.
    if (!p.grad.defined()) p.grad = new_shard(i);
    // Offload: one pass on the GPU now instead of a CPU pass over the host shard in grad_norm.
    if (pin_ && g.is_cuda()) {
      p.grad_sq = copy_grad_to_host(p.grad.narrow(0, 0, g.numel()), g);
    } else {
      p.grad.narrow(0, 0, g.numel()).copy_(g);
    }
  } else {
    p.grad_sq = at::Tensor();  // a sum of micro-steps: grad_norm reads the shard
    if (p.held.defined()) {    // a second micro-step: the held gradient moves to the fp32 shard
      if (!p.grad.defined()) p.grad = new_shard(i);
      p.grad.narrow(0, 0, p.held.numel()).copy_(p.held);
      p.held = at::Tensor();
    }
    if (g.numel() > 0) p.grad.narrow(0, 0, g.numel()).add_(g.to(shard_device_, at::kFloat));
  }
  p.has_grad = true;
}

void LowLevelZeroOptimizer::add_grad_shard(size_t i, const at::Tensor& slice) {
  COLOSSAL_CHECK(i < params_.size() && slice.numel() == shard_numel(i),
                 "ZeRO: gradient slice of parameter ", i, " has ", slice.numel(),
                 " elements, expected ", i < params_.size() ? shard_numel(i) : -1);
  wait_all();
  c10::NoGradGuard no_grad;
  intake(i, slice);
}

void LowLevelZeroOptimizer::take_full_grads() {
  if (grads_taken_) return;
  wait_all();
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    const at::Tensor& g = p.param.grad();
    if (!g.defined()) continue;
    intake(i, local_part(g.reshape({-1}), i));
    p.param.mutable_grad() = at::Tensor();
  }
  grads_taken_ = true;
}

double LowLevelZeroOptimizer::grad_norm(double scale) {
  wait_all();
  ShardedNorm norm(reducer_);
  for (auto& p : params_) {
    if (!p.has_grad) continue;
    norm.add(grad_of(p), p.grad_sq, replicated_ ? replicated_(p.name) : std::vector<std::string>{});
  }
  return norm.global(scale);
}

void LowLevelZeroOptimizer::set_norm_reducer(amp::GradReducer reducer,
                                             ReplicatedAxes replicated_over) {
  reducer_ = std::move(reducer);
  replicated_ = std::move(replicated_over);
}

void LowLevelZeroOptimizer::step(double divisor) {
  wait_all();  // the previous step's weights
  c10::NoGradGuard no_grad;
  auto& groups = inner_->param_groups();
  std::vector<size_t> updated;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const optim::AdamWHyper h = hyper_of(groups[gi].options);
    std::map<int64_t, std::vector<size_t>> by_step;
    for (size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      if (p.group != gi || !p.has_grad) continue;
      p.step += 1;
      if (!p.exp_avg.defined()) {
        p.exp_avg = new_shard(i);
        p.exp_avg_sq = new_shard(i);
      }
      by_step[p.step].push_back(i);
      if (!writes_working(i)) updated.push_back(i);  // the others are written by the update
    }
    for (auto& [step, all] : by_step) {
      // One rank: half parameters are updated by the fused AdamW, which reads the held
      // working-dtype gradient and writes the new working weights in the same pass.
      AdamWBatch direct, other;
      for (size_t i : all) {
        Param& p = params_[i];
        if (writes_working(i)) {
          direct.add(p.master, grad_of(p), p.exp_avg, p.exp_avg_sq, p.param.detach().view({-1}));
          continue;
        }
        // Offload: CPU Adam also writes the working-dtype shard the all-gather sends.
        if (options_.cpu_offload && !p.working.defined())
          p.working = host_empty({shard_numel(i)}, p.param.scalar_type(), pin_);
        other.add(p.master, grad_of(p), p.exp_avg, p.exp_avg_sq,
                  options_.cpu_offload ? p.working : at::Tensor());
      }
      direct.run(AdamWPath::Fused, h, step, divisor);
      other.run(options_.cpu_offload ? AdamWPath::Host : AdamWPath::Plain, h, step, divisor);
    }
  }
  all_gather_params(updated);
  zero_grad();
}

void LowLevelZeroOptimizer::all_gather_params(std::vector<size_t> which) {
  // Buckets of one working dtype, at most allgather_bucket_numel shard elements each: the local
  // slices are concatenated, gathered rank-major, and every parameter takes its columns. With
  // overlap_allgather the buckets are launched in forward order and only those holding a
  // parameter that is not deferrable are finished here; the rest land in wait_params/wait_all.
  const bool overlap = options_.overlap_allgather && world_ > 1;
  if (overlap)
    std::stable_sort(which.begin(), which.end(),
                     [&](size_t a, size_t b) { return position_[a] < position_[b]; });
  size_t k = 0;
  while (k < which.size()) {
    const at::Tensor& first = params_[which[k]].param;
    const bool defer = overlap && deferrable_[which[k]];
    std::vector<size_t> bucket;
    int64_t cols = 0;
    while (k < which.size()) {
      const at::Tensor& p = params_[which[k]].param;
      if (!bucket.empty() &&
          (p.scalar_type() != first.scalar_type() || p.device() != first.device() ||
           (overlap && deferrable_[which[k]] != defer) ||
           cols + shard_numel(which[k]) > options_.allgather_bucket_numel))
        break;
      bucket.push_back(which[k]);
      cols += shard_numel(which[k]);
      ++k;
    }
    std::vector<at::Tensor> parts;
    for (size_t i : bucket) {
      const Param& p = params_[i];
      const at::Tensor& src = p.working.defined() ? p.working : p.master;
      parts.push_back(src.to(first.device(), first.scalar_type(),
                             /*non_blocking=*/p.working.defined() && pin_));
    }
    auto g = std::make_unique<Gather>();
    g->local = at::cat(parts);
    g->params = bucket;
    g->cols = cols;
    if (world_ == 1) {
      g->gathered = g->local;
    } else {
      fp8_weights_ = fp8_weights_ || options_.fp8_allgather.has_value();
      g->gathered = at::empty({world_ * cols}, g->local.options());
      g->work = options_.fp8_allgather
                    ? dist::all_gather_fp8(comm_, g->gathered, g->local, *options_.fp8_allgather,
                                           /*async_op=*/defer)
                    : comm_.all_gather(g->gathered, g->local, /*async_op=*/defer);
    }
    if (!defer) {
      finish_gather(*g);
      continue;
    }
    for (size_t i : bucket) gather_of_[i] = g.get();
    gathers_.push_back(std::move(g));
  }
}

bool LowLevelZeroOptimizer::writes_working(size_t i) const {
  const at::Tensor& w = params_[i].param;
  return direct_ && w.is_contiguous() && w.device() == shard_device_ &&
         (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf);
}

void LowLevelZeroOptimizer::zero_grad() {  // touches no weight: in-flight gathers continue
  for (auto& p : params_) {
    p.has_grad = false;  // the next step's first gradient overwrites the shard (no memset)
    p.held = at::Tensor();
    p.grad_sq = at::Tensor();
    if (p.param.grad().defined()) p.param.mutable_grad() = at::Tensor();
  }
  grads_taken_ = false;
}

namespace {
bool is_half(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}
}  // namespace

optim::StateDict LowLevelZeroOptimizer::state_dict() const {
  const_cast<LowLevelZeroOptimizer*>(this)->wait_all();  // masters are current; weights too
  // Scalars in the format of optim::Optimizer::state_dict(): the inner optimizer has no state,
  // so its dict carries the groups; the steps are ours.
  optim::StateDict out = inner_->state_dict();
  out.tensors.clear();
  json::Value steps = json::Value::object();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (p.step > 0) {
      steps.set(p.name, p.step);
      out.tensors.emplace_back(p.name + ".exp_avg", gather_full(p.exp_avg, i));
      out.tensors.emplace_back(p.name + ".exp_avg_sq", gather_full(p.exp_avg_sq, i));
    }
    if (is_half(p.param)) out.tensors.emplace_back(p.name + ".master", gather_full(p.master, i));
  }
  out.scalars.set("steps", std::move(steps));
  return out;
}

std::vector<checkpoint::TensorDecl> LowLevelZeroOptimizer::state_plan(json::Value* scalars) {
  wait_all();
  optim::StateDict out = inner_->state_dict();  // groups only (see state_dict())
  json::Value steps = json::Value::object();
  std::vector<checkpoint::TensorDecl> decls;
  plan_.clear();
  auto add = [&](size_t i, const char* key, int which) {
    decls.push_back({params_[i].name + "." + key, at::kFloat, params_[i].param.sizes().vec()});
    plan_.emplace_back(i, which);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (p.step > 0) {
      steps.set(p.name, p.step);
      add(i, "exp_avg", 1);
      add(i, "exp_avg_sq", 2);
    }
    if (is_half(p.param)) add(i, "master", 0);
  }
  out.scalars.set("steps", std::move(steps));
  if (scalars) *scalars = std::move(out.scalars);
  return decls;
}

at::Tensor LowLevelZeroOptimizer::gather_to(const at::Tensor& shard, size_t i, int dst) {
  const at::Tensor& p = params_[i].param;
  at::Tensor local = shard.to(p.device(), at::kFloat).contiguous();
  if (world_ == 1) return local.narrow(0, 0, p.numel()).view(p.sizes());
  if (rank_ != dst) {
    comm_.send(local, dst);
    return at::Tensor();
  }
  // Point to point from each rank, not an all-gather: only the writer holds the full tensor.
  const int64_t s = shard_numel(i);
  at::Tensor out = at::empty({s * world_}, local.options());
  for (int r = 0; r < world_; ++r) {
    at::Tensor part = out.narrow(0, r * s, s);
    if (r == rank_)
      part.copy_(local);
    else
      comm_.recv(part, r);
  }
  return out.narrow(0, 0, p.numel()).view(p.sizes());
}

at::Tensor LowLevelZeroOptimizer::gather_state(size_t k, int dst) {
  COLOSSAL_CHECK(k < plan_.size(), "gather_state: tensor ", k, " of a plan of ", plan_.size());
  const auto [i, which] = plan_[k];
  const Param& p = params_[i];
  return gather_to(which == 0 ? p.master : which == 1 ? p.exp_avg : p.exp_avg_sq, i, dst);
}

void LowLevelZeroOptimizer::load_state_dict(const optim::StateDict& sd) {
  load_state(optim::StateDictSource(sd));
}

void LowLevelZeroOptimizer::load_state(const optim::StateSource& src) {
  wait_all();  // a late gather must not overwrite the restored weights
  c10::NoGradGuard no_grad;
  optim::StateDict header;
  header.scalars = src.scalars();
  std::vector<optim::GroupOptions> opts = optim::read_state_groups(header, *inner_);
  auto& groups = inner_->param_groups();
  const json::Value& steps = header.scalars.at("steps");
  auto has = [&](const Param& p, const std::string& key) {
    std::vector<int64_t> shape;
    if (!src.find(p.name + "." + key, &shape)) return false;
    COLOSSAL_CHECK_INPUT(at::IntArrayRef(shape) == p.param.sizes(), "optimizer state tensor '",
                         p.name, ".", key, "' has shape ", at::IntArrayRef(shape),
                         " but parameter '", p.name, "' needs ", p.param.sizes());
    return true;
  };
  // Every name and shape first: nothing changes unless the whole state fits.
  for (const Param& p : params_) {
    if (is_half(p.param)) has(p, "master");
    const json::Value* st = steps.find(p.name);
    if (!st) continue;
    st->as_int("steps." + p.name);
    const bool ea = has(p, "exp_avg"), eas = has(p, "exp_avg_sq");
    COLOSSAL_CHECK_INPUT(ea && eas, "optimizer state lacks tensor '", p.name, ".",
                         ea ? "exp_avg_sq" : "exp_avg", "'");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    const int64_t s = shard_numel(i), n = p.param.numel();
    const int64_t start = std::min(s * rank_, n), len = std::min(s, n - start);
    // This rank's elements into its shard (allocated if missing: zeros, the padding stays 0).
    auto read_shard = [&](const std::string& key, at::Tensor& shard) {
      if (!shard.defined()) shard = new_shard(i);
      if (len > 0) src.read(p.name + "." + key, start, shard.narrow(0, 0, len));
    };
    if (is_half(p.param) && src.find(p.name + ".master", nullptr)) {
      read_shard("master", p.master);
      // Working parameters follow their restored masters.
      src.read(p.name + ".master", 0, p.param.detach());
    } else if (p.master.defined()) {
      at::Tensor part = local_part(p.param.detach().reshape({-1}), i);
      if (part.numel() > 0) p.master.narrow(0, 0, part.numel()).copy_(part);
    } else {
      p.master = slice_of(p.param.detach(), i);
    }
    const json::Value* st = steps.find(p.name);
    if (!st) {
      p.step = 0;
      p.exp_avg = p.exp_avg_sq = at::Tensor();
      continue;
    }
    p.step = st->as_int("steps." + p.name);
    read_shard("exp_avg", p.exp_avg);
    read_shard("exp_avg_sq", p.exp_avg_sq);
  }
  for (size_t gi = 0; gi < groups.size(); ++gi) groups[gi].options = opts[gi];
}

void LowLevelZeroOptimizer::sync_masters_from_params() {
  wait_all();
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i)
    params_[i].master.copy_(slice_of(params_[i].param, i));
}

int64_t LowLevelZeroOptimizer::state_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_)
    for (const at::Tensor* t : {&p.master, &p.exp_avg, &p.exp_avg_sq})
      if (t->defined()) b += t->numel() * static_cast<int64_t>(t->element_size());
  return b;
}

at::Tensor LowLevelZeroOptimizer::grad_shard(size_t i) const {
  COLOSSAL_CHECK(i < params_.size(), "grad_shard: parameter ", i, " of ", params_.size());
  const Param& p = params_[i];
  return p.has_grad ? grad_of(p).narrow(0, 0, shard_numel(i)) : at::Tensor();
}

int64_t LowLevelZeroOptimizer::grad_shard_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_)
    for (const at::Tensor* t : {&p.grad, &p.held})
      if (t->defined()) b += t->numel() * static_cast<int64_t>(t->element_size());
  return b;
}

int64_t LowLevelZeroOptimizer::padded_numel() const {
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i) n += shard_numel(i) * world_;
  return n;
}

int64_t LowLevelZeroOptimizer::total_numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.param.numel();
  return n;
}

}  // namespace colossal::zero
