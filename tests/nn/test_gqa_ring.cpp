// Grouped-query attention with fewer key/value heads than tensor-parallel ranks (each kv head
// replicated on the ranks whose query heads read it) and the `ring` sequence-parallel mode of
// the sharded linears (chunked gather / reduce-scatter overlapped with the GEMMs), at 2 and 4
// ranks over Gloo: against the unsharded model (loss, logits, every gradient) and, for ring,
// against split_gather.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/parallel_ops.h"
#include "colossal/nn/plan.h"
#include "colossal/nn/ring_ops.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

at::Tensor shared_randn(at::IntArrayRef shape, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(shape);
}

ModelConfig config(int64_t kv_heads) {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.layer_sliding.assign(2, false);
  c.qkv_bias = true;  // the replicated bias's gradient is summed like the weight's
  c.o_bias = true;
  c.tie_word_embeddings = false;  // the embedding is vocab-parallel (reduce-scatter under SP)
  return c;
}

std::shared_ptr<CausalLM> build(const ModelConfig& c, const dist::Communicator* tp,
                                SequenceParallelMode sp = SequenceParallelMode::Off) {
  auto m = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  if (tp) {
    check_tensor_parallel(c, tp->size());
    PlanOptions po;
    po.tp = *tp;
    po.sequence_parallel = sp;
    apply_plan(*m, tensor_parallel_plan(c), po);
  }
  InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  init_parameters(*m, io);
  return m;
}

Module& owner(torch::nn::Module& root, const std::string& param) {
  auto* layer = dynamic_cast<Module*>(find_module(root, param.substr(0, param.rfind('.'))).get());
  EXPECT_NE(layer, nullptr) << param;
  return *layer;
}

struct Batch {
  at::Tensor ids, targets;
  int64_t counted;
};

Batch batch(const ModelConfig& c) {
  at::manual_seed(3);
  Batch b;
  b.ids = at::randint(0, c.vocab_size, {2, 12}, at::kLong);  // 12: divisible by 2 and 4
  b.targets = at::constant_pad_nd(b.ids.narrow(1, 1, 11), {0, 1}, -100);
  b.counted = (b.targets != -100).sum().item<int64_t>();
  return b;
}

struct StepResult {
  double loss;
  std::map<std::string, at::Tensor> grads;  // each rank's local gradient, made whole-model
                                            // comparable (partial sums summed over tp)
};

// Forward and backward of a (possibly sequence-parallel) model; under split_gather / ring each
// rank's loss is its tokens' share of the global mean, so the ranks' gradients add up to the
// whole model's. The gradients that such a rank holds per sequence shard (parameters whole on
// every rank that read sequence-sharded activations: norms, lm_head, the row bias) are summed
// over the group here, as the hybrid plugin does; every other gradient is used as it is.
StepResult run(CausalLM& m, const Batch& b, const dist::Communicator* tp, SequenceParallelMode sp) {
  StepResult out;
  const bool seq = tp && sp != SequenceParallelMode::Off;
  at::Tensor loss;
  if (seq) {
    const int64_t n = b.ids.size(1) / tp->size();
    at::Tensor t = b.targets.narrow(1, tp->rank() * n, n);
    const int64_t local = (t != -100).sum().item<int64_t>();
    loss = m.forward_loss(b.ids, t) * (static_cast<double>(local) / b.counted);
  } else {
    loss = m.forward_loss(b.ids, b.targets);
  }
  loss.backward();
  at::Tensor total = loss.detach().clone();
  if (seq) const_cast<dist::Communicator&>(*tp).all_reduce(total);
  out.loss = total.item<double>();
  for (const auto& item : m.named_parameters()) {
    at::Tensor g = item.value().grad().clone();
    const std::string& name = item.key();
    Module& layer = owner(m, name);
    const auto& spec = layer.shard_spec();
    const bool partial =
        !spec || (spec->kind == ShardSpec::Kind::Row && name.substr(name.rfind('.')) == ".bias");
    if (seq && partial) const_cast<dist::Communicator&>(*tp).all_reduce(g);
    out.grads[name] = g;
  }
  return out;
}

// Every gradient of `part` (each rank's shard) against its slice of the whole model's.
void expect_grads_match(CausalLM& part, const StepResult& got, const StepResult& whole, double tol,
                        const std::string& what) {
  ASSERT_EQ(got.grads.size(), whole.grads.size()) << what;
  for (const auto& [name, g] : got.grads) {
    Module& layer = owner(part, name);
    at::Tensor expect = layer.shard_slice(name.substr(name.rfind('.') + 1), whole.grads.at(name));
    ASSERT_EQ(g.sizes(), expect.sizes()) << what << " " << name;
    EXPECT_LT(max_rel(g, expect), tol) << what << " " << name;
  }
}

}  // namespace

