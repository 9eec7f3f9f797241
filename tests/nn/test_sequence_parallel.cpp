// Sequence-parallel attention (2 and 4 ranks over Gloo): the all-to-all region against its
// definition; all_to_all (Ulysses) and ring_attn (zigzag ring, single and double ring) core
// attention against full causal attention over the gathered sequence (outputs and q/k/v
// gradients, plain and grouped-query heads, a 4096-token ring); a tiny Llama with the
// sequence-parallel plan and sharded inputs against the same model unsharded (loss and every
// parameter gradient); and the named errors of bad sizes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/init.h"
#include "colossal/nn/parallel_ops.h"
#include "colossal/nn/plan.h"
#include "colossal/nn/sequence_parallel.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;
using SP = dist::SequenceParallel;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// The same values on every rank.
at::Tensor shared_randn(at::IntArrayRef shape, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(shape);
}

// Runs `attn` on this rank's tokens (positions `pos` of the whole sequence) and compares the
// output and the q/k/v gradients with causal SDPA over the whole sequence. fp32: the blocked
// softmax of the ring and the exchanges reorder fp32 sums only (2^-24 relative each), so 1e-5
// relative to the largest value is ample.
void expect_equals_full_attention(CoreAttention& attn, int64_t b, int64_t h, int64_t hkv, int64_t s,
                                  int64_t d, const at::Tensor& pos, uint64_t seed,
                                  bool causal = true) {
  SCOPED_TRACE("heads " + std::to_string(h) + ", kv heads " + std::to_string(hkv) + ", seq " +
               std::to_string(s));
  at::Tensor q = shared_randn({b, h, s, d}, seed).requires_grad_();
  at::Tensor k = shared_randn({b, hkv, s, d}, seed + 1).requires_grad_();
  at::Tensor v = shared_randn({b, hkv, s, d}, seed + 2).requires_grad_();
  const at::Tensor dy = shared_randn({b, h, s, d}, seed + 3);
  at::Tensor ref =
      at::scaled_dot_product_attention(q, k.repeat_interleave(h / hkv, 1),
                                       v.repeat_interleave(h / hkv, 1), std::nullopt, 0.0, causal);
  (ref * dy).sum().backward();

  at::Tensor ql = q.detach().index_select(2, pos).requires_grad_();
  at::Tensor kl = k.detach().index_select(2, pos).requires_grad_();
  at::Tensor vl = v.detach().index_select(2, pos).requires_grad_();
  SequenceInfo seq;
  seq.local_len = pos.size(0);
  seq.global_len = s;
  AttentionMask mask;
  mask.causal = causal;
  at::Tensor y = attn.forward(ql, kl, vl, mask, seq);
  ASSERT_EQ(y.sizes(), ql.sizes());
  EXPECT_LT(max_rel(y, ref.detach().index_select(2, pos)), 1e-5);
  // The sum over ranks of the local losses is the whole loss.
  (y * dy.index_select(2, pos)).sum().backward();
  EXPECT_LT(max_rel(ql.grad(), q.grad().index_select(2, pos)), 1e-5);
  EXPECT_LT(max_rel(kl.grad(), k.grad().index_select(2, pos)), 1e-5);
  EXPECT_LT(max_rel(vl.grad(), v.grad().index_select(2, pos)), 1e-5);
}

template <class Fn>
void expect_input_error(Fn&& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    const std::string what = e.what();
    for (const auto& w : words) EXPECT_NE(what.find(w), std::string::npos) << what;
  }
}

}  // namespace

TEST(SequenceParallel, AllToAllRegionIsItsDefinitionAndAdjoint) {
  dist::Communicator g = dist::world();
  const int r = g.rank(), w = g.size();
  // Rank i's x is [2, 2w, 3, 5]; scatter dim 1 (heads), gather dim 2 (sequence).
  auto x_of = [](int rank, int w) { return shared_randn({2, 2 * w, 3, 5}, 300 + rank); };
  at::Tensor x = x_of(r, w).requires_grad_();
  at::Tensor y = all_to_all_region(x, g, 1, 2);
  std::vector<at::Tensor> parts;
  for (int i = 0; i < w; ++i) parts.push_back(x_of(i, w).narrow(1, 2 * r, 2));
  EXPECT_TRUE(at::equal(y, at::cat(parts, 2)));
  // Backward is the inverse exchange: the gradient of slice j of rank r's x is the part r of
  // rank j's output gradient.
  auto dy_of = [](int rank, int w) { return shared_randn({2, 2, 3 * w, 5}, 400 + rank); };
  y.backward(dy_of(r, w));
  std::vector<at::Tensor> grads;
  for (int j = 0; j < w; ++j) grads.push_back(dy_of(j, w).narrow(2, 3 * r, 3));
  EXPECT_TRUE(at::equal(x.grad(), at::cat(grads, 1)));
}

