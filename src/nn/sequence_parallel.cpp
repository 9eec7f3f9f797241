// Sequence sharding of the inputs, Ulysses (all-to-all) attention and zigzag ring attention
// (sequence_parallel.h).
#include "colossal/nn/sequence_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "colossal/core/error.h"
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
  explicit RingSaved(Ring r) : ring(std::move(r)) {}
  Ring ring;
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

struct RingAttnFn : torch::autograd::Function<RingAttnFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::intrusive_ptr<RingSaved>& saved) {
    const Ring& ring = saved->ring;
    const int64_t len = q.size(2), c = len / 2, groups = q.size(1) / k.size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    at::Tensor qf = q.to(at::kFloat);
    at::Tensor out = at::zeros(q.sizes(), qf.options());
    at::Tensor lse = at::full({q.size(0), q.size(1), len}, -std::numeric_limits<float>::infinity(),
                              qf.options());
    auto compute = [&](int64_t src, const at::Tensor& kv) {
      const Part p = part_of(ring, src, c);
      at::Tensor qp = qf.narrow(2, p.q0, p.qn);
      at::Tensor kb = expand_heads(kv[0].narrow(2, p.k0, p.kn).to(at::kFloat), groups);
      at::Tensor vb = expand_heads(kv[1].narrow(2, p.k0, p.kn).to(at::kFloat), groups);
      at::Tensor s = block_scores(qp, kb, p.causal, scale);
      at::Tensor l_blk = at::logsumexp(s, -1);
      at::Tensor o_blk = at::matmul((s - l_blk.unsqueeze(-1)).exp_(), vb);
      // Merge by log-sum-exp: out = (e^lse out + e^l_blk o_blk) / e^(lse'), lse' = lse (+) l_blk.
      at::Tensor o_rows = out.narrow(2, p.q0, p.qn), l_rows = lse.narrow(2, p.q0, p.qn);
      at::Tensor l_new = at::logaddexp(l_rows, l_blk);
      o_rows.mul_((l_rows - l_new).exp_().unsqueeze(-1))
          .add_(o_blk.mul_((l_blk - l_new).exp_().unsqueeze(-1)));
      l_rows.copy_(l_new);
    };
    // The first block is this rank's own (the diagonal): every row gets a finite lse at once.
    at::Tensor outer_kv = at::stack({k, v}).contiguous();
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
    ctx->saved_data["ring"] = c10::IValue::make_capsule(saved);
    ctx->save_for_backward({q, k, v, out, lse});
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = c10::static_intrusive_pointer_cast<RingSaved>(ctx->saved_data["ring"].toCapsule());
    const Ring& ring = saved->ring;
    auto vars = ctx->get_saved_variables();
    const at::Tensor &q = vars[0], &k = vars[1], &v = vars[2], &out = vars[3], &lse = vars[4];
    const int64_t len = q.size(2), c = len / 2, groups = q.size(1) / k.size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    at::Tensor qf = q.to(at::kFloat);
    at::Tensor dout = grads[0].to(at::kFloat);
    at::Tensor delta = (dout * out).sum(-1);  // rowsum(dO * O) of the softmax backward
    at::Tensor dq = at::zeros(qf.sizes(), qf.options());
    // Adds the gradient of the block of rank src to dq and to that block's accumulator dkv.
    auto compute = [&](int64_t src, const at::Tensor& kv, at::Tensor& dkv) {
      const Part p = part_of(ring, src, c);
      at::Tensor qp = qf.narrow(2, p.q0, p.qn), dop = dout.narrow(2, p.q0, p.qn);
      at::Tensor kb = expand_heads(kv[0].narrow(2, p.k0, p.kn).to(at::kFloat), groups);
      at::Tensor vb = expand_heads(kv[1].narrow(2, p.k0, p.kn).to(at::kFloat), groups);
      at::Tensor pr = block_scores(qp, kb, p.causal, scale)
                          .sub_(lse.narrow(2, p.q0, p.qn).unsqueeze(-1))
                          .exp_();  // the final softmax's probabilities of this block
      at::Tensor dv_b = at::matmul(pr.transpose(-2, -1), dop);
      at::Tensor ds = at::matmul(dop, vb.transpose(-2, -1))
                          .sub_(delta.narrow(2, p.q0, p.qn).unsqueeze(-1))
                          .mul_(pr);
      dq.narrow(2, p.q0, p.qn).add_(at::matmul(ds, kb).mul_(scale));
      at::Tensor dk_b = at::matmul(ds.transpose(-2, -1), qp).mul_(scale);
      dkv[0].narrow(2, p.k0, p.kn).add_(reduce_heads(dk_b, groups));
      dkv[1].narrow(2, p.k0, p.kn).add_(reduce_heads(dv_b, groups));
    };
    // Keys/values go around as in forward; each block's gradient accumulator travels with it
    // and, after one more hop, is back at the rank that owns the block: inner rings first
    // (the inner ring's sum arrives at the rank that got the block from the outer ring), then
    // the outer ring carries the sum over the inner rings home.
    at::Tensor outer_kv = at::stack({k, v}).contiguous();
    at::Tensor outer_grad = at::zeros(outer_kv.sizes(), qf.options());
    for (int64_t o = 0; o < ring.outer; ++o) {
      dist::Work outer_work;
      at::Tensor outer_recv;
      if (o + 1 < ring.outer)
        outer_work =
            ring.exchange(outer_kv, outer_recv, ring.outer_next(), ring.outer_prev(), kTagOuterKV);
      at::Tensor cur = outer_kv;
      at::Tensor grad = at::zeros(outer_kv.sizes(), qf.options());
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
    return {dq.to(q.scalar_type()), outer_grad[0].to(k.scalar_type()),
            outer_grad[1].to(v.scalar_type()), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const dist::Communicator& sp, bool causal, int64_t inner_ring_size) {
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
  return RingAttnFn::apply(q, k, v, c10::make_intrusive<RingSaved>(std::move(ring)));
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
  return ring_attention(q, k, v, sp_, mask.causal, inner_);
}

}  // namespace colossal::nn
