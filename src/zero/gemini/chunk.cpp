// Gemini chunk: flat storage, shard, gather/release with parameter re-pointing, legal tensor
// state transitions, gradient buffer and its reduction.
#include "colossal/zero/gemini/chunk.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <limits>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/dist/fp8_collectives.h"

namespace colossal::zero::gemini {

const char* to_string(TensorState s) {
  switch (s) {
    case TensorState::Free:
      return "FREE";
    case TensorState::Compute:
      return "COMPUTE";
    case TensorState::Hold:
      return "HOLD";
    case TensorState::HoldAfterBwd:
      return "HOLD_AFTER_BWD";
    case TensorState::ReadyForReduce:
      return "READY_FOR_REDUCE";
  }
  return "?";
}

const char* to_string(Place p) {
  return p == Place::Device ? "device" : "host";
}

bool legal_transition(TensorState from, TensorState to) {
  using S = TensorState;
  switch (from) {
    case S::Free:
      return to == S::Hold || to == S::Compute;
    case S::Hold:
      return to == S::Compute || to == S::Free || to == S::HoldAfterBwd;
    case S::Compute:
      return to == S::Hold || to == S::HoldAfterBwd;
    case S::HoldAfterBwd:
      return to == S::Compute || to == S::ReadyForReduce;
    case S::ReadyForReduce:
      return to == S::Hold;
  }
  return false;
}

CopyStream::CopyStream(at::Device device)
    : device_(device), side_(Accelerator::cuda().new_stream(device.index())) {
  COLOSSAL_CHECK(device.is_cuda(), "CopyStream: ", device, " is not a CUDA device");
}

CopyStream::~CopyStream() = default;

std::unique_ptr<Event> CopyStream::copy(at::Tensor& dst, const at::Tensor& src) {
  Accelerator& acc = Accelerator::cuda();
  const c10::Stream compute = acc.current_stream(device_.index());
  auto ready = acc.new_event();
  ready->record(compute);
  ready->block(side_);
  acc.set_stream(side_);
  try {
    dst.copy_(src, /*non_blocking=*/true);
  } catch (...) {
    acc.set_stream(compute);
    throw;
  }
  acc.set_stream(compute);
  if (src.is_cuda()) src.record_stream(side_);
  auto done = acc.new_event();
  done->record(side_);
  return done;
}

void CopyStream::wait_on_compute(Event& done) {
  done.block(Accelerator::cuda().current_stream(device_.index()));
}

void CopyStream::synchronize() {
  auto e = Accelerator::cuda().new_event();
  e->record(side_);
  e->synchronize();
}

Chunk::Chunk(int id, int64_t size, at::ScalarType dtype, at::Device device, bool sharded,
             dist::Communicator comm)
    : id_(id),
      size_(size),
      dtype_(dtype),
      device_(device),
      sharded_(sharded),
      comm_(std::move(comm)) {
  if (sharded_ && comm_.valid() && comm_.size() > 1) {
    shards_ = comm_.size();
    shard_index_ = comm_.rank();
  }
  COLOSSAL_CHECK(size_ > 0 && size_ % shards_ == 0, "gemini chunk ", id_, ": size ", size_,
                 " is not a positive multiple of the ", shards_, " shards");
  placeholder_ = at::full({1}, std::numeric_limits<double>::quiet_NaN(),
                          at::TensorOptions().dtype(dtype_).device(device_));
}

int Chunk::num_grad_tensors() const {
  int n = 0;
  for (const auto& t : tensors_) n += t.requires_grad ? 1 : 0;
  return n;
}

std::string Chunk::describe(size_t k) const {
  return str("gemini chunk ", id_, " parameter '", tensors_[k].name, "'");
}

void Chunk::append(const std::string& name, const at::Tensor& param) {
  COLOSSAL_CHECK(!shard_.defined(), "gemini chunk ", id_, " is finalized; cannot append '", name,
                 "'");
  COLOSSAL_CHECK(param.scalar_type() == dtype_, "gemini chunk ", id_, " holds ", dtype_,
                 ", parameter '", name, "' is ", param.scalar_type());
  COLOSSAL_CHECK(fits(param.numel()), "gemini chunk ", id_, " (", size_, " elements, ", used_,
                 " used) cannot hold '", name, "' (", param.numel(), ")");
  ChunkTensor t;
  t.name = name;
  t.param = param;
  t.offset = used_;
  t.numel = param.numel();
  t.requires_grad = param.requires_grad();
  t.state = TensorState::Hold;
  used_ += t.numel;
  tensors_.push_back(std::move(t));
}

void Chunk::finalize() {
  c10::NoGradGuard no_grad;
  full_ = at::zeros({size_}, at::TensorOptions().dtype(dtype_).device(device_));
  for (auto& t : tensors_) full_.narrow(0, t.offset, t.numel).copy_(t.param.detach().reshape({-1}));
  shard_ = sharded_ && shards_ > 1 ? full_.narrow(0, shard_begin(), shard_size()).clone() : full_;
  point_params_at_full();
}

void Chunk::point_params_at_full() {
  for (auto& t : tensors_)
    t.param.set_data(full_.narrow(0, t.offset, t.numel).view(t.param.sizes()));
}

void Chunk::point_params_at_placeholder() {
  for (auto& t : tensors_)
    t.param.set_data(t.param.dim() == 0 ? placeholder_.reshape({})
                                        : placeholder_.expand(t.param.sizes()));
}

void Chunk::set_state(size_t k, TensorState to) {
  ChunkTensor& t = tensors_.at(k);
  if (t.state == to) return;
  COLOSSAL_CHECK(legal_transition(t.state, to), describe(k), ": illegal state transition ",
                 to_string(t.state), " -> ", to_string(to));
  t.state = to;
}

void Chunk::set_all(TensorState from, TensorState to) {
  for (size_t k = 0; k < tensors_.size(); ++k)
    if (tensors_[k].state == from) set_state(k, to);
}

void Chunk::start_gather(bool exact) {
  if (full_.defined() || pending_) return;
  c10::NoGradGuard no_grad;
  if (shards_ == 1) {  // one rank, parameters on the host: a copy up, no collective
    if (mover_) {
      full_ = at::empty({size_}, at::TensorOptions().dtype(dtype_).device(device_));
      up_done_ = mover_->copy(full_, shard_);
    } else {
      full_ = shard_.to(device_, dtype_, /*non_blocking=*/true, /*copy=*/true);
    }
    h2d_bytes_ += shard_bytes();
    pending_ = true;
    return;
  }
  full_ = at::empty({size_}, at::TensorOptions().dtype(dtype_).device(device_));
  gather_src_ = shard_.device() == device_ ? shard_ : shard_.to(device_, /*non_blocking=*/true);
  if (param_place_ == Place::Host) h2d_bytes_ += shard_bytes();
  full_fp8_ = fp8_ && !exact;
  gather_work_ = full_fp8_
                     ? dist::all_gather_fp8(comm_, full_, gather_src_, at::kFloat8_e4m3fn, true)
                     : comm_.all_gather(full_, gather_src_, /*async_op=*/true);
  pending_ = true;
}

void Chunk::make_exact() {
  if (!full_fp8_) return;
  wait_gather();
  c10::NoGradGuard no_grad;
  at::Tensor src = shard_.device() == device_ ? shard_ : shard_.to(device_);
  comm_.all_gather(full_, src);
  full_fp8_ = false;
}

void Chunk::wait_gather() {
  if (!pending_) return;
  pending_ = false;
  if (up_done_) {
    mover_->wait_on_compute(*up_done_);
    up_done_.reset();
  }
  gather_work_.wait();
  gather_work_ = dist::Work();
  gather_src_ = at::Tensor();
  point_params_at_full();
  set_all(TensorState::Free, TensorState::Hold);
}

void Chunk::release(bool write_back) {
  if (!releasable()) return;  // the full buffer is the shard
  wait_gather();
  if (!full_.defined()) return;
  for (size_t k = 0; k < tensors_.size(); ++k)
    COLOSSAL_CHECK(tensors_[k].state == TensorState::Hold || tensors_[k].state == TensorState::Free,
                   describe(k), ": cannot release the chunk while the parameter is ",
                   to_string(tensors_[k].state));
  if (write_back) {
    c10::NoGradGuard no_grad;
    shard_.copy_(full_.narrow(0, shard_begin(), shard_size()));
  }
  set_all(TensorState::Hold, TensorState::Free);
  point_params_at_placeholder();
  full_ = at::Tensor();
  full_fp8_ = false;
}

void Chunk::move_param_shard(Place to) {
  if (to == param_place_) return;
  if (!sharded_) {  // replicated: its shard is its compute buffer, on the device
    param_place_ = to;
    return;
  }
  c10::NoGradGuard no_grad;
  wait_gather();
  (to == Place::Host ? d2h_bytes_ : h2d_bytes_) += shard_bytes();
  const at::Device d = to == Place::Device ? device_ : at::Device(at::kCPU);
  if (shards_ > 1) {
    shard_ = to == Place::Host && device_.is_cuda() ? to_pinned(shard_) : shard_.to(d);
    param_place_ = to;
    return;
  }
  // One rank: the shard is the whole chunk.
  for (size_t k = 0; k < tensors_.size(); ++k)
    COLOSSAL_CHECK(tensors_[k].state == TensorState::Hold || tensors_[k].state == TensorState::Free,
                   describe(k), ": cannot move the chunk while the parameter is ",
                   to_string(tensors_[k].state));
  if (to == Place::Host) {
    const at::Tensor& src = full_.defined() ? full_ : shard_;
    shard_ = device_.is_cuda() ? to_pinned(src) : src.to(d, dtype_, false, /*copy=*/true);
    param_place_ = Place::Host;
    if (full_.defined()) {
      set_all(TensorState::Hold, TensorState::Free);
      point_params_at_placeholder();
      full_ = at::Tensor();
    }
  } else {
    param_place_ = Place::Device;
    if (full_.defined()) {
      shard_ = full_;  // the gathered buffer (possibly written from outside) is current
    } else {
      shard_ = shard_.to(d, dtype_, false, /*copy=*/true);
      full_ = shard_;
      point_params_at_full();
      set_all(TensorState::Free, TensorState::Hold);
    }
  }
}

void Chunk::add_grad(size_t k, const at::Tensor& grad) {
  ChunkTensor& t = tensors_.at(k);
  COLOSSAL_CHECK(grad.numel() == t.numel, describe(k), ": gradient has ", grad.numel(),
                 " elements, expected ", t.numel);
  c10::NoGradGuard no_grad;
  if (!grad_full_.defined())
    grad_full_ = at::zeros({size_}, at::TensorOptions().dtype(dtype_).device(device_));
  at::Tensor dst = grad_full_.narrow(0, t.offset, t.numel);
  if (t.grad_ready)
    dst.add_(grad.reshape({-1}));
  else
    dst.copy_(grad.reshape({-1}));
  t.grad_ready = true;
}

bool Chunk::grad_complete() const {
  for (const auto& t : tensors_)
    if (t.requires_grad && !t.grad_ready) return false;
  return num_grad_tensors() > 0;
}

at::Tensor Chunk::reduce_grad(c10::optional<at::ScalarType> comm_dtype) {
  PendingReduce r = reduce_grad_async(comm_dtype);
  r.work.wait();
  return r.out;
}

Chunk::PendingReduce Chunk::reduce_grad_async(c10::optional<at::ScalarType> comm_dtype) {
  c10::NoGradGuard no_grad;
  at::ScalarType dt = comm_dtype ? *comm_dtype : dtype_;
  PendingReduce r;
  r.in = grad_full_.defined()
             ? grad_full_
             : at::zeros({size_}, at::TensorOptions().dtype(dtype_).device(device_));
  if (r.in.scalar_type() != dt) r.in = r.in.to(dt);
  grad_full_ = at::Tensor();
  for (auto& t : tensors_) t.grad_ready = false;
  const int W = comm_.valid() ? comm_.size() : 1;
  if (W == 1) {
    r.out = r.in;
  } else if (shards_ > 1) {
    r.out = at::empty({shard_size()}, r.in.options());
    r.work = fp8_ ? dist::reduce_scatter_fp8(comm_, r.out, r.in, at::kFloat8_e5m2,
                                             dist::ReduceOp::Avg, /*async_op=*/true)
                  : comm_.reduce_scatter(r.out, r.in, dist::ReduceOp::Avg, /*async_op=*/true);
  } else {
    r.out = r.in;
    // FP8: the all-gather phase is issued when the Work is waited for; the manager waits for
    // its reductions in launch order on every rank.
    r.work = fp8_ ? dist::all_reduce_fp8(comm_, r.out, at::kFloat8_e5m2, dist::ReduceOp::Avg,
                                         /*async_op=*/true)
                  : comm_.all_reduce(r.out, dist::ReduceOp::Avg, /*async_op=*/true);
  }
  return r;
}

int64_t Chunk::shard_bytes() const {
  return shard_size() * static_cast<int64_t>(c10::elementSize(dtype_));
}

int64_t Chunk::full_bytes() const {
  if (!full_.defined() || full_.is_same(shard_)) return 0;
  return size_ * static_cast<int64_t>(c10::elementSize(dtype_));
}

}  // namespace colossal::zero::gemini