TEST(SequenceParallel, ShardSequenceLayouts) {
  dist::Communicator g = dist::world();
  const int64_t r = g.rank(), w = g.size(), s = 8 * w;
  const at::Tensor ids = at::arange(2 * s, at::kLong).view({2, s});
  const at::Tensor targets = ids + 1000;
  SequenceShard a = shard_sequence(ids, targets, g, SP::AllToAll);
  EXPECT_TRUE(at::equal(a.positions, at::arange(r * 8, (r + 1) * 8, at::kLong)));
  EXPECT_TRUE(at::equal(a.input, ids.narrow(1, r * 8, 8)));
  EXPECT_TRUE(at::equal(a.targets, targets.narrow(1, r * 8, 8)));
  SequenceShard z = shard_sequence(ids, targets, g, SP::RingAttn);
  EXPECT_TRUE(at::equal(z.positions,
                        at::cat({at::arange(r * 4, r * 4 + 4, at::kLong),
                                 at::arange((2 * w - 1 - r) * 4, (2 * w - r) * 4, at::kLong)})));
  EXPECT_TRUE(at::equal(z.input, ids.index_select(1, z.positions)));
  EXPECT_TRUE(at::equal(z.targets, targets.index_select(1, z.positions)));
  // Every token on exactly one rank.
  at::Tensor all = at::empty({w * z.positions.size(0)}, at::kLong);
  g.all_gather(all, z.positions);
  EXPECT_TRUE(at::equal(std::get<0>(all.sort()), at::arange(s, at::kLong)));
  // Modes that take the whole sequence.
  SequenceShard o = shard_sequence(ids, targets, g, SP::SplitGather);
  EXPECT_TRUE(at::equal(o.input, ids));
  EXPECT_TRUE(at::equal(o.positions, at::arange(s, at::kLong)));
}

TEST(SequenceParallel, AllToAllEqualsFullAttention) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size(), s = 6 * w;
  AllToAllAttention attn(g);
  const at::Tensor pos = sequence_positions(s, g.rank(), w, SP::AllToAll);
  // {heads, kv heads}: kv heads split over sp where divisible, repeated to the query heads else.
  const std::vector<std::pair<int64_t, int64_t>> heads = {{4, 4}, {4, 2}, {8, 4}, {4, 1}};
  uint64_t seed = 10;
  for (auto [h, hkv] : heads) {
    if (h % w != 0) continue;
    expect_equals_full_attention(attn, 2, h, hkv, s, 8, pos, seed += 10);
  }
}

TEST(SequenceParallel, RingAttnEqualsFullAttention) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size(), s = 6 * w;  // chunks of 3 tokens
  const at::Tensor pos = sequence_positions(s, g.rank(), w, SP::RingAttn);
  std::vector<int64_t> inner_sizes = {0};
  if (w == 4) inner_sizes.push_back(2);  // the double ring: two inner rings of two ranks
  uint64_t seed = 100;
  for (int64_t inner : inner_sizes) {
    SCOPED_TRACE("inner_ring_size " + std::to_string(inner));
    RingAttention attn(g, inner);
    for (auto [h, hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}, {4, 1}})
      expect_equals_full_attention(attn, 2, h, hkv, s, 8, pos, seed += 10);
    expect_equals_full_attention(attn, 1, 2, 2, s, 4, pos, seed += 10, /*causal=*/false);
  }
}

// --attn_backend own's use_own_attention hands --deterministic to ring_attn's slots (their
// blocks may run our kernels) and leaves them ring attention.
TEST(SequenceParallel, OwnAttentionGivesRingItsDeterministicSetting) {
  torch::nn::Module root;
  auto ring = root.register_module("core_attn", std::make_shared<RingAttention>(dist::world()));
  EXPECT_FALSE(ring->deterministic());
  const auto [own, slots] = use_own_attention(root, /*deterministic=*/true);
  EXPECT_EQ(slots, 0);
  EXPECT_TRUE(ring->deterministic());
  EXPECT_NE(dynamic_cast<RingAttention*>(root.named_children()["core_attn"].get()), nullptr);
}

TEST(SequenceParallel, RingAttnLongSequence) {
  dist::Communicator g = dist::world();
  const int64_t s = 4096;
  const at::Tensor pos = sequence_positions(s, g.rank(), g.size(), SP::RingAttn);
  RingAttention attn(g);
  expect_equals_full_attention(attn, 1, 2, 1, s, 4, pos, 900);
}

