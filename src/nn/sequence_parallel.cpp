// Sequence sharding of the inputs, Ulysses (all-to-all) attention and zigzag ring attention
// (sequence_parallel.h).
#include "colossal/nn/sequence_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/kernels/attention.h"
#include "colossal/kernels/attention_merge.h"
#include "colossal/nn/parallel_ops.h"

namespace colossal::nn {

// ---- Sharding the inputs ------------------------------------------------------------------
at::Tensor sequence_positions(int64_t seq_len, int64_t rank, int64_t world,
                              dist::SequenceParallel mode) {
  COLOSSAL_CHECK_INPUT(world >= 1 && rank >= 0 && rank < world, "sequence_positions: rank ", rank,
                       " of ", world, " ranks");
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  if (world == 1 ||
      (mode != dist::SequenceParallel::AllToAll && mode != dist::SequenceParallel::RingAttn))
    return at::arange(seq_len, i64);
  if (mode == dist::SequenceParallel::AllToAll) {
    COLOSSAL_CHECK_INPUT(seq_len % world == 0, "sequence parallelism all_to_all: sequence length ",
                         seq_len, " is not divisible by the sequence parallel size sp = ", world);
    const int64_t n = seq_len / world;
    return at::arange(rank * n, (rank + 1) * n, i64);
  }
  COLOSSAL_CHECK_INPUT(
      seq_len % (2 * world) == 0, "sequence parallelism ring_attn: sequence length ", seq_len,
      " is not divisible by 2*sp = ", 2 * world, " (the zigzag layout cuts it into 2*sp chunks)");
  const int64_t c = seq_len / (2 * world);
  return at::cat({at::arange(rank * c, (rank + 1) * c, i64),
                  at::arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, i64)});
}

SequenceShard shard_sequence(const at::Tensor& input, const at::Tensor& targets,
                             const dist::Communicator& sp, dist::SequenceParallel mode) {
  COLOSSAL_CHECK_INPUT(input.dim() >= 2, "shard_sequence: input must be [batch, seq, ...], got ",
                       input.sizes());
  COLOSSAL_CHECK_INPUT(!targets.defined() || targets.sizes() == input.sizes().slice(0, 2),
                       "shard_sequence: targets ", targets.sizes(), " do not match input ",
                       input.sizes());
  const int64_t world = sp.valid() ? sp.size() : 1, rank = sp.valid() ? sp.rank() : 0;
  SequenceShard out;
  out.positions = sequence_positions(input.size(1), rank, world, mode);
  if (out.positions.size(0) == input.size(1)) {
    out.input = input;
    out.targets = targets;
    return out;
  }
  at::Tensor idx = out.positions.to(input.device());
  out.input = input.index_select(1, idx);
  if (targets.defined()) out.targets = targets.index_select(1, out.positions.to(targets.device()));
  return out;
}

// ---- Ulysses ------------------------------------------------------------------------------
namespace {

void check_no_mask(const AttentionMask& mask, const SequenceInfo& seq, const char* mode) {
  COLOSSAL_CHECK_INPUT(!mask.mask.defined(), "sequence parallelism ", mode,
                       " takes no explicit attention mask (padding, sliding window or KV cache)");
  COLOSSAL_CHECK_INPUT(!mask.documents.defined(), "sequence parallelism ", mode,
                       " does not keep attention inside packed documents (--doc_mask); train "
                       "with sp_size 1 or without --doc_mask");
  COLOSSAL_CHECK_INPUT(seq.past == 0, "sequence parallelism ", mode, " takes no KV cache (",
                       seq.past, " cached tokens)");
}

}  // namespace

AllToAllAttention::AllToAllAttention(dist::Communicator sp, std::shared_ptr<CoreAttention> in)
    : sp_(std::move(sp)) {
  COLOSSAL_CHECK_INPUT(sp_.valid(), "AllToAllAttention needs a sequence parallel group");
  register_slot<CoreAttention>("inner", inner,
                               in ? std::move(in) : std::make_shared<SdpaAttention>());
}

