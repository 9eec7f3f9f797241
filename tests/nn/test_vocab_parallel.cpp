// The vocabulary-parallel half of tensor parallelism, over 2 and 4 ranks (Gloo), against the
// single-process computation in fp32: the vocab-parallel fused cross-entropy against
// at::cross_entropy on the whole logits, the padded vocab-sharded embedding (and its tied-head
// projection) against the whole one, and a Llama with the full tensor-parallel plan (head
// included; tied and untied; a vocabulary no tp divides; parallel_output on and off; with and
// without split_gather) against the same model unsharded.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/embedding.h"
#include "colossal/nn/fused_ce.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/parallel_ops.h"
#include "colossal/nn/plan.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;

namespace {

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// The same values on every rank.
at::Tensor shared_randn(at::IntArrayRef shape, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(shape);
}

// Rows [begin, begin + n) of t padded with zero rows to `padded` rows.
at::Tensor padded_rows(const at::Tensor& t, int64_t padded, int64_t begin, int64_t n) {
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = padded - t.size(0);
  return at::cat({t, at::zeros(shape, t.options())}, 0).narrow(0, begin, n);
}

// Targets over [0, vocab) with some ignored (-100) positions, the same on every rank.
at::Tensor shared_targets(at::IntArrayRef shape, int64_t vocab, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor t = at::randint(0, vocab, shape, at::kLong);
  at::Tensor ignore = at::rand(shape) < 0.2;
  return at::where(ignore, -100, t);
}

}  // namespace

// The loss and the logits' gradient: with hidden = I the weight's gradient is the transposed
// gradient of the logits, so the chunked fused path is checked on the logits themselves.
TEST(VocabParallelCE, EqualsCrossEntropyOnTheWholeLogits) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size(), r = g.rank();
  const int64_t V = 37, N = 16;  // 37: no tp divides it
  const at::Tensor logits = shared_randn({N, V}, 1) * 3;
  const at::Tensor targets = shared_targets({N}, V, 2);
  at::Tensor whole = logits.clone().requires_grad_();
  at::Tensor expect =
      at::cross_entropy_loss(whole, targets, std::nullopt, at::Reduction::Mean, -100);
  expect.backward();
  // pad 4: every rank holds real rows (at 4 ranks the last holds one); pad 16: at 4 ranks the
  // last holds none.
  for (int64_t pad : {4, 16}) {
    const int64_t m = pad * w, P = (V + m - 1) / m * m, n = P / w, begin = r * n;
    at::Tensor wt = padded_rows(logits.t(), P, begin, n).contiguous().requires_grad_();
    VocabParallel vp;
    vp.group = g;
    vp.vocab_begin = begin;
    vp.vocab_size = V;
    for (int64_t chunk : {int64_t(0), int64_t(5)}) {
      FusedCEOptions fo;
      fo.chunk_tokens = chunk;
      wt.mutable_grad() = at::Tensor();
      at::Tensor loss = vocab_parallel_linear_cross_entropy(at::eye(N), wt, targets, vp, fo);
      EXPECT_LT(max_rel(loss, expect), 1e-6) << "pad " << pad << " chunk " << chunk;
      loss.backward();
      at::Tensor dlogits = padded_rows(whole.grad().t(), P, begin, n);  // zero on padding
      EXPECT_LT(max_rel(wt.grad(), dlogits), 1e-6) << "pad " << pad << " chunk " << chunk;
    }
  }
  // Every target ignored: NaN like at::cross_entropy_loss.
  VocabParallel vp;
  vp.group = g;
  vp.vocab_begin = r * 20;
  vp.vocab_size = V;
  at::Tensor none = at::full({N}, -100, at::kLong);
  EXPECT_TRUE(
      std::isnan(vocab_parallel_linear_cross_entropy(at::eye(N), at::zeros({20, N}), none, vp)
                     .item<double>()));
}