TEST(SequenceParallel, LlamaPlanEqualsTheWholeModel) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size();
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.sliding_window.reset();
  c.layer_sliding.assign(2, false);
  InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  auto whole = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  init_parameters(*whole, io);
  at::manual_seed(3);
  const int64_t s = 8 * w;
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, s}, at::kLong);
  // Every target counted (no ignore_index): each rank's mean is over as many tokens, so the
  // mean of the ranks' losses is the whole loss.
  const at::Tensor targets = at::randint(0, c.vocab_size, {2, s}, at::kLong);
  at::Tensor loss_whole = whole->forward_loss(ids, targets);
  loss_whole.backward();
  auto whole_params = whole->named_parameters();

  struct Case {
    SP mode;
    int64_t inner;
    bool own = false;  // --attn_backend own --deterministic first, as the trainer does
  };
  std::vector<Case> cases = {
      {SP::AllToAll, 0}, {SP::RingAttn, 0}, {SP::AllToAll, 0, true}, {SP::RingAttn, 0, true}};
  if (w == 4) cases.push_back({SP::RingAttn, 2});
  for (const Case& cs : cases) {
    SCOPED_TRACE(std::string(dist::to_string(cs.mode)) + " inner " + std::to_string(cs.inner) +
                 (cs.own ? " own" : ""));
    auto sp = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
    if (cs.own) {
      EXPECT_EQ(use_own_attention(*sp, /*deterministic=*/true).second, 2);
    }
    EXPECT_EQ(apply_plan(*sp, sequence_parallel_plan(c, cs.mode, g, cs.inner), {}),
              c.num_hidden_layers);
    // The plan keeps what use_own_attention put in the slots: all_to_all's inner attention is
    // ours (on the CPU it hands each call to SDPA), ring_attn takes the deterministic setting.
    int64_t slots = 0;
    for (const auto& item : sp->named_modules("", false)) {
      if (auto* a2a = dynamic_cast<AllToAllAttention*>(item.value().get())) {
        ++slots;
        EXPECT_EQ(dynamic_cast<OwnAttention*>(a2a->inner.get()) != nullptr, cs.own) << item.key();
      }
      if (auto* ring = dynamic_cast<RingAttention*>(item.value().get())) {
        ++slots;
        EXPECT_EQ(ring->deterministic(), cs.own) << item.key();
      }
    }
    EXPECT_EQ(slots, c.num_hidden_layers);
    init_parameters(*sp, io);
    SequenceShard shard = shard_sequence(ids, targets, g, cs.mode);
    ForwardOptions fo;
    fo.positions = shard.positions;
    fo.global_seq_len = s;
    at::Tensor loss = sp->forward_loss(shard.input, shard.targets, 4096, fo);
    loss.backward();
    at::Tensor mean = loss.detach().clone();
    g.all_reduce(mean);
    EXPECT_LT(std::abs(mean.item<double>() / w - loss_whole.item<double>()),
              1e-5 * loss_whole.item<double>());
    int64_t compared = 0;
    for (const auto& item : sp->named_parameters()) {
      at::Tensor grad = item.value().grad().clone();
      g.all_reduce(grad);
      // fp32 through two layers forwards and backwards, the ranks' partial gradients summed in
      // another order than the whole model's GEMMs sum them: 1e-5 of the largest entry.
      EXPECT_LT(max_rel(grad / w, whole_params[item.key()].grad()), 1e-5) << item.key();
      ++compared;
    }
    EXPECT_EQ(compared, static_cast<int64_t>(whole_params.size()));
  }
  // Modes without attention layers of their own get an empty plan.
  EXPECT_TRUE(sequence_parallel_plan(c, SP::SplitGather, g).empty());
  EXPECT_TRUE(sequence_parallel_plan(c, SP::Off, g).empty());
}

TEST(SequenceParallel, BadSizesAreNamedErrors) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size();
  const at::Tensor ids = at::zeros({1, 2 * w + 1}, at::kLong);
  const std::string len = std::to_string(2 * w + 1);
  expect_input_error([&] { shard_sequence(ids, ids, g, SP::AllToAll); },
                     {len, "sp = " + std::to_string(w)});
  expect_input_error([&] { shard_sequence(ids, ids, g, SP::RingAttn); },
                     {len, "2*sp = " + std::to_string(2 * w)});
  ModelConfig c = ModelConfig::preset("tiny");
  c.num_attention_heads = 2 * w + 1;
  c.num_key_value_heads = 1;
  expect_input_error([&] { sequence_parallel_plan(c, SP::AllToAll, g); },
                     {"num_attention_heads = " + std::to_string(2 * w + 1)});
  AllToAllAttention a2a(g);
  const at::Tensor q = at::zeros({1, 2 * w + 1, 2, 4}), kv = at::zeros({1, 1, 2, 4});
  expect_input_error([&] { a2a.forward(q, kv, kv, {}, {}); },
                     {std::to_string(2 * w + 1) + " attention heads"});
  expect_input_error([&] { sequence_parallel_plan(c, SP::RingAttn, g, 3); },
                     {"inner_ring_size 3", "sp = " + std::to_string(w)});
  expect_input_error([&] { [[maybe_unused]] RingAttention bad(g, w); },
                     {"inner_ring_size " + std::to_string(w)});
  RingAttention ring(g);
  const at::Tensor odd = at::zeros({1, 2, 3, 4});
  expect_input_error([&] { ring.forward(odd, odd, odd, {}, {}); }, {"local sequence length 3"});
}