at::Tensor AllToAllAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const AttentionMask& mask, const SequenceInfo& seq) {
  ForwardScope scope(*this);
  check_no_mask(mask, seq, "all_to_all");
  const int64_t sp = sp_.size(), h = q.size(1), hkv = k.size(1);
  COLOSSAL_CHECK_INPUT(h % sp == 0, "sequence parallelism all_to_all: ", h,
                       " attention heads (per tensor-parallel rank) are not divisible by the "
                       "sequence parallel size sp = ",
                       sp);
  COLOSSAL_CHECK_INPUT(hkv > 0 && h % hkv == 0, "all_to_all attention: ", h,
                       " query heads are not a multiple of ", hkv, " key/value heads");
  at::Tensor kk = k, vv = v;
  if (hkv % sp != 0) {
    // Key/value heads cannot be split over sp: repeat each over its query group first, so rank j
    // receives the key/value heads of its query heads (H heads travel instead of Hkv).
    kk = k.repeat_interleave(h / hkv, 1);
    vv = v.repeat_interleave(h / hkv, 1);
  }
  // Split heads and gather the sequence: [B, H/sp, S, D]. With Hkv divisible by sp, query heads
  // [j*H/sp, (j+1)*H/sp) and key/value heads [j*Hkv/sp, (j+1)*Hkv/sp) land on rank j together.
  at::Tensor qg = all_to_all_region(q, sp_, 1, 2);
  at::Tensor kg = all_to_all_region(kk, sp_, 1, 2);
  at::Tensor vg = all_to_all_region(vv, sp_, 1, 2);
  SequenceInfo whole;
  whole.local_len = whole.global_len = qg.size(2);
  at::Tensor out = inner->forward(qg, kg, vg, mask, whole);
  return all_to_all_region(out, sp_, 2, 1);  // back to this rank's tokens of every head
}

// ---- Ring attention -----------------------------------------------------------------------
void check_inner_ring_size(int64_t inner_ring_size, int64_t sp_size) {
  COLOSSAL_CHECK_INPUT(
      inner_ring_size == 0 ||
          (inner_ring_size > 1 && inner_ring_size < sp_size && sp_size % inner_ring_size == 0),
      "ring_attn: inner_ring_size ", inner_ring_size,
      " must be 0 (one ring) or a divisor of the sequence parallel size sp = ", sp_size,
      " between 1 and sp (exclusive)");
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kTagInnerKV = 41, kTagInnerGrad = 42, kTagOuterKV = 43, kTagOuterGrad = 44;

// The two-level ring: rank r = g*I + i sits at place i of inner ring g (I consecutive ranks);
// the outer ring joins the ranks of the same place across the G inner rings. One ring: I = sp.
struct Ring {
  dist::Communicator group;
  int64_t size = 1, inner = 1, outer = 1, rank = 0;
  bool causal = true;

  int64_t g() const { return rank / inner; }
  int64_t i() const { return rank % inner; }
  int inner_next() const { return static_cast<int>(g() * inner + (i() + 1) % inner); }
  int inner_prev() const { return static_cast<int>(g() * inner + (i() + inner - 1) % inner); }
  int outer_next() const { return static_cast<int>(((g() + 1) % outer) * inner + i()); }
  int outer_prev() const { return static_cast<int>(((g() + outer - 1) % outer) * inner + i()); }
  // Whose keys/values this rank holds at outer step o, inner step t.
  int64_t owner(int64_t o, int64_t t) const {
    return ((g() - o + outer) % outer) * inner + (i() - t + inner) % inner;
  }

  // Sends `send` to `to`, receives a tensor like it from `from` into `recv` (asynchronously).
  dist::Work exchange(const at::Tensor& send, at::Tensor& recv, int to, int from, int tag) const {
    recv = at::empty_like(send);
    return const_cast<dist::Communicator&>(group).batch_p2p(
        {dist::P2POp::send(send, to, tag), dist::P2POp::recv(recv, from, tag)}, true);
  }
};

struct RingSaved : torch::CustomClassHolder {
  RingSaved(Ring r, RingBlockKernel k, bool det)
      : ring(std::move(r)), kernel(k), deterministic(det) {}
  Ring ring;
  RingBlockKernel kernel;  // chosen at the forward, kept for its backward
  bool deterministic;
};

// Which rows of this rank's queries attend to which rows of the block of rank `src` (both in the
// zigzag layout [chunk r; chunk 2P-1-r], c tokens each), and whether causally:
//   src == r   every query, every key, causal (local order is global order);
//   src <  r   every query, the first chunk (src) only: chunk 2P-1-src lies after both of ours;
//   src >  r   the second chunk (2P-1-r) only, every key: chunk r lies before both of theirs.
// Every block but the diagonal is c x 2c: the causal work is the same on every rank.
struct Part {
  int64_t q0, qn, k0, kn;
  bool causal;
};
Part part_of(const Ring& ring, int64_t src, int64_t c) {
  if (!ring.causal) return {0, 2 * c, 0, 2 * c, false};
  if (src == ring.rank) return {0, 2 * c, 0, 2 * c, true};
  if (src < ring.rank) return {0, 2 * c, 0, c, false};
  return {c, c, 0, 2 * c, false};
}

// Key/value heads repeated over their query groups, and the gradient summed back.
at::Tensor expand_heads(const at::Tensor& x, int64_t groups) {
  return groups == 1 ? x : x.repeat_interleave(groups, 1);
}
at::Tensor reduce_heads(const at::Tensor& x, int64_t groups) {
  return groups == 1 ? x : x.unflatten(1, {x.size(1) / groups, groups}).sum(2);
}

at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (causal) {
    at::Tensor upper = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu_(1);
    s.masked_fill_(upper, -std::numeric_limits<float>::infinity());
  }
  return s;
}