// Random hidden states and weight through the region entry: loss, dL/dhidden (summed over the
// group by copy_to_region) and each rank's rows of dL/dweight.
TEST(VocabParallelCE, HiddenAndWeightGradientsEqualTheWholeOnes) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size(), r = g.rank();
  const int64_t V = 37, N = 24, H = 8;
  const at::Tensor h0 = shared_randn({2, N / 2, H}, 3), w0 = shared_randn({V, H}, 4);
  const at::Tensor targets = shared_targets({2, N / 2}, V, 5);
  at::Tensor hw = h0.clone().requires_grad_(), ww = w0.clone().requires_grad_();
  at::Tensor expect =
      at::cross_entropy_loss(at::linear(hw, ww).reshape({N, V}), targets.reshape({N}), std::nullopt,
                             at::Reduction::Mean, -100);
  expect.backward();
  const int64_t m = 4 * w, P = (V + m - 1) / m * m, n = P / w;
  at::Tensor hp = h0.clone().requires_grad_();
  at::Tensor wp = padded_rows(w0, P, r * n, n).contiguous().requires_grad_();
  VocabParallel vp;
  vp.group = g;
  vp.vocab_begin = r * n;
  vp.vocab_size = V;
  FusedCEOptions fo;
  fo.chunk_tokens = 7;
  at::Tensor loss = vocab_parallel_linear_cross_entropy(copy_to_region(hp, g), wp, targets, vp, fo);
  EXPECT_LT(max_rel(loss, expect), 1e-6);
  loss.backward();
  EXPECT_LT(max_rel(hp.grad(), hw.grad()), 1e-5);
  EXPECT_LT(max_rel(wp.grad(), padded_rows(ww.grad(), P, r * n, n)), 1e-5);
}

// bf16 and fp16 (whose dlogits stay unscaled until backward): against the whole fused CE in the
// same dtype. Both round the logits and dlogits to the working dtype, at different points of
// the same sums, so the bound is a few ulps of the dtype (2^-8 bf16, 2^-11 fp16) of the scale.
TEST(VocabParallelCE, ReducedPrecisionEqualsTheWholeFusedCE) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size(), r = g.rank();
  const int64_t V = 37, N = 24, H = 8;
  const at::Tensor targets = shared_targets({N}, V, 8);
  for (auto dt : {at::kBFloat16, at::kHalf}) {
    const double tol = dt == at::kBFloat16 ? 4.0 / 256 : 4.0 / 2048;
    const at::Tensor h0 = shared_randn({N, H}, 9).to(dt), w0 = shared_randn({V, H}, 10).to(dt);
    at::Tensor hw = h0.clone().requires_grad_(), ww = w0.clone().requires_grad_();
    FusedCEOptions fo;
    fo.chunk_tokens = 7;
    at::Tensor expect = fused_linear_cross_entropy(hw, ww, targets, fo);
    (expect * 1024).backward();  // a loss scale, as the fp16 optimizer applies
    const int64_t m = 4 * w, P = (V + m - 1) / m * m, n = P / w;
    at::Tensor hp = h0.clone().requires_grad_();
    at::Tensor wp = padded_rows(w0, P, r * n, n).contiguous().requires_grad_();
    VocabParallel vp;
    vp.group = g;
    vp.vocab_begin = r * n;
    vp.vocab_size = V;
    at::Tensor loss =
        vocab_parallel_linear_cross_entropy(copy_to_region(hp, g), wp, targets, vp, fo);
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
    EXPECT_LT(max_rel(loss, expect), tol) << dt;
    (loss * 1024).backward();
    EXPECT_EQ(wp.grad().scalar_type(), dt);
    EXPECT_LT(max_rel(hp.grad().to(at::kFloat), hw.grad().to(at::kFloat)), tol) << dt;
    EXPECT_LT(max_rel(wp.grad().to(at::kFloat), padded_rows(ww.grad().to(at::kFloat), P, r * n, n)),
              tol)
        << dt;
  }
}

