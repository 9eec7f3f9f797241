#include "colossal/booster/grad_sync.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/dist/fp8_collectives.h"

namespace colossal::booster {
namespace {

// Calls back into GradSync after AccumulateGrad has written a parameter's .grad. The weak flag
// makes a hook left on a parameter after its GradSync is gone harmless.
struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  ReadyHook(std::weak_ptr<bool> alive, std::function<void()> fn)
      : alive_(std::move(alive)), fn_(std::move(fn)) {}
  void operator()(const torch::autograd::Variable&) override {
    if (!alive_.expired()) fn_();
  }
  std::weak_ptr<bool> alive_;
  std::function<void()> fn_;
};

}  // namespace

GradSync::GradSync(std::vector<std::pair<std::string, at::Tensor>> params, dist::Communicator comm,
                   Options options)
    : params_(std::move(params)),
      comm_(std::move(comm)),
      options_(options),
      alive_(std::make_shared<bool>(true)) {
  COLOSSAL_CHECK_INPUT(options_.bucket_cap_mb > 0, "bucket_cap_mb must be > 0, got ",
                       options_.bucket_cap_mb);
  const int64_t cap_bytes = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  bucket_of_.assign(params_.size(), 0);
  ready_.assign(params_.size(), 0);
  had_grad_.assign(params_.size(), 0);
  // Reverse registration order: the last layers' gradients are produced first.
  Bucket current;
  int64_t current_bytes = 0;
  c10::optional<at::Device> current_device;
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k].second;
    COLOSSAL_CHECK(p.requires_grad(), "GradSync: parameter ", params_[k].first,
                   " does not require grad");
    int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    bool fits = !current.params.empty() && current.dtype == p.scalar_type() &&
                *current_device == p.device() && current_bytes + bytes <= cap_bytes;
    if (!current.params.empty() && !fits) {
      buckets_.push_back(std::move(current));
      current = Bucket{};
      current_bytes = 0;
    }
    if (current.params.empty()) {
      current.dtype = p.scalar_type();
      current_device = p.device();
    }
    current.params.push_back(k);
    current.numel += p.numel();
    current_bytes += bytes;
  }
  if (!current.params.empty()) buckets_.push_back(std::move(current));
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t k : buckets_[b].params) bucket_of_[k] = b;

  std::weak_ptr<bool> weak = alive_;
  for (size_t k = 0; k < params_.size(); ++k) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        params_[k].second, std::make_unique<ReadyHook>(weak, [this, k] { on_grad_ready(k); }));
  }
  reset_iteration();
  log_debug("GradSync: ", params_.size(), " parameters in ", buckets_.size(), " buckets (cap ",
            options_.bucket_cap_mb, " MB) over ", comm_.name());
}

GradSync::~GradSync() {
  // Hooks hold a weak flag; dropping it disarms them. Wait for anything still in flight so no
  // collective outlives its buffers.
  alive_.reset();
  for (auto& b : buckets_) {
    if (b.launched) {
      try {
        b.work.wait();
      } catch (...) {
      }
    }
  }
}

std::vector<std::string> GradSync::bucket_names(size_t i) const {
  std::vector<std::string> out;
  for (size_t k : buckets_.at(i).params) out.push_back(params_[k].first);
  return out;
}

void GradSync::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.launched = false;
    b.work = dist::Work();
  }
  next_launch_ = 0;
  armed_ = false;
}

void GradSync::on_grad_ready(size_t k) {
  if (!enabled_) return;
  if (!armed_) {
    // First gradient of this backward: finish() runs when the autograd engine is done, so a
    // plain loss.backward() synchronises too (as torch DDP does).
    armed_ = true;
    std::weak_ptr<bool> alive = alive_;
    torch::autograd::Engine::get_default_engine().queue_callback([this, alive] {
      if (!alive.expired()) finish();
    });
  }
  if (ready_[k]) return;  // a second accumulation in one backward (reentrant use): counted once
  ready_[k] = 1;
  Bucket& b = buckets_[bucket_of_[k]];
  if (--b.pending == 0 && options_.overlap) launch_ready_prefix();
}

void GradSync::launch_ready_prefix() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0)
    launch(next_launch_++);
}

void GradSync::launch(size_t bi) {
  if (options_.on_shard) {
    launch_reduce_scatter(bi);
    return;
  }
  Bucket& b = buckets_[bi];
  const at::Tensor& first = params_[b.params.front()].second;
  if (!b.flat.defined()) {
    // One persistent flat buffer per bucket: no allocation per step.
    b.flat =
        at::empty({b.numel}, first.options().dtype(options_.communication_dtype.value_or(b.dtype)));
  }
  int64_t off = 0;
  for (size_t k : b.params) {
    const at::Tensor& p = params_[k].second;
    at::Tensor slot = b.flat.narrow(0, off, p.numel());
    off += p.numel();
    const at::Tensor& g = p.grad();
    had_grad_[k] = g.defined();
    if (g.defined()) {
      slot.copy_(g.reshape({-1}));
    } else {
      slot.zero_();
    }
  }
  b.work = options_.fp8 && comm_.size() > 1
               ? dist::all_reduce_fp8(comm_, b.flat, *options_.fp8, dist::ReduceOp::Avg, true)
               : comm_.all_reduce(b.flat, dist::ReduceOp::Avg, /*async_op=*/true);
  b.launched = true;
}