// Replicated kv heads: kv = 1 at tp 2 and 4, kv = 2 at tp 4 (and the divisible case kv = 2 at
// tp 2 through the same code).
TEST(GqaTensorParallel, FewerKvHeadsThanRanksEqualsTheWholeModel) {
  dist::Communicator g = dist::world();
  const int64_t tp = g.size();
  for (int64_t kv : {int64_t{1}, int64_t{2}}) {
    SCOPED_TRACE("kv heads " + std::to_string(kv) + " tp " + std::to_string(tp));
    const ModelConfig c = config(kv);
    auto whole = build(c, nullptr);
    auto part = build(c, &g);
    const int64_t replicas = kv < tp ? tp / kv : 1;
    // Storage: the one (or kv / tp) head(s) this rank reads; checkpoints see the HF shape.
    auto& attn = *part->model->layers->layers[0]->self_attn;
    for (Linear* p : {attn.k_proj.get(), attn.v_proj.get()}) {
      EXPECT_EQ(p->weight().size(0), c.head_dim * std::max<int64_t>(kv / tp, 1));
      EXPECT_EQ(p->full_shape("weight"), (std::vector<int64_t>{kv * c.head_dim, c.hidden_size}));
      EXPECT_EQ(p->full_shape("bias"), (std::vector<int64_t>{kv * c.head_dim}));
      EXPECT_EQ(p->replication("weight"), replicas);
      EXPECT_EQ(p->replication("bias"), replicas);
      EXPECT_EQ(p->shard_spec()->replicas, replicas);
      // Rank r holds kv head r * kv / tp: its rows of the whole model's weight, exactly.
      Linear& whole_p = p == attn.k_proj.get()
                            ? *whole->model->layers->layers[0]->self_attn->k_proj
                            : *whole->model->layers->layers[0]->self_attn->v_proj;
      const int64_t rows = p->weight().size(0), first = g.rank() / replicas * rows;
      EXPECT_TRUE(at::equal(p->weight(), whole_p.weight().narrow(0, first, rows)));
      EXPECT_TRUE(at::equal(p->shard_slice("weight", whole_p.weight()), p->weight()));
    }
    EXPECT_EQ(attn.q_proj->replication("weight"), 1);
    EXPECT_EQ(attn.o_proj->replication("bias"), tp);  // the row bias is whole on every rank
    EXPECT_EQ(attn.o_proj->replication("weight"), 1);
    const Batch b = batch(c);
    // fp32: the sharded GEMMs sum the hidden dim in tp partial products then an all-reduce,
    // the whole model in one; both round at 2^-24 relative.
    EXPECT_LT(max_rel(part->forward(b.ids), whole->forward(b.ids)), 1e-5);
    const StepResult rw = run(*whole, b, nullptr, SequenceParallelMode::Off);
    const StepResult rp = run(*part, b, &g, SequenceParallelMode::Off);
    EXPECT_LT(std::abs(rp.loss - rw.loss) / std::abs(rw.loss), 1e-5);
    expect_grads_match(*part, rp, rw, 1e-5, "tp");
    // The ranks sharing a kv head hold the same gradient (the whole head's).
    at::Tensor kg = rp.grads.at("model.layers.1.self_attn.v_proj.weight");
    at::Tensor gathered = at::empty({tp * kg.numel()});
    g.all_gather(gathered, kg.reshape({-1}));
    for (int64_t r = 0; r < tp; ++r) {
      if (r / replicas != g.rank() / replicas) continue;
      EXPECT_TRUE(at::equal(gathered.narrow(0, r * kg.numel(), kg.numel()), kg.reshape({-1})));
    }
  }
}

TEST(GqaTensorParallel, KvHeadsThatDoNotDivideTheRanksAreNamed) {
  dist::Communicator g = dist::world();
  ModelConfig c = config(1);
  c.num_attention_heads = 12;
  c.num_key_value_heads = 3;  // neither divides 2 or 4 nor is divisible by them
  try {
    check_tensor_parallel(c, g.size());
    FAIL() << "kv heads 3 over " << g.size() << " ranks accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads = 3"), std::string::npos) << e.what();
  }
  // The layer itself refuses too, naming its heads.
  Linear k(LinearOptions(32, 24).heads(3));
  try {
    k.shard(ShardSpec::over(ShardSpec::Kind::Column, g));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("3 heads over"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Linear(LinearOptions(32, 24).heads(5)), InputError);  // 5 does not divide 24
}