TEST(VocabParallel, PaddedEmbeddingEqualsTheWholeOne) {
  dist::Communicator g = dist::world();
  const int64_t w = g.size();
  const int64_t V = 13, D = 5;
  Embedding whole(EmbeddingOptions(V, D).padding_idx(3));
  Embedding part(EmbeddingOptions(V, D).padding_idx(3));
  ShardSpec spec = ShardSpec::over(ShardSpec::Kind::Vocab, g);
  spec.pad_multiple = 4;
  part.shard(spec);
  const int64_t P = (V + 4 * w - 1) / (4 * w) * (4 * w);
  EXPECT_EQ(part.padded_vocab_size(), P);
  EXPECT_EQ(part.num_embeddings(), P / w);
  EXPECT_EQ(part.full_shape("weight"), (std::vector<int64_t>{V, D}));  // HF-shaped
  EXPECT_EQ(part.valid_rows(), std::clamp<int64_t>(V - g.rank() * (P / w), 0, P / w));
  InitOptions io;
  io.seed = 9;
  init_parameters(whole, io);
  init_parameters(part, io);  // name-keyed: the shard gets its rows of the same values, padded
  EXPECT_TRUE(part.weight()
                  .narrow(0, part.valid_rows(), P / w - part.valid_rows())
                  .eq(0)
                  .all()
                  .item<bool>());
  at::manual_seed(1);
  const at::Tensor ids = at::randint(0, V, {3, 8}, at::kLong);
  const at::Tensor dy = shared_randn({3, 8, D}, 2);
  at::Tensor y_whole = whole.forward(ids), y_part = part.forward(ids);
  EXPECT_TRUE(at::equal(y_part, y_whole));
  y_whole.backward(dy);
  y_part.backward(dy);
  EXPECT_TRUE(at::equal(part.weight().grad(), part.shard_slice("weight", whole.weight().grad())));
  // The tied-head projection: this rank's columns of the padded vocabulary, the gradient of the
  // hidden state summed over the group.
  const at::Tensor hid = shared_randn({3, 8, D}, 6), dl = shared_randn({3, 8, V}, 7);
  at::Tensor hw = hid.clone().requires_grad_(), hp = hid.clone().requires_grad_();
  at::Tensor lw = whole.project(hw);
  lw.backward(dl);
  at::Tensor lp = part.project(hp);
  const int64_t begin = part.vocab_begin(), n = part.num_embeddings();
  at::Tensor lw_cols = padded_rows(lw.detach().reshape({-1, V}).t(), P, begin, n).t();
  EXPECT_LT(max_rel(lp.detach().reshape({-1, n}), lw_cols), 1e-6);
  lp.backward(padded_rows(dl.reshape({-1, V}).t(), P, begin, n).t().reshape({3, 8, n}));
  EXPECT_LT(max_rel(hp.grad(), hw.grad()), 1e-5);
  // Gathered (parallel_output=false): the whole vocabulary, padding cut.
  Embedding gathered(EmbeddingOptions(V, D));
  spec.gather_output = true;
  gathered.shard(spec);
  init_parameters(gathered, io);
  Embedding plain(EmbeddingOptions(V, D));
  init_parameters(plain, io);
  EXPECT_LT(max_rel(gathered.project(hid), plain.project(hid)), 1e-6);
  // split_gather: the partial lookups are reduce-scattered along the sequence.
  Embedding seq(EmbeddingOptions(V, D).padding_idx(3));
  ShardSpec sspec = ShardSpec::over(ShardSpec::Kind::Vocab, g, SequenceParallelMode::SplitGather);
  sspec.pad_multiple = 4;
  seq.shard(sspec);
  init_parameters(seq, io);
  const int64_t s = 8 / w;
  EXPECT_TRUE(at::equal(seq.forward(ids), y_whole.detach().narrow(1, g.rank() * s, s)));
  // ring: the embedding's part is the same reduce-scatter.
  Embedding ring(EmbeddingOptions(V, D).padding_idx(3));
  ShardSpec rspec = ShardSpec::over(ShardSpec::Kind::Vocab, g, SequenceParallelMode::Ring);
  rspec.pad_multiple = 4;
  ring.shard(rspec);
  init_parameters(ring, io);
  EXPECT_TRUE(at::equal(ring.forward(ids), y_whole.detach().narrow(1, g.rank() * s, s)));
  // Bad input is named.
  Embedding bad(EmbeddingOptions(V, D));
  ShardSpec bspec = ShardSpec::over(ShardSpec::Kind::Vocab, g);
  bspec.pad_multiple = 0;
  EXPECT_THROW(bad.shard(bspec), InputError);
  Embedding odd(EmbeddingOptions(V, D));
  EXPECT_THROW(odd.shard(ShardSpec::over(ShardSpec::Kind::Vocab, g)), InputError);  // 13 % w
}