int64_t GradSync::shard_numel(const at::Tensor& p) const {
  const int64_t w = comm_.size();
  return (p.numel() + w - 1) / w;
}

void GradSync::launch_reduce_scatter(size_t bi) {
  // Rank-major layout: row j of the (size, S) input holds slice j of every parameter of the
  // bucket, so one reduce-scatter leaves this rank exactly its slices, back to back.
  Bucket& b = buckets_[bi];
  const int64_t w = comm_.size();
  if (w == 1) {
    // One rank: the reduce-scatter is the identity. Each gradient goes to the owner as it is
    // and is dropped at once: no staging copy, and nothing of full size waits for the end of
    // backward (at 7B on one GPU the staged buckets were 13 GB). Used == had a gradient here.
    for (size_t k : b.params) {
      at::Tensor& p = params_[k].second;
      const at::Tensor& g = p.grad();
      had_grad_[k] = g.defined();
      if (!g.defined()) continue;
      options_.on_shard(k, g.reshape({-1}));
      p.mutable_grad() = at::Tensor();
    }
    b.launched = true;  // b.work stays a completed no-op; b.out stays empty
    return;
  }
  int64_t cols = 0;
  for (size_t k : b.params) cols += shard_numel(params_[k].second);
  const at::Tensor& first = params_[b.params.front()].second;
  at::ScalarType dtype = options_.communication_dtype.value_or(b.dtype);
  at::Tensor input = at::zeros({w, cols}, first.options().dtype(dtype));
  int64_t off = 0;
  for (size_t k : b.params) {
    at::Tensor& p = params_[k].second;
    const int64_t s = shard_numel(p);
    const at::Tensor& g = p.grad();
    had_grad_[k] = g.defined();
    if (g.defined()) {
      // Straight into the (already zero) columns: full rows, then the partial one; no padded copy.
      at::Tensor flat = g.reshape({-1});
      at::Tensor dst = input.narrow(1, off, s);
      const int64_t rows = s > 0 ? p.numel() / s : 0, rem = s > 0 ? p.numel() % s : 0;
      if (rows > 0) dst.narrow(0, 0, rows).copy_(flat.narrow(0, 0, rows * s).view({rows, s}));
      if (rem > 0) dst.select(0, rows).narrow(0, 0, rem).copy_(flat.narrow(0, rows * s, rem));
      // Only this rank's slice is kept (by the caller, from finish()): drop the full gradient.
      p.mutable_grad() = at::Tensor();
    }
    off += s;
  }
  b.flat = input.view({-1});
  b.out = at::empty({cols}, input.options());
  b.work = options_.fp8 ? dist::reduce_scatter_fp8(comm_, b.out, b.flat, *options_.fp8,
                                                   dist::ReduceOp::Avg, /*async_op=*/true)
                        : comm_.reduce_scatter(b.out, b.flat, dist::ReduceOp::Avg, true);
  b.launched = true;
}

void GradSync::reduce_now() {
  const bool was = enabled_;
  enabled_ = true;
  armed_ = true;
  finish();
  enabled_ = was;
}

void GradSync::finish() {
  if (!enabled_ || !armed_) return;
  // Buckets whose parameters got no gradient this time (unused parameters) still take part.
  for (auto& b : buckets_) b.pending = 0;
  launch_ready_prefix();
  // Which parameters had a gradient on some rank: one that none had keeps no gradient (and is
  // skipped by the optimizer), exactly as in a single process. One small extra collective.
  // One rank: this rank's flags are the answer (no collective, no round trip to the device).
  at::Tensor used_cpu =
      at::tensor(std::vector<float>(had_grad_.begin(), had_grad_.end()), at::kFloat);
  if (comm_.size() > 1) {
    at::Tensor used = used_cpu.to(params_.front().second.device());
    dist::Work used_work = comm_.all_reduce(used, dist::ReduceOp::Max, /*async_op=*/true);
    used_work.wait();
    used_cpu = used.to(at::kCPU);
  }
  const float* used_flags = used_cpu.data_ptr<float>();
  if (options_.on_shard) {
    for (auto& b : buckets_) {
      b.work.wait();
      if (!b.out.defined()) continue;  // one rank: delivered at launch
      int64_t off = 0;
      for (size_t k : b.params) {
        const int64_t s = shard_numel(params_[k].second);
        if (used_flags[k] != 0.0f) options_.on_shard(k, b.out.narrow(0, off, s));
        off += s;
      }
      b.flat = at::Tensor();  // nothing of full size outlives the backward
      b.out = at::Tensor();
    }
    reset_iteration();
    return;
  }
  for (auto& b : buckets_) {
    b.work.wait();
    int64_t off = 0;
    for (size_t k : b.params) {
      at::Tensor& p = params_[k].second;
      at::Tensor avg = b.flat.narrow(0, off, p.numel()).view(p.sizes());
      off += p.numel();
      if (used_flags[k] == 0.0f) continue;
      at::Tensor g = p.grad();
      if (!g.defined()) {
        p.mutable_grad() = avg.to(p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      } else {
        g.copy_(avg);
      }
    }
  }
  reset_iteration();
}

}  // namespace colossal::booster