// Float32 zeros shaped as `like` [B, heads, n, D], stored [B, n, heads, D]-contiguous (the
// ring's storage order).
at::Tensor tokens_major_zeros(const at::Tensor& like) {
  return at::zeros({like.size(0), like.size(2), like.size(1), like.size(3)},
                   like.options().dtype(at::kFloat))
      .transpose(1, 2);
}

// k and v stacked tokens-major, [2, B, S, Hkv, D] contiguous (what travels), and the
// [2, B, Hkv, S, D] view of it that the blocks read.
at::Tensor kv_stack(const at::Tensor& k, const at::Tensor& v) {
  return at::stack({k.transpose(1, 2), v.transpose(1, 2)});
}
at::Tensor kv_view(const at::Tensor& stacked) {
  return stacked.transpose(2, 3);
}

struct RingAttnFn : torch::autograd::Function<RingAttnFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::intrusive_ptr<RingSaved>& saved) {
    const Ring& ring = saved->ring;
    const int64_t len = q.size(2), c = len / 2;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const RingBlockKernel kernel = saved->kernel;
    // The composite casts the queries once here rather than in every block.
    const at::Tensor qin = kernel == RingBlockKernel::composite ? q.to(at::kFloat) : q;
    at::Tensor out = tokens_major_zeros(q);
    at::Tensor lse = at::full({q.size(0), q.size(1), len}, -std::numeric_limits<float>::infinity(),
                              out.options());
    auto compute = [&](int64_t src, const at::Tensor& stacked) {
      const Part p = part_of(ring, src, c);
      const at::Tensor kv = kv_view(stacked);
      ring_block_forward(kernel, qin.narrow(2, p.q0, p.qn), kv[0].narrow(2, p.k0, p.kn),
                         kv[1].narrow(2, p.k0, p.kn), p.causal, scale, out.narrow(2, p.q0, p.qn),
                         lse.narrow(2, p.q0, p.qn));
    };
    // The first block is this rank's own (the diagonal): every row gets a finite lse at once.
    at::Tensor outer_kv = kv_stack(k, v);
    for (int64_t o = 0; o < ring.outer; ++o) {
      dist::Work outer_work;
      at::Tensor outer_recv;
      if (o + 1 < ring.outer)
        outer_work =
            ring.exchange(outer_kv, outer_recv, ring.outer_next(), ring.outer_prev(), kTagOuterKV);
      at::Tensor cur = outer_kv;
      for (int64_t t = 0; t < ring.inner; ++t) {
        dist::Work inner_work;
        at::Tensor inner_recv;
        if (t + 1 < ring.inner)  // the next block travels while this one is computed
          inner_work =
              ring.exchange(cur, inner_recv, ring.inner_next(), ring.inner_prev(), kTagInnerKV);
        compute(ring.owner(o, t), cur);
        if (t + 1 < ring.inner) {
          inner_work.wait();
          cur = inner_recv;
        }
      }
      if (o + 1 < ring.outer) {
        outer_work.wait();
        outer_kv = outer_recv;
      }
    }
    at::Tensor result = out.to(q.scalar_type());  // keeps out's tokens-major strides
    ctx->saved_data["ring"] = c10::IValue::make_capsule(saved);
    // The kernels' backward reads the output as the forward returned it; the composite keeps
    // the fp32 merge.
    ctx->save_for_backward({q, k, v, kernel == RingBlockKernel::composite ? out : result, lse});
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = c10::static_intrusive_pointer_cast<RingSaved>(ctx->saved_data["ring"].toCapsule());
    const Ring& ring = saved->ring;
    const RingBlockKernel kernel = saved->kernel;
    auto vars = ctx->get_saved_variables();
    const at::Tensor &q = vars[0], &k = vars[1], &v = vars[2], &out = vars[3], &lse = vars[4];
    const int64_t len = q.size(2), c = len / 2;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const bool composite = kernel == RingBlockKernel::composite;
    const at::Tensor qin = composite ? q.to(at::kFloat) : q;
    // As it comes (o_proj's gradient is tokens-major already): the blocks read it in place.
    const at::Tensor dout = grads[0].to(composite ? at::kFloat : q.scalar_type());
    at::Tensor dq = tokens_major_zeros(q);
    // Adds the gradient of the block of rank src to dq and to that block's accumulator.
    auto compute = [&](int64_t src, const at::Tensor& stacked, const at::Tensor& grad) {
      const Part p = part_of(ring, src, c);
      const at::Tensor kv = kv_view(stacked), dkv = kv_view(grad);
      ring_block_backward(
          kernel, dout.narrow(2, p.q0, p.qn), qin.narrow(2, p.q0, p.qn),
          kv[0].narrow(2, p.k0, p.kn), kv[1].narrow(2, p.k0, p.kn), out.narrow(2, p.q0, p.qn),
          lse.narrow(2, p.q0, p.qn), p.causal, scale,
          {dq.narrow(2, p.q0, p.qn), dkv[0].narrow(2, p.k0, p.kn), dkv[1].narrow(2, p.k0, p.kn)},
          saved->deterministic);
    };
    // Keys/values go around as in forward; each block's gradient accumulator travels with it
    // and, after one more hop, is back at the rank that owns the block: inner rings first
    // (the inner ring's sum arrives at the rank that got the block from the outer ring), then
    // the outer ring carries the sum over the inner rings home.
    const at::TensorOptions f32 = q.options().dtype(at::kFloat);
    at::Tensor outer_kv = kv_stack(k, v);
    at::Tensor outer_grad = at::zeros(outer_kv.sizes(), f32);
    for (int64_t o = 0; o < ring.outer; ++o) {
      dist::Work outer_work;
      at::Tensor outer_recv;
      if (o + 1 < ring.outer)
        outer_work =
            ring.exchange(outer_kv, outer_recv, ring.outer_next(), ring.outer_prev(), kTagOuterKV);
      at::Tensor cur = outer_kv;
      at::Tensor grad = at::zeros(outer_kv.sizes(), f32);
      for (int64_t t = 0; t < ring.inner; ++t) {
        dist::Work inner_work;
        at::Tensor inner_recv;
        if (t + 1 < ring.inner)
          inner_work =
              ring.exchange(cur, inner_recv, ring.inner_next(), ring.inner_prev(), kTagInnerKV);
        compute(ring.owner(o, t), cur, grad);
        if (ring.inner > 1) {
          at::Tensor grad_recv;
          ring.exchange(grad, grad_recv, ring.inner_next(), ring.inner_prev(), kTagInnerGrad)
              .wait();
          grad = grad_recv;
        }
        if (t + 1 < ring.inner) {
          inner_work.wait();
          cur = inner_recv;
        }
      }
      outer_grad.add_(grad);  // this inner ring's part of the gradient of block owner(o, 0)
      if (ring.outer > 1) {
        at::Tensor grad_recv;
        ring.exchange(outer_grad, grad_recv, ring.outer_next(), ring.outer_prev(), kTagOuterGrad)
            .wait();
        outer_grad = grad_recv;
      }
      if (o + 1 < ring.outer) {
        outer_work.wait();
        outer_kv = outer_recv;
      }
    }
    const at::Tensor dkv = kv_view(outer_grad);
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const dist::Communicator& sp, bool causal, int64_t inner_ring_size,
                          bool deterministic) {
  COLOSSAL_CHECK_INPUT(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                           q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                           q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                       "ring_attn: q [B, H, S, D] and k/v [B, Hkv, S, D] with Hkv dividing H "
                       "expected, got q ",
                       q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  COLOSSAL_CHECK_INPUT(q.size(2) % 2 == 0, "ring_attn: the local sequence length ", q.size(2),
                       " must be even (two zigzag chunks per rank)");
  Ring ring;
  ring.group = sp;
  ring.size = sp.valid() ? sp.size() : 1;
  ring.rank = sp.valid() ? sp.rank() : 0;
  check_inner_ring_size(inner_ring_size, ring.size);
  ring.inner = inner_ring_size > 0 ? inner_ring_size : ring.size;
  ring.outer = ring.size / ring.inner;
  ring.causal = causal;
  // Logged by rank 0 at the first forward of the process and whenever the kernel changes (not
  // once per layer: every layer holds its own RingAttention).
  static std::atomic<int> last_logged{-1};
  const RingBlockKernel kernel = ring_block_kernel(q, deterministic);
  if (last_logged.exchange(static_cast<int>(kernel)) != static_cast<int>(kernel) && ring.rank == 0)
    log_info("ring_attn: blocks computed by the ", to_string(kernel), " kernel (", q.device(), ", ",
             q.scalar_type(), ", head dim ", q.size(3), ")");
  return RingAttnFn::apply(q, k, v,
                           c10::make_intrusive<RingSaved>(std::move(ring), kernel, deterministic));
}

// ---- One block of ring attention --------------------------------------------------------------
namespace {

// Why ATen's flash kernels do not take q ("" when they do).
std::string flash_unsupported(const at::Tensor& q) {
  if (!q.is_cuda()) return "not on a CUDA device";
  const auto dt = q.scalar_type();
  if (dt != at::kHalf && dt != at::kBFloat16) return "not fp16 or bf16";
  if (q.size(-1) % 8 != 0 || q.size(-1) > 256) return "head dim not a multiple of 8 up to 256";
  static const std::vector<CudaDeviceInfo> devices = cuda_devices();
  const int idx = q.device().has_index() ? q.device().index() : 0;
  if (idx < 0 || idx >= static_cast<int>(devices.size()) ||
      devices[static_cast<size_t>(idx)].major < 8)
    return "a GPU older than compute capability 8.0";
  return "";
}

// Why our kernels do not take q ("" when they do).
std::string own_unsupported(const at::Tensor& q) {
  return q.dim() == 4 ? kernels::own_attention_unsupported(q.select(0, 0), q.select(0, 0))
                      : "q is not [B, H, n, D]";
}

}  // namespace

RingBlockKernel ring_block_kernel(const at::Tensor& q, bool deterministic) {
  const char* env = std::getenv("COLOSSAL_RING_BLOCKS");
  const std::string setting = env == nullptr ? "" : env;
  COLOSSAL_CHECK_INPUT(setting.empty() || setting == "auto" || setting == "own" ||
                           setting == "flash" || setting == "composite",
                       "COLOSSAL_RING_BLOCKS must be auto, own, flash or composite, got '", setting,
                       "'");
  if (setting == "composite") return RingBlockKernel::composite;
  const std::string own = own_unsupported(q), flash = flash_unsupported(q);
  COLOSSAL_CHECK_INPUT(setting != "own" || own.empty(),
                       "COLOSSAL_RING_BLOCKS=own, but our kernels do not take these blocks: ", own);
  COLOSSAL_CHECK_INPUT(setting != "flash" || flash.empty(),
                       "COLOSSAL_RING_BLOCKS=flash, but ATen's flash kernels do not take these "
                       "blocks: ",
                       flash);
  COLOSSAL_CHECK_INPUT(
      setting != "flash" || !deterministic,
      "COLOSSAL_RING_BLOCKS=flash has no deterministic backward (--deterministic): "
      "use own or composite");
  if (setting == "flash") return RingBlockKernel::flash;
  if (setting == "own") return RingBlockKernel::own;
  // Measured on an H100 (docs/benchmarks.md, 2026-12-07: one rank of an 8-rank ring over 32k
  // tokens, forward+backward, blocks merged in one pass): ours 1.28x flash's speed at head dims
  // 64 and 128.
  if (own.empty()) return RingBlockKernel::own;
  if (flash.empty() && !deterministic) return RingBlockKernel::flash;
  return RingBlockKernel::composite;
}

const char* to_string(RingBlockKernel kernel) {
  switch (kernel) {
    case RingBlockKernel::own:
      return "own";
    case RingBlockKernel::flash:
      return "flash";
    case RingBlockKernel::composite:
      break;
  }
  return "composite";
}

namespace {

void check_block(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 bool causal) {
  COLOSSAL_CHECK_INPUT(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() &&
                           q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(1) > 0 &&
                           q.size(1) % k.size(1) == 0,
                       op,
                       ": q [B, H, qn, D] and k/v [B, Hkv, kn, D] with Hkv dividing H expected, "
                       "got q ",
                       q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  COLOSSAL_CHECK_INPUT(!causal || q.size(2) == k.size(2), op, ": a causal block needs as many keys",
                       " as queries, got ", q.size(2), " and ", k.size(2));
}

// [B, heads, n, D] as the flash kernels' [B, n, heads, D] (a view).
at::Tensor bnhd(const at::Tensor& x) {
  return x.transpose(1, 2);
}

// [B, heads, n, D] as our kernels' rows [B * n, heads, D]: each batch row one sequence, its
// queries and keys with offsets of their own (kernels::attention_forward's cross-length form), so
// a block of any shape runs as it is. A view where the tokens-major storage allows it (B = 1, or
// whole sequences), else a copy.
at::Tensor own_rows(const at::Tensor& x) {
  return x.transpose(1, 2).reshape({-1, x.size(1), x.size(3)}).contiguous();
}

// Offsets of `count` sequences of `len` tokens, on the host. The same tensor for the same
// offsets: the kernels keep the upload of their work lists while the same host tensor comes
// again (the ring's off-diagonal blocks one after another, and every layer).
at::Tensor own_offsets(int64_t count, int64_t len) {
  thread_local std::map<std::pair<int64_t, int64_t>, at::Tensor> cache;
  if (cache.size() > 64) cache.clear();  // a run has a few shapes; never grows without bound
  at::Tensor& t = cache[{count, len}];
  if (!t.defined()) t = at::arange(0, count + 1, at::kInt).mul_(static_cast<int32_t>(len));
  return t;
}

// out [B, H, qn, D] and lse [B, H, qn] float32, the rows of q [B, H, qn, D].
void check_rows(const char* op, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse) {
  COLOSSAL_CHECK_INPUT(
      out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
          out.sizes() == q.sizes() && lse.dim() == 3 && lse.sizes() == q.sizes().slice(0, 3),
      op, ": out must be float32 shaped as q ", q.sizes(), " and lse float32 [B, H, qn]; got ",
      out.scalar_type(), " ", out.sizes(), " and ", lse.scalar_type(), " ", lse.sizes());
}

}  // namespace

void ring_block_forward(RingBlockKernel kernel, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, bool causal, double scale, const at::Tensor& out,
                        const at::Tensor& lse) {
  check_block("ring_block_forward", q, k, v, causal);
  check_rows("ring_block_forward", q, out, lse);
  if (kernel == RingBlockKernel::own) {
    const int64_t B = q.size(0), H = q.size(1), qn = q.size(2), kn = k.size(2), D = q.size(3);
    const kernels::AttentionResult r =
        kernels::attention_forward(own_rows(q), own_rows(k), own_rows(v), own_offsets(B, qn),
                                   own_offsets(B, kn), qn, kn, causal, scale);
    kernels::attention_merge(out, lse, r.out.view({B, qn, H, D}).transpose(1, 2),
                             r.lse.view({H, B, qn}).permute({1, 0, 2}));
    return;
  }
  if (kernel == RingBlockKernel::flash) {
    auto r = at::_flash_attention_forward(bnhd(q), bnhd(k), bnhd(v), std::nullopt, std::nullopt,
                                          q.size(2), k.size(2), 0.0, causal, false, scale);
    kernels::attention_merge(out, lse, bnhd(std::get<0>(r)), std::get<1>(r));
    return;
  }
  const int64_t groups = q.size(1) / k.size(1);
  at::Tensor kb = expand_heads(k.to(at::kFloat), groups);
  at::Tensor vb = expand_heads(v.to(at::kFloat), groups);
  at::Tensor s = block_scores(q.to(at::kFloat), kb, causal, scale);
  at::Tensor block_lse = at::logsumexp(s, -1);
  kernels::attention_merge(out, lse, at::matmul((s - block_lse.unsqueeze(-1)).exp_(), vb),
                           block_lse);
}

void ring_block_backward(RingBlockKernel kernel, const at::Tensor& dout, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                         const at::Tensor& lse, bool causal, double scale,
                         const RingBlockGrads& grads, bool deterministic) {
  check_block("ring_block_backward", q, k, v, causal);
  COLOSSAL_CHECK_INPUT(!deterministic || kernel != RingBlockKernel::flash,
                       "ring_block_backward: the flash kernel has no deterministic backward");
  COLOSSAL_CHECK_INPUT(
      dout.sizes() == q.sizes() && out.sizes() == q.sizes() && lse.dim() == 3 &&
          lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
      "ring_block_backward: dout and out must be shaped as q ", q.sizes(),
      " and lse [B, H, qn]; got ", dout.sizes(), ", ", out.sizes(), ", ", lse.sizes());
  auto f32_like = [](const at::Tensor& t, const at::Tensor& like) {
    return t.defined() && t.scalar_type() == at::kFloat && t.sizes() == like.sizes();
  };
  COLOSSAL_CHECK_INPUT(f32_like(grads.dq, q) && f32_like(grads.dk, k) && f32_like(grads.dv, k),
                       "ring_block_backward: the accumulators dq, dk, dv must be float32 shaped as "
                       "q ",
                       q.sizes(), " and k ", k.sizes());
  if (kernel == RingBlockKernel::own) {
    const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), qn = q.size(2), kn = k.size(2),
                  D = q.size(3);
    const at::Tensor l = lse.to(at::kFloat).permute({1, 0, 2}).reshape({H, -1}).contiguous();
    // A tall block at few kv heads leaves SMs idle in the backward (one CTA per key tile and kv
    // head): its queries are then cut into `parts` sequences, each against its own copy of the
    // keys, and the copies' dK / dV added into the fp32 accumulators one by one.
    const int64_t parts = causal
                              ? 1
                              : kernels::attention_backward_query_parts(
                                    B, qn, kn, Hkv, kernels::attention_multiprocessors(q.device()));
    at::Tensor kr = own_rows(k), vr = own_rows(v);
    if (parts > 1) {
      auto copies = [&](const at::Tensor& x) {
        return x.view({B, 1, kn, Hkv, D}).expand({B, parts, kn, Hkv, D}).reshape({-1, Hkv, D});
      };
      kr = copies(kr);
      vr = copies(vr);
    }
    const int64_t pq = qn / parts;
    const kernels::AttentionGrads g = kernels::attention_backward(
        own_rows(q), kr, vr, own_rows(out.to(q.scalar_type())), own_rows(dout.to(q.scalar_type())),
        l, own_offsets(B * parts, pq), own_offsets(B * parts, kn), pq, kn, causal, scale,
        deterministic);
    grads.dq.add_(g.dq.view({B, qn, H, D}).transpose(1, 2));
    const at::Tensor dk = g.dk.view({B, parts, kn, Hkv, D}), dv = g.dv.view({B, parts, kn, Hkv, D});
    for (int64_t j = 0; j < parts; ++j) {
      grads.dk.add_(dk.select(1, j).transpose(1, 2));
      grads.dv.add_(dv.select(1, j).transpose(1, 2));
    }
    return;
  }
  if (kernel == RingBlockKernel::flash) {
    // No dropout: the kernels do not read the random-number state.
    const at::TensorOptions u64 = q.options().dtype(at::kUInt64);
    auto g = at::_flash_attention_backward(bnhd(dout).contiguous(), bnhd(q), bnhd(k), bnhd(v),
                                           bnhd(out).contiguous(), lse.to(at::kFloat).contiguous(),
                                           at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0,
                                           causal, at::zeros({2}, u64), at::zeros({}, u64), scale);
    grads.dq.add_(bnhd(std::get<0>(g)));
    grads.dk.add_(bnhd(std::get<1>(g)));
    grads.dv.add_(bnhd(std::get<2>(g)));
    return;
  }
  const int64_t groups = q.size(1) / k.size(1);
  at::Tensor qf = q.to(at::kFloat), dof = dout.to(at::kFloat);
  at::Tensor kb = expand_heads(k.to(at::kFloat), groups);
  at::Tensor vb = expand_heads(v.to(at::kFloat), groups);
  at::Tensor delta = (dof * out.to(at::kFloat)).sum(-1);  // rowsum(dO * O)
  at::Tensor pr = block_scores(qf, kb, causal, scale)
                      .sub_(lse.to(at::kFloat).unsqueeze(-1))
                      .exp_();  // the final softmax's probabilities of this block
  at::Tensor ds = at::matmul(dof, vb.transpose(-2, -1)).sub_(delta.unsqueeze(-1)).mul_(pr);
  grads.dv.add_(reduce_heads(at::matmul(pr.transpose(-2, -1), dof), groups));
  grads.dq.add_(at::matmul(ds, kb).mul_(scale));
  grads.dk.add_(reduce_heads(at::matmul(ds.transpose(-2, -1), qf).mul_(scale), groups));
}

RingAttention::RingAttention(dist::Communicator sp, int64_t inner_ring_size)
    : sp_(std::move(sp)), inner_(inner_ring_size) {
  COLOSSAL_CHECK_INPUT(sp_.valid(), "RingAttention needs a sequence parallel group");
  check_inner_ring_size(inner_, sp_.size());
}

at::Tensor RingAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionMask& mask, const SequenceInfo& seq) {
  ForwardScope scope(*this);
  check_no_mask(mask, seq, "ring_attn");
  return ring_attention(q, k, v, sp_, mask.causal, inner_, deterministic_);
}

}  // namespace colossal::nn
