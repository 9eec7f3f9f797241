// Communicator over a c10d engine: argument checks (shapes, devices, dtypes), fp8-as-bytes,
// Avg emulation on Gloo, timeouts on every operation, and errors that name the collective, the
// group and the rank.
#include "colossal/dist/communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>
#include <map>
#include <numeric>

#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/dist/env.h"
#include "dist/backend_factory.h"
#include "dist/communicator_impl.h"

namespace colossal::dist {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

const char* to_string(Backend b) {
  return b == Backend::Gloo ? "gloo" : "nccl";
}

bool backend_available(Backend b) {
  return b == Backend::Gloo ? detail::gloo_compiled() : detail::nccl_compiled();
}

std::chrono::milliseconds default_timeout() {
  const char* v = std::getenv("COLOSSAL_DIST_TIMEOUT_S");
  if (!v) return std::chrono::minutes(30);
  // `colossal run --dist_timeout` sets it; "inf" or 1e300 would overflow the milliseconds.
  return std::chrono::milliseconds(
      static_cast<int64_t>(parse_seconds_var("COLOSSAL_DIST_TIMEOUT_S", v) * 1000.0));
}

// ---- Work -------------------------------------------------------------------------------------

namespace {

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream os;
  os.precision(3);
  os << static_cast<double>(ms.count()) / 1000.0 << " s";
  return os.str();
}

// The engine's message without c10's "Exception raised from <file>" trailer.
std::string error_text(const std::exception& e) {
  auto* c = dynamic_cast<const c10::Error*>(&e);
  std::string m = c ? c->what_without_backtrace() : e.what();
  auto at = m.find("\nException raised from");
  if (at != std::string::npos) m.resize(at);
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.pop_back();
  return m;
}

}  // namespace

void Work::wait() {
  if (!impl_) return;
  auto& w = *impl_;
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.done) {
    auto start = std::chrono::steady_clock::now();
    try {
      for (auto& work : w.works) {
        if (w.blocking_wait) {
          if (!work->wait(w.timeout)) throw DistError("operation did not complete");
        } else {
          work->wait();
        }
      }
      if (w.finish) w.finish();
    } catch (const std::exception& e) {
      auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - start);
      std::string msg = error_text(e);
      bool timed_out = msg.find("imed out") != std::string::npos ||
                       msg.find("imeout") != std::string::npos ||
                       waited + std::chrono::milliseconds(50) >= w.timeout;
      w.error = str(
          w.what, timed_out ? " timed out" : " failed", " (timeout ", seconds(w.timeout),
          ", waited ", seconds(waited), "): ", msg,
          timed_out
              ? " -- a peer rank probably never joined this collective (it died, hangs, or calls "
                "collectives in a different order)"
              : "");
    }
    w.done = true;
    w.works.clear();
    w.finish = nullptr;
  }
  if (!w.error.empty()) throw DistError(w.error);
}

bool Work::is_completed() const {
  if (!impl_) return true;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->done) return true;
  for (auto& work : impl_->works)
    if (!work->isCompleted()) return false;
  return true;
}

// ---- Communicator -----------------------------------------------------------------------------

namespace {

bool is_fp8(at::ScalarType t) {
  return at::isFloat8Type(t);
}

// fp8 travels as bytes through the engines (neither has an fp8 type of its own).
at::Tensor as_wire(const at::Tensor& t) {
  return is_fp8(t.scalar_type()) ? t.view(at::kByte) : t;
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::Avg:
      return c10d::ReduceOp::AVG;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace

Communicator::Impl& Communicator::self() const {
  COLOSSAL_CHECK(impl_,
                 "this Communicator is not a group this rank belongs to (default-constructed, or "
                 "new_group returned it to a non-member); check valid() before using it");
  return *impl_;
}

int Communicator::rank() const {
  return self().rank;
}
int Communicator::size() const {
  return self().size;
}
const std::string& Communicator::name() const {
  return self().name;
}
Backend Communicator::backend() const {
  return self().kind;
}
const std::vector<int>& Communicator::ranks() const {
  return self().ranks;
}
int Communicator::global_rank(int group_rank) const {
  auto& s = self();
  COLOSSAL_CHECK(group_rank >= 0 && group_rank < s.size, "group rank ", group_rank,
                 " is outside group '", s.name, "' of size ", s.size);
  return s.ranks[group_rank];
}
std::chrono::milliseconds Communicator::timeout() const {
  return self().timeout;
}
void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  auto& s = self();
  COLOSSAL_CHECK(timeout.count() > 0, "timeout of group '", s.name, "' must be positive, got ",
                 timeout.count(), " ms");
  s.timeout = timeout;
  if (s.created()) s.backend->setTimeout(timeout);
}

namespace {

struct Op {
  Communicator::Impl& c;
  std::string what;