namespace {

struct Case {
  bool tied;
  bool parallel_output;
  int64_t divisible_by;
  SequenceParallelMode sp;
};

std::string describe(const Case& k) {
  return std::string(k.tied ? "tied" : "untied") +
         (k.parallel_output ? " parallel_output" : " gathered") + " pad " +
         std::to_string(k.divisible_by) + " sp " + dist::to_string(k.sp);
}

ModelConfig tiny_config(bool tied) {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 37;  // no tp divides it: the vocabulary is padded
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 4;
  c.layer_sliding.assign(2, false);
  c.qkv_bias = true;
  c.tie_word_embeddings = tied;
  return c;
}

void check_llama(const Case& k) {
  SCOPED_TRACE(describe(k));
  dist::Communicator g = dist::world();
  const ModelConfig c = tiny_config(k.tied);
  InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  auto whole = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  init_parameters(*whole, io);
  auto tp = std::make_shared<CausalLM>(c, at::TensorOptions().device(at::kMeta));
  check_tensor_parallel(c, g.size());
  PlanOptions po;
  po.tp = g;
  po.sequence_parallel = k.sp;
  TensorParallelOptions tpo;
  tpo.make_vocab_size_divisible_by = k.divisible_by;
  tpo.parallel_output = k.parallel_output;
  EXPECT_EQ(apply_plan(*tp, tensor_parallel_plan(c, tpo), po),
            (k.tied ? 1 : 2) + 7 * c.num_hidden_layers);
  init_parameters(*tp, io);
  at::manual_seed(3);
  const at::Tensor ids = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
  at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, 11), {0, 1}, -100);
  targets.select(1, 4).fill_(-100);
  // Logits: the whole ones, or this rank's columns of the padded vocabulary.
  {
    at::NoGradGuard ng;
    at::Tensor lw = whole->forward(ids), lt = tp->forward(ids);
    if (k.parallel_output) {
      const int64_t n = lt.size(-1), P = n * g.size();
      at::Tensor cols = padded_rows(lw.reshape({-1, c.vocab_size}).t(), P, g.rank() * n, n)
                            .t()
                            .reshape({2, 12, n});
      EXPECT_LT(max_rel(lt, cols), 1e-5);
    } else {
      ASSERT_EQ(lt.sizes(), lw.sizes());
      EXPECT_LT(max_rel(lt, lw), 1e-5);
    }
  }
  // Decoding needs the whole vocabulary's logits: refused while they stay sharded.
  if (k.sp == SequenceParallelMode::Off) {
    const at::Tensor prompt = ids.narrow(1, 0, 4);
    if (k.parallel_output)
      EXPECT_THROW(generate_greedy(*tp, prompt, 3), InputError);
    else
      EXPECT_TRUE(at::equal(generate_greedy(*tp, prompt, 3), generate_greedy(*whole, prompt, 3)));
  }
  at::Tensor loss_tp = tp->forward_loss(ids, targets, /*chunk_tokens=*/7),
             loss_whole = whole->forward_loss(ids, targets);
  EXPECT_LT(std::abs(loss_tp.item<double>() / loss_whole.item<double>() - 1), 1e-5);
  loss_tp.backward();
  loss_whole.backward();
  auto whole_params = whole->named_parameters();
  int64_t compared = 0;
  for (const auto& item : tp->named_parameters()) {
    const std::string& name = item.key();
    const size_t dot = name.rfind('.');
    auto* layer = dynamic_cast<Module*>(find_module(*tp, name.substr(0, dot)).get());
    ASSERT_NE(layer, nullptr) << name;
    at::Tensor grad = item.value().grad();
    // Under split_gather a replicated layer (the norms) sees only this rank's tokens: its
    // gradient is the sum over the group (what the plugin all-reduces).
    if (k.sp != SequenceParallelMode::Off && !layer->shard_spec()) {
      grad = grad.clone();
      g.all_reduce(grad, dist::ReduceOp::Sum);
    }
    at::Tensor expect = layer->shard_slice(name.substr(dot + 1), whole_params[name].grad());
    // fp32: the sharded model sums some products in another order (partial GEMMs plus an
    // all-reduce, the softmax's sum over ranks); 2^-24-relative roundings over two layers.
    EXPECT_LT(max_rel(grad, expect), 1e-5) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(whole_params.size()));
}

}  // namespace

TEST(TensorParallel, VocabParallelLlamaEqualsTheWholeModel) {
  for (bool tied : {false, true})
    for (bool parallel_output : {true, false})
      for (int64_t pad : {int64_t(4), int64_t(64)})
        check_llama({tied, parallel_output, pad, SequenceParallelMode::Off});
}

TEST(TensorParallel, VocabParallelLlamaUnderSplitGather) {
  for (bool tied : {false, true})
    for (bool parallel_output : {true, false})
      check_llama({tied, parallel_output, 4, SequenceParallelMode::SplitGather});
}