TEST(RingSequenceParallel, RingOpsEqualSplitGather) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size(), r = g.rank();
  const at::Tensor wc = shared_randn({6, 5}, 11);  // column: [out_local, in]
  const at::Tensor wr = shared_randn({5, 6}, 12);  // row: [out, in_local]
  {                                                // column: gather then multiply
    at::Tensor x1 = shared_randn({2, 3, 5}, 20 + r).requires_grad_();
    at::Tensor x2 = x1.detach().clone().requires_grad_();
    at::Tensor w1 = wc.clone().requires_grad_(), w2 = wc.clone().requires_grad_();
    at::Tensor y1 = ring_gather_linear(x1, w1, g, 1);
    at::Tensor y2 = at::linear(gather_from_sequence(x2, g, 1), w2);
    ASSERT_EQ(y1.sizes(), (std::vector<int64_t>{2, 3 * w, 6}));
    EXPECT_LT(max_rel(y1, y2), 1e-6);
    const at::Tensor dy = shared_randn({2, 3 * w, 6}, 30 + r);
    y1.backward(dy);
    y2.backward(dy);
    EXPECT_LT(max_rel(x1.grad(), x2.grad()), 1e-6);
    EXPECT_LT(max_rel(w1.grad(), w2.grad()), 1e-6);
  }
  {  // row: multiply then reduce-scatter
    at::Tensor x1 = shared_randn({2, 2 * w, 6}, 40 + r).requires_grad_();
    at::Tensor x2 = x1.detach().clone().requires_grad_();
    at::Tensor w1 = wr.clone().requires_grad_(), w2 = wr.clone().requires_grad_();
    at::Tensor y1 = ring_linear_reduce_scatter(x1, w1, g, 1);
    at::Tensor y2 = reduce_scatter_sequence(at::linear(x2, w2), g, 1);
    ASSERT_EQ(y1.sizes(), (std::vector<int64_t>{2, 2, 5}));
    EXPECT_LT(max_rel(y1, y2), 1e-6);
    const at::Tensor dy = shared_randn({2, 2, 5}, 50 + r);
    y1.backward(dy);
    y2.backward(dy);
    EXPECT_LT(max_rel(x1.grad(), x2.grad()), 1e-6);
    EXPECT_LT(max_rel(w1.grad(), w2.grad()), 1e-6);
    // A sequence the ranks cannot split is named.
    try {
      ring_linear_reduce_scatter(shared_randn({2, 2 * w + 1, 6}, 1), wr, g, 1);
      FAIL();
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'ring'"), std::string::npos) << e.what();
    }
  }
}

// The Llama plan under ring equals split_gather and the whole model, with kv heads replicated
// (kv = 1) and not (kv = tp).
TEST(RingSequenceParallel, LlamaPlanUnderRingEqualsSplitGatherAndTheWholeModel) {
  dist::Communicator g = dist::world();
  const int64_t tp = g.size();
  for (int64_t kv : {int64_t{1}, tp}) {
    SCOPED_TRACE("kv heads " + std::to_string(kv) + " tp " + std::to_string(tp));
    const ModelConfig c = config(kv);
    const Batch b = batch(c);
    auto whole = build(c, nullptr);
    auto sg = build(c, &g, SequenceParallelMode::SplitGather);
    auto ring = build(c, &g, SequenceParallelMode::Ring);
    EXPECT_EQ(ring->model->layers->layers[0]->dense_mlp().up_proj->shard_spec()->sequence_parallel,
              SequenceParallelMode::Ring);
    // Logits of this rank's tokens (the final norm and head run on the sequence shard).
    const int64_t n = b.ids.size(1) / tp;
    at::Tensor expect = whole->forward(b.ids).narrow(1, g.rank() * n, n);
    at::Tensor lr = ring->forward(b.ids), ls = sg->forward(b.ids);
    EXPECT_LT(max_rel(lr, expect), 1e-5);
    EXPECT_LT(max_rel(lr, ls), 1e-5);
    const StepResult rw = run(*whole, b, nullptr, SequenceParallelMode::Off);
    const StepResult rs = run(*sg, b, &g, SequenceParallelMode::SplitGather);
    const StepResult rr = run(*ring, b, &g, SequenceParallelMode::Ring);
    EXPECT_LT(std::abs(rr.loss - rw.loss) / std::abs(rw.loss), 1e-5);
    EXPECT_LT(std::abs(rr.loss - rs.loss) / std::abs(rs.loss), 1e-5);
    expect_grads_match(*ring, rr, rw, 1e-5, "ring vs whole");
    expect_grads_match(*sg, rs, rw, 1e-5, "split_gather vs whole");
    for (const auto& [name, grad] : rr.grads)
      EXPECT_LT(max_rel(grad, rs.grads.at(name)), 1e-5) << "ring vs split_gather " << name;
  }
}

TEST(RingSequenceParallel, OnlyLayerModesTheyImplementAreAccepted) {
  dist::Communicator g = dist::world();
  Linear l(LinearOptions(8, 8));
  try {
    l.shard(ShardSpec::over(ShardSpec::Kind::Column, g, SequenceParallelMode::AllToAll));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("all_to_all"), std::string::npos) << e.what();
  }
  Linear ok(LinearOptions(8, 8));
  ok.shard(ShardSpec::over(ShardSpec::Kind::Row, g, SequenceParallelMode::Ring));
  EXPECT_EQ(ok.shard_spec()->sequence_parallel, SequenceParallelMode::Ring);
}