  Op(Communicator::Impl& impl, const std::string& name) : c(impl) {
    what = str(name, " on group '", c.name, "' (rank ", c.rank, " of ", c.size, ", global rank ",
               c.world_rank, ", ", to_string(c.kind), ")");
  }

  void check(bool cond, const std::string& msg) const {
    if (!cond) throw Error(str(what, ": ", msg));
  }

  void check_tensor(const at::Tensor& t, const char* role) const {
    check(t.defined(), str(role, " tensor is undefined"));
    check(t.is_contiguous(), str(role, " tensor must be contiguous (call .contiguous() first)"));
    if (c.kind == Backend::Gloo)
      check(t.device().is_cpu(), str(role, " tensor is on ", t.device(),
                                     " but the Gloo communicator takes CPU tensors"));
    else
      check(t.device().is_cuda(), str(role, " tensor is on ", t.device(),
                                      " but the NCCL communicator takes CUDA tensors"));
  }

  void check_reducible(const at::Tensor& t, ReduceOp op) const {
    check(!is_fp8(t.scalar_type()),
          str("cannot reduce ", t.scalar_type(),
              " tensors (fp8 is moved as bytes only); cast to bf16 or fp32 first"));
    check(!(op == ReduceOp::Avg && !at::isFloatingType(t.scalar_type())),
          str("avg of ", t.scalar_type(), " tensors is not defined; use sum and divide yourself"));
  }

  Work finish(std::vector<c10::intrusive_ptr<c10d::Work>> works, bool async_op,
              std::function<void()> after = nullptr) {
    auto w = std::make_shared<Work::Impl>();
    w->works = std::move(works);
    w->finish = std::move(after);
    w->what = what;
    w->timeout = c.timeout;
    w->blocking_wait = c.kind == Backend::Gloo;
    Work work(std::move(w));
    if (!async_op) work.wait();
    return work;
  }

  template <class F>
  c10::intrusive_ptr<c10d::Work> issue(F&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw DistError(str(what, " could not start: ", error_text(e)));
    }
  }
};

}  // namespace

Work Communicator::all_reduce(at::Tensor& tensor, ReduceOp op, bool async_op) {
  auto& c = self();
  Op o(c, str("all_reduce(", to_string(op), ")"));
  o.check_tensor(tensor, "the");
  o.check_reducible(tensor, op);
  bool emulate_avg = op == ReduceOp::Avg && c.kind == Backend::Gloo;
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(emulate_avg ? ReduceOp::Sum : op);
  opts.timeout = c.timeout;
  std::vector<at::Tensor> ts{tensor};
  auto w = o.issue([&] { return c.get()->allreduce(ts, opts); });
  std::function<void()> after;
  if (emulate_avg) after = [t = tensor, n = c.size]() mutable { t.div_(n); };
  return o.finish({w}, async_op, std::move(after));
}

