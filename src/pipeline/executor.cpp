// The pipeline interpreter (see executor.h).
#include "colossal/pipeline/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <memory>
#include <set>

#include "colossal/core/error.h"
#include "colossal/pipeline/weight_grad_store.h"

namespace colossal::pipeline {

namespace {

constexpr int kMetaLen = 10;  // dtype, ndim, up to 8 sizes
constexpr int kMaxDims = kMetaLen - 2;

enum class Kind { F = 0, B = 1 };

at::Tensor encode_meta(const at::Tensor& t) {
  COLOSSAL_CHECK(t.dim() <= kMaxDims, "pipeline: a stage boundary tensor has ", t.dim(),
                 " dimensions (at most ", kMaxDims, " are sent)");
  at::Tensor m = at::zeros({kMetaLen}, at::kLong);
  auto* p = m.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(t.scalar_type());
  p[1] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) p[2 + i] = t.size(i);
  return m;
}

struct Meta {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
};

Meta decode_meta(const at::Tensor& m) {
  at::Tensor c = m.to(at::kCPU);
  const auto* p = c.data_ptr<int64_t>();
  COLOSSAL_CHECK(p[1] >= 0 && p[1] <= kMaxDims && p[0] >= 0 &&
                     p[0] < static_cast<int64_t>(at::ScalarType::NumOptions),
                 "pipeline: received corrupt metadata (dtype ", p[0], ", ", p[1], " dims)");
  Meta out;
  out.dtype = static_cast<at::ScalarType>(p[0]);
  out.sizes.assign(p + 2, p + 2 + p[1]);
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct Executor::Slot {
  at::Tensor input;  // received / handed-over activation (undefined at v = 0)
  dist::Work input_work;
  at::Tensor x;  // the detached input the chunk ran on (requires grad)
  at::Tensor y;  // output; the (scaled) loss at the last virtual stage
  at::Tensor loss;
  at::Tensor grad_out;  // gradient of y (undefined at the last virtual stage: ones)
  dist::Work grad_out_work;
  at::Tensor grad_in;                         // gradient of x, for SendB / the previous chunk
  std::unique_ptr<WeightGradStore> deferred;  // B's weight-gradient GEMMs, run by W
  bool forwarded = false, b_done = false, freed = false;
};

Executor::Executor(Schedule schedule, dist::Communicator pp, StageFunctions stage,
                   ExecutorOptions options)
    : schedule_(std::move(schedule)),
      pp_(std::move(pp)),
      stage_(std::move(stage)),
      options_(options) {
  COLOSSAL_CHECK(stage_.forward, "pipeline executor: no forward function");
  COLOSSAL_CHECK(stage_.parameters, "pipeline executor: no parameters function");
  const int world = pp_.valid() ? pp_.size() : 1;
  COLOSSAL_CHECK_INPUT(world == schedule_.stages, "pipeline: the schedule '", schedule_.name,
                       "' has ", schedule_.stages, " stages, the pipeline group ", world, " ranks");
  rank_ = pp_.valid() ? pp_.rank() : 0;
  validate(schedule_);
  if (pp_.valid() && pp_.size() > 1) {
    meta_ = pp_.new_group(pp_.ranks(), pp_.name() + "/meta");
    // A group connects on its first operation, with every member: a rank's first point-to-point
    // op must not be where that happens (its peers may be blocked on other ranks' messages).
    pp_.barrier();
    meta_.barrier();
  }
}

void Executor::set_stage(StageFunctions stage) {
  COLOSSAL_CHECK(stage.forward && stage.parameters,
                 "pipeline executor: incomplete stage functions");
  stage_ = std::move(stage);
}

bool Executor::holds_last() const {
  return schedule_.holder(schedule_.virtual_stages() - 1).first == rank_;
}

std::vector<at::Tensor> Executor::run() {
  const Schedule& s = schedule_;
  const int C = s.chunks, V = s.virtual_stages(), M = s.microbatches;
  std::vector<Slot> slots(static_cast<size_t>(M * C));
  auto slot = [&](int mb, int chunk) -> Slot& {
    COLOSSAL_CHECK(mb >= 0 && mb < M && chunk >= 0 && chunk < C, "pipeline: (mb ", mb, ", chunk ",
                   chunk, ") out of range");
    return slots[static_cast<size_t>(mb * C + chunk)];
  };
  // Metadata of the channels seen this step: (kind, sending virtual stage).
  std::map<std::pair<int, int>, Meta> recv_meta;
  std::set<std::pair<int, int>> sent_meta;
  std::vector<std::pair<dist::Work, std::vector<at::Tensor>>> inflight;  // keeps buffers alive
  timings_.clear();
  peak_ = 0;
  int alive = 0;
  const auto t0 = std::chrono::steady_clock::now();

  auto free_slot = [&](Slot& sl) {
    sl.x = at::Tensor();
    sl.y = at::Tensor();
    sl.input = at::Tensor();
    sl.grad_out = at::Tensor();
    sl.freed = true;
    --alive;
  };
  // The input gradient goes to the previous chunk on this rank, or waits for SendB.
  auto hand_back = [&](int mb, int v, Slot& sl) {
    if (v == 0) return;
    auto [r, c] = s.holder(v - 1);
    if (r == rank_) slot(mb, c).grad_out = std::exchange(sl.grad_in, at::Tensor());
  };

  double started = 0;  // when the current compute began (after waiting for its inputs)
  auto run_compute = [&](const Instr& in) {
    started = seconds_since(t0);
    Slot& sl = slot(in.mb, in.chunk);
    const int v = s.virtual_stage(rank_, in.chunk);
    switch (in.op) {
      case Op::F: {
        at::Tensor input;
        if (v > 0) {
          sl.input_work.wait();
          started = seconds_since(t0);
          COLOSSAL_CHECK(sl.input.defined(), "pipeline: ", to_string(in), " on rank ", rank_,
                         " has no input (nothing received or handed over)");
          input = sl.input.detach();
          if (at::isFloatingType(input.scalar_type())) input.requires_grad_(true);
          sl.x = input;
          sl.input = at::Tensor();
        }
        at::Tensor y = stage_.forward(in.mb, in.chunk, input);
        COLOSSAL_CHECK(y.defined(), "pipeline: the forward of ", to_string(in),
                       " returned nothing");
        if (v == V - 1) {
          COLOSSAL_CHECK(y.numel() == 1,
                         "pipeline: the last stage's forward must return the loss "
                         "(a scalar), got ",
                         y.sizes());
          sl.loss = y.detach();
          sl.y = stage_.scale_loss ? stage_.scale_loss(y) : y;
        } else {
          sl.y = y;
          auto [r, c] = s.holder(v + 1);
          if (r == rank_) slot(in.mb, c).input = y.detach();
        }
        sl.forwarded = true;
        peak_ = std::max(peak_, ++alive);
        break;
      }
      case Op::BW: {
        if (v < V - 1) sl.grad_out_work.wait();
        started = seconds_since(t0);
        COLOSSAL_CHECK(sl.y.defined(), "pipeline: ", to_string(in), " before its forward");
        COLOSSAL_CHECK(v == V - 1 || sl.grad_out.defined(), "pipeline: ", to_string(in),
                       " has no output gradient");
        if (sl.y.requires_grad()) {
          std::vector<at::Tensor> grads;
          if (v < V - 1) grads.push_back(sl.grad_out);
          torch::autograd::backward({sl.y}, grads);
        }
        if (v > 0) {
          sl.grad_in = sl.x.grad().defined() ? sl.x.grad() : at::zeros_like(sl.x);
          hand_back(in.mb, v, sl);
        }
        free_slot(sl);
        break;
      }
      case Op::B: {
        if (v < V - 1) sl.grad_out_work.wait();
        started = seconds_since(t0);
        COLOSSAL_CHECK(sl.y.defined(), "pipeline: ", to_string(in), " before its forward");
        if (options_.weight_grad_store) {
          // The whole backward with the store open: deferring layers leave their dW GEMMs for W.
          sl.deferred = std::make_unique<WeightGradStore>();
          if (sl.y.requires_grad()) {
            WeightGradStore::Scope open(*sl.deferred);
            std::vector<at::Tensor> grads;
            if (v < V - 1) grads.push_back(sl.grad_out);
            torch::autograd::backward({sl.y}, grads);
          }
          if (v > 0) sl.grad_in = sl.x.grad().defined() ? sl.x.grad() : at::zeros_like(sl.x);
          sl.y = at::Tensor();
          sl.x = at::Tensor();
          sl.grad_out = at::Tensor();
        } else if (v > 0) {
          std::vector<at::Tensor> grads;
          if (v < V - 1) grads.push_back(sl.grad_out);
          auto g = torch::autograd::grad({sl.y}, {sl.x}, grads, /*retain_graph=*/true,
                                         /*create_graph=*/false, /*allow_unused=*/true);
          sl.grad_in = g[0].defined() ? g[0] : at::zeros_like(sl.x);
        }
        if (v > 0) hand_back(in.mb, v, sl);
        sl.b_done = true;
        break;
      }
      case Op::W: {
        COLOSSAL_CHECK(sl.b_done, "pipeline: ", to_string(in), " before its B");
        if (options_.weight_grad_store) {
          if (sl.deferred) sl.deferred->run();
          sl.deferred.reset();
        } else {
          std::vector<at::Tensor> params;
          for (auto& p : stage_.parameters(in.chunk))
            if (p.requires_grad()) params.push_back(p);
          if (!params.empty() && sl.y.requires_grad()) {
            std::vector<at::Tensor> grads;
            if (v < V - 1) grads.push_back(sl.grad_out);
            torch::autograd::backward({sl.y}, grads, /*retain_graph=*/false,
                                      /*create_graph=*/false, params);
          }
        }
        free_slot(sl);
        break;
      }
      default:
        COLOSSAL_CHECK(false, "pipeline: not a compute instruction: ", to_string(in));
    }
  };

  // One batch of consecutive Send/Recv instructions (see the header for the two phases).
  auto run_batch = [&](const std::vector<Instr>& batch) {
    std::vector<dist::P2POp> meta_ops, phase1, phase2;
    std::vector<at::Tensor> keep;
    struct Pending {
      Slot* sl;
      bool grad;
      int peer;
      std::pair<int, int> channel;
      at::Tensor meta;
    };
    std::vector<Pending> delayed;
    std::set<int> delayed_links;  // peers whose later receives in this batch wait too
    std::set<std::pair<int, int>> meta_this_batch;  // channels whose metadata this batch brings
    for (const Instr& in : batch) {
      Slot& sl = slot(in.mb, in.chunk);
      const int v = s.virtual_stage(rank_, in.chunk);
      const bool fwd = in.op == Op::SendF || in.op == Op::RecvF;
      const bool send = in.op == Op::SendF || in.op == Op::SendB;
      const int peer_v = fwd == send ? v + 1 : v - 1;
      COLOSSAL_CHECK(peer_v >= 0 && peer_v < V, "pipeline: ", to_string(in), " on rank ", rank_,
                     " talks to virtual stage ", peer_v, " which does not exist");
      const int peer = s.holder(peer_v).first;
      const std::pair<int, int> channel{static_cast<int>(fwd ? Kind::F : Kind::B),
                                        send ? v : peer_v};
      if (send) {
        at::Tensor t;
        if (fwd) {
          COLOSSAL_CHECK(sl.y.defined(), "pipeline: ", to_string(in), " before its forward");
          t = sl.y.detach().contiguous();
        } else {
          COLOSSAL_CHECK(sl.grad_in.defined(), "pipeline: ", to_string(in), " before its backward");
          t = std::exchange(sl.grad_in, at::Tensor()).contiguous();
        }
        if (!options_.enable_metadata_cache || !sent_meta.count(channel)) {
          at::Tensor m = encode_meta(t).to(t.device());
          meta_ops.push_back(dist::P2POp::send(m, peer));
          keep.push_back(m);
          sent_meta.insert(channel);
        }
        phase1.push_back(dist::P2POp::send(t, peer));
        keep.push_back(t);
      } else {
        auto it = recv_meta.find(channel);
        const bool meta_in_batch = meta_this_batch.count(channel) > 0;
        if (!options_.enable_metadata_cache || (it == recv_meta.end() && !meta_in_batch)) {
          meta_this_batch.insert(channel);
          at::Tensor m =
              at::empty({kMetaLen}, at::TensorOptions(at::kLong).device(options_.device));
          meta_ops.push_back(dist::P2POp::recv(m, peer));
          delayed.push_back({&sl, !fwd, peer, channel, m});
          delayed_links.insert(peer);
          recv_meta.erase(channel);
        } else if (meta_in_batch || delayed_links.count(peer)) {
          // (A later message of a channel whose metadata arrives in this batch reuses it.)
          delayed.push_back({&sl, !fwd, peer, channel, at::Tensor()});
        } else {
          at::Tensor buf = at::empty(it->second.sizes,
                                     at::TensorOptions(it->second.dtype).device(options_.device));
          phase1.push_back(dist::P2POp::recv(buf, peer));
          (fwd ? sl.input : sl.grad_out) = buf;
        }
      }
    }
    dist::Work meta_work, work1;
    if (!meta_ops.empty()) meta_work = meta_.batch_p2p(meta_ops, /*async_op=*/true);
    if (!phase1.empty()) work1 = pp_.batch_p2p(phase1, /*async_op=*/true);
    for (const Instr& in : batch) {
      if (in.op != Op::RecvF && in.op != Op::RecvB) continue;
      Slot& sl = slot(in.mb, in.chunk);
      (in.op == Op::RecvF ? sl.input_work : sl.grad_out_work) = work1;
    }
    if (!delayed.empty()) {
      meta_work.wait();
      for (auto& d : delayed) {
        if (d.meta.defined()) recv_meta[d.channel] = decode_meta(d.meta);
        const Meta& m = recv_meta.at(d.channel);
        at::Tensor buf = at::empty(m.sizes, at::TensorOptions(m.dtype).device(options_.device));
        phase2.push_back(dist::P2POp::recv(buf, d.peer));
        (d.grad ? d.sl->grad_out : d.sl->input) = buf;
      }
      dist::Work work2 = pp_.batch_p2p(phase2, /*async_op=*/true);
      for (auto& d : delayed) (d.grad ? d.sl->grad_out_work : d.sl->input_work) = work2;
      inflight.emplace_back(work2, std::vector<at::Tensor>{});
    }
    inflight.emplace_back(meta_work, std::vector<at::Tensor>{});
    inflight.emplace_back(work1, std::move(keep));
  };

  const std::vector<Instr>& list = s.ranks.at(static_cast<size_t>(rank_));
  std::vector<Instr> batch;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && is_comm(list[i].op)) {
      batch.push_back(list[i]);
      continue;
    }
    if (!batch.empty()) {
      const double a = seconds_since(t0);
      run_batch(batch);
      if (options_.record_timings)
        for (const Instr& in : batch) timings_.push_back({in, a, seconds_since(t0)});
      batch.clear();
    }
    if (i == list.size()) break;
    run_compute(list[i]);
    if (options_.record_timings) timings_.push_back({list[i], started, seconds_since(t0)});
  }
  for (auto& [w, keep] : inflight) w.wait();
  run_seconds_ = seconds_since(t0);

  std::vector<at::Tensor> losses;
  for (int mb = 0; mb < M; ++mb)
    for (int c = 0; c < C; ++c) {
      Slot& sl = slot(mb, c);
      COLOSSAL_CHECK(!sl.forwarded || sl.freed, "pipeline: (mb ", mb, ", chunk ", c,
                     ") still holds its activations at the end of the step on rank ", rank_);
      if (s.virtual_stage(rank_, c) == V - 1) losses.push_back(sl.loss);
    }
  return losses;
}

}  // namespace colossal::pipeline