Work Communicator::all_gather(at::Tensor& output, const at::Tensor& input, bool async_op) {
  auto& c = self();
  Op o(c, "all_gather");
  o.check_tensor(input, "input");
  o.check_tensor(output, "output");
  o.check(output.scalar_type() == input.scalar_type(),
          str("output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type()));
  o.check(output.numel() == input.numel() * c.size,
          str("output has ", output.numel(), " elements but needs ", c.size, " x ", input.numel(),
              " (group size x input)"));
  at::Tensor out = as_wire(output).view({-1});
  at::Tensor in = as_wire(input).view({-1});
  c10d::AllgatherOptions opts;
  opts.timeout = c.timeout;
  auto w = o.issue([&] { return c.get()->_allgather_base(out, in, opts); });
  return o.finish({w}, async_op);
}

Work Communicator::reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                  bool async_op) {
  auto& c = self();
  Op o(c, str("reduce_scatter(", to_string(op), ")"));
  o.check_tensor(input, "input");
  o.check_tensor(output, "output");
  o.check_reducible(input, op);
  o.check(output.scalar_type() == input.scalar_type(),
          str("output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type()));
  o.check(input.numel() == output.numel() * c.size,
          str("input has ", input.numel(), " elements but needs ", c.size, " x ", output.numel(),
              " (group size x output)"));
  bool emulate_avg = op == ReduceOp::Avg && c.kind == Backend::Gloo;
  at::Tensor out = output.view({-1});
  at::Tensor in = input.view({-1});
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = to_c10d(emulate_avg ? ReduceOp::Sum : op);
  opts.timeout = c.timeout;
  auto w = o.issue([&] { return c.get()->_reduce_scatter_base(out, in, opts); });
  std::function<void()> after;
  if (emulate_avg) after = [t = output, n = c.size]() mutable { t.div_(n); };
  return o.finish({w}, async_op, std::move(after));
}

Work Communicator::broadcast(at::Tensor& tensor, int src, bool async_op) {
  auto& c = self();
  Op o(c, str("broadcast(src=", src, ")"));
  o.check_tensor(tensor, "the");
  o.check(src >= 0 && src < c.size,
          str("source rank ", src, " is outside the group (size ", c.size, ")"));
  std::vector<at::Tensor> ts{as_wire(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.rootTensor = 0;
  opts.timeout = c.timeout;
  auto w = o.issue([&] { return c.get()->broadcast(ts, opts); });
  return o.finish({w}, async_op);
}

Work Communicator::all_to_all(at::Tensor& output, const at::Tensor& input, bool async_op) {
  auto& c = self();
  Op o(c, "all_to_all");
  o.check_tensor(input, "input");
  o.check_tensor(output, "output");
  o.check(output.sizes() == input.sizes(),
          str("output shape ", output.sizes(), " differs from input shape ", input.sizes(),
              " (equal splits)"));
  o.check(input.dim() >= 1 && input.size(0) % c.size == 0,
          str("dim 0 of shape ", input.sizes(), " is not divisible by the group size ", c.size));
  o.check(output.scalar_type() == input.scalar_type(),
          str("output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type()));
  at::Tensor out = as_wire(output);
  at::Tensor in = as_wire(input);
  std::vector<int64_t> none;
  c10d::AllToAllOptions opts;
  opts.timeout = c.timeout;
  auto w = o.issue([&] { return c.get()->alltoall_base(out, in, none, none, opts); });
  return o.finish({w}, async_op);
}

Work Communicator::all_to_all(at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits, bool async_op) {
  auto& c = self();
  Op o(c, "all_to_all(uneven)");
  o.check_tensor(input, "input");
  o.check_tensor(output, "output");
  o.check(output.scalar_type() == input.scalar_type(),
          str("output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type()));
  o.check(input.dim() >= 1 && output.dim() == input.dim(),
          "input and output need the same number (>= 1) of dims");
  o.check(static_cast<int>(input_splits.size()) == c.size &&
              static_cast<int>(output_splits.size()) == c.size,
          str("needs one split per rank: got ", input_splits.size(), " input and ",
              output_splits.size(), " output splits for group size ", c.size));
  for (int64_t d = 1; d < input.dim(); ++d)
    o.check(input.size(d) == output.size(d),
            str("input shape ", input.sizes(), " and output shape ", output.sizes(),
                " differ beyond dim 0"));
  int64_t in_rows = std::accumulate(input_splits.begin(), input_splits.end(), int64_t{0});
  int64_t out_rows = std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0});
  for (auto s : input_splits) o.check(s >= 0, "negative input split");
  for (auto s : output_splits) o.check(s >= 0, "negative output split");
  o.check(in_rows == input.size(0),
          str("input splits sum to ", in_rows, " rows but input has ", input.size(0)));
  o.check(out_rows == output.size(0),
          str("output splits sum to ", out_rows, " rows but output has ", output.size(0)));
  at::Tensor out = as_wire(output);
  at::Tensor in = as_wire(input);
  std::vector<int64_t> os = output_splits, is = input_splits;
  c10d::AllToAllOptions opts;
  opts.timeout = c.timeout;
  auto w = o.issue([&] { return c.get()->alltoall_base(out, in, os, is, opts); });
  return o.finish({w}, async_op);
}

Work Communicator::send(const at::Tensor& tensor, int dst, int tag, bool async_op) {
  return batch_p2p({P2POp::send(tensor, dst, tag)}, async_op);
}

Work Communicator::recv(at::Tensor& tensor, int src, int tag, bool async_op) {
  return batch_p2p({P2POp::recv(tensor, src, tag)}, async_op);
}

Work Communicator::batch_p2p(const std::vector<P2POp>& ops, bool async_op) {
  auto& c = self();
  std::string name =
      ops.size() == 1
          ? str(ops[0].kind == P2POp::Kind::Send ? "send(dst=" : "recv(src=", ops[0].peer,
                ", tag=", ops[0].tag, ")")
          : str("batch_p2p(", ops.size(), " ops)");
  Op o(c, name);
  for (const auto& op : ops) {
    o.check_tensor(op.tensor, op.kind == P2POp::Kind::Send ? "send" : "recv");
    o.check(op.peer >= 0 && op.peer < c.size && op.peer != c.rank,
            str("peer ", op.peer, " must be another rank of the group (size ", c.size,
                ", this rank ", c.rank, ")"));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  bool coalesce = c.kind == Backend::Nccl && ops.size() > 1;
  if (coalesce) c.get()->startCoalescing();
  try {
    for (const auto& op : ops) {
      std::vector<at::Tensor> ts{as_wire(op.tensor)};
      auto w = o.issue([&] {
        return op.kind == P2POp::Kind::Send ? c.get()->send(ts, op.peer, op.tag)
                                            : c.get()->recv(ts, op.peer, op.tag);
      });
      if (!coalesce) works.push_back(w);
    }
  } catch (...) {
    if (coalesce) c.get()->endCoalescing();
    throw;
  }
  if (coalesce) works.push_back(o.issue([&] { return c.get()->endCoalescing(); }));
  return o.finish(std::move(works), async_op);
}

void Communicator::barrier() {
  auto& c = self();
  Op o(c, "barrier");
  c10d::BarrierOptions opts;
  opts.timeout = c.timeout;
  auto w = o.issue([&] { return c.get()->barrier(opts); });
  o.finish({w}, false);
}

Communicator Communicator::new_group(const std::vector<int>& global_ranks,
                                     const std::string& name) const {
  auto& c = self();
  return make_communicator(c.store, c.kind, name, global_ranks, c.world_rank, c.timeout,
                           /*lazy=*/true);
}

// ---- construction -----------------------------------------------------------------------------

namespace {
std::mutex g_groups_mu;
std::map<std::string, int> g_group_counts;  // how often this process created each (name, members)
}  // namespace

Communicator make_communicator(const c10::intrusive_ptr<c10d::Store>& store, Backend kind,
                               const std::string& name, const std::vector<int>& global_ranks,
                               int world_rank, std::chrono::milliseconds timeout, bool lazy) {
  COLOSSAL_CHECK(!global_ranks.empty(), "group '", name, "' has no ranks");
  std::string members;
  int my_rank = -1;
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    int r = global_ranks[i];
    COLOSSAL_CHECK(r >= 0, "group '", name, "' lists the negative rank ", r);
    for (size_t j = 0; j < i; ++j)
      COLOSSAL_CHECK(global_ranks[j] != r, "group '", name, "' lists rank ", r, " twice");
    if (r == world_rank) my_rank = static_cast<int>(i);
    members += (i ? "," : "") + std::to_string(r);
  }
  if (my_rank < 0) return Communicator();
  // Keys of every group live under their own prefix, so groups never see each other's
  // rendezvous; the count keeps a re-created group (same name, same members) apart as well.
  std::string key = name + "[" + members + "]";
  int count;
  {
    std::lock_guard<std::mutex> lock(g_groups_mu);
    count = g_group_counts[key]++;
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(str("colossal/", key, "/", count), store);
  auto impl = std::make_shared<Communicator::Impl>();
  impl->store = store;
  impl->kind = kind;
  impl->name = name;
  impl->rank = my_rank;
  impl->size = static_cast<int>(global_ranks.size());
  impl->world_rank = world_rank;
  impl->ranks = global_ranks;
  impl->timeout = timeout;
  Communicator::Impl* raw = impl.get();
  impl->factory = [raw, prefixed]() {
    log_debug("dist: connecting ", to_string(raw->kind), " group '", raw->name, "' as rank ",
              raw->rank);
    return raw->kind == Backend::Gloo
               ? detail::make_gloo_backend(prefixed, raw->rank, raw->size, raw->timeout, raw->name)
               : detail::make_nccl_backend(prefixed, raw->rank, raw->size, raw->timeout, raw->name);
  };
  if (!lazy) impl->get();
  log_debug("dist: created ", to_string(kind), " group '", name, "' [", members, "] as rank ",
            my_rank);
  return Communicator(std::move(impl));
}

}  // namespace colossal::dist
