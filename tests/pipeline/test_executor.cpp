// The pipeline interpreter on a toy model (RANKS 2 and 4 over Gloo): V virtual stages, each a
// tanh(Linear) block, the last also taking a mean-squared loss. Every rank builds all V blocks
// with the same seed and runs the chunks the placement gives it; the reference chains all V in
// one process over the same micro-batches. Every generated style (gpipe, 1f1b, interleaved,
// zbh1, zbv) must give the reference's losses and gradients (fp32: the same operations in the
// same order per micro-batch, accumulated in the same order; 1e-6 relative of the largest entry
// covers the remaining summation-order rounding of 2^-24 per operation), with and without the
// metadata cache, and free every activation. Also: a boundary tensor of another dtype and rank
// (shapes are sent, not assumed), and timings recorded per instruction.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/pipeline/executor.h"
#include "colossal/pipeline/layers.h"
#include "colossal/pipeline/schedule.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::pipeline;

namespace {

constexpr int64_t kDim = 6, kRows = 2;

struct Toy {
  std::vector<at::Tensor> w, b;  // per virtual stage
  explicit Toy(int V) {
    at::manual_seed(7);
    for (int v = 0; v < V; ++v) {
      w.push_back((at::randn({kDim, kDim}) * 0.5).requires_grad_(true));
      b.push_back((at::randn({kDim}) * 0.1).requires_grad_(true));
    }
  }
  at::Tensor block(int v, const at::Tensor& x) const { return at::tanh(at::linear(x, w[v], b[v])); }
};

at::Tensor micro_input(int mb) {
  at::manual_seed(100 + mb);
  return at::randn({kRows, kDim});
}
at::Tensor micro_target(int mb) {
  at::manual_seed(200 + mb);
  return at::randn({kRows, kDim});
}

void run_schedule(const Schedule& s, bool cache) {
  const ScheduleOptions so{s.name, s.stages, s.microbatches, s.chunks};  // for the messages
  const int V = s.virtual_stages(), M = s.microbatches;
  Toy ref(V), toy(V);
  // Reference: one process, every micro-batch through all blocks, loss mean / M.
  std::vector<double> ref_losses;
  for (int mb = 0; mb < M; ++mb) {
    at::Tensor x = micro_input(mb);
    for (int v = 0; v < V; ++v) x = ref.block(v, x);
    at::Tensor loss = at::mse_loss(x, micro_target(mb)) / static_cast<double>(M);
    loss.backward();
    ref_losses.push_back(loss.item<double>());
  }
  dist::Communicator world = dist::world();
  const int rank = world.rank();
  StageFunctions f;
  f.forward = [&](int mb, int chunk, const at::Tensor& input) {
    const int v = s.virtual_stage(rank, chunk);
    at::Tensor x = toy.block(v, v == 0 ? micro_input(mb) : input);
    if (v == V - 1) return at::mse_loss(x, micro_target(mb)) / static_cast<double>(M);
    return x;
  };
  f.parameters = [&](int chunk) {
    const int v = s.virtual_stage(rank, chunk);
    return std::vector<at::Tensor>{toy.w[v], toy.b[v]};
  };
  ExecutorOptions eo;
  eo.enable_metadata_cache = cache;
  eo.record_timings = true;
  Executor exec(s, world, f, eo);
  for (int rep = 0; rep < 2; ++rep) {  // twice: the executor is reused across steps
    for (auto& t : toy.w) t.mutable_grad() = at::Tensor();
    for (auto& t : toy.b) t.mutable_grad() = at::Tensor();
    std::vector<at::Tensor> losses = exec.run();
    if (exec.holds_last()) {
      ASSERT_EQ(static_cast<int>(losses.size()), M);
      for (int mb = 0; mb < M; ++mb)
        EXPECT_NEAR(losses[mb].item<double>(), ref_losses[mb], 1e-6 * std::abs(ref_losses[mb]))
            << so.style << " mb " << mb;
    } else {
      EXPECT_TRUE(losses.empty());
    }
    for (int c = 0; c < s.chunks; ++c) {
      const int v = s.virtual_stage(rank, c);
      for (auto [got, want] : {std::pair{toy.w[v], ref.w[v]}, std::pair{toy.b[v], ref.b[v]}}) {
        ASSERT_TRUE(got.grad().defined()) << so.style << " v " << v;
        const double err = (got.grad() - want.grad()).abs().max().item<double>() /
                           want.grad().abs().max().item<double>();
        EXPECT_LT(err, 1e-6) << so.style << " v " << v;
      }
    }
    // Every instruction of this rank was timed, in order.
    const auto& t = exec.last_timings();
    ASSERT_EQ(t.size(), s.ranks[rank].size());
    for (size_t i = 0; i < t.size(); ++i) {
      EXPECT_EQ(t[i].instr, s.ranks[rank][i]);
      EXPECT_LE(t[i].start, t[i].end);
    }
  }
  EXPECT_GE(exec.last_peak_activations(), 1);
}

}  // namespace

TEST(Executor, EveryStyleEqualsOneProcess) {
  const int S = dist::world_size();
  for (bool cache : {true, false}) {
    auto run_style = [&](const ScheduleOptions& so) { run_schedule(make_schedule(so), cache); };
    run_style({"gpipe", S, 4, 1});
    run_style({"1f1b", S, S, 1});
    run_style({"1f1b", S, 2 * S + 1, 1});
    run_style({"interleaved", S, 2 * S, 2});
    run_style({"zbh1", S, 2 * S, 1});
    run_style({"zbv", S, 2 * S, 2});
  }
}

// A user's table whose batches hold two messages of one channel (both of GPipe's forwards
// leave in one batch, both backwards come back in one): the second reuses the metadata the first
// brings in the same batch.
TEST(Executor, TwoMessagesOfOneChannelInOneBatch) {
  if (dist::world_size() != 2) GTEST_SKIP() << "a 2-stage table";
  const Schedule s = parse_schedule_table(
      "# stages=2 microbatches=2 chunks=1 placement=loop name=batched\n"
      "0,F,0,0\n0,F,1,0\n0,SendF,0,0\n0,SendF,1,0\n0,RecvB,1,0\n0,RecvB,0,0\n"
      "0,BW,1,0\n0,BW,0,0\n"
      "1,RecvF,0,0\n1,RecvF,1,0\n1,F,0,0\n1,F,1,0\n1,BW,1,0\n1,BW,0,0\n"
      "1,SendB,1,0\n1,SendB,0,0\n");
  for (bool cache : {true, false}) run_schedule(s, cache);
}

// A boundary of another dtype and rank: the metadata describes whatever the stage sends.
TEST(Executor, SendsWhateverShapeAndDtypeTheStageMakes) {
  const int S = dist::world_size();
  if (S < 2) GTEST_SKIP() << "needs a boundary between ranks";
  Schedule s = make_schedule({"1f1b", S, S, 1});
  const int rank = dist::world().rank();
  at::Tensor w = at::ones({3}, at::kDouble).requires_grad_(true);
  StageFunctions f;
  f.forward = [&](int mb, int, const at::Tensor& input) {
    if (rank == 0)
      return (at::full({2, 3, 4}, static_cast<double>(mb + 1), at::kDouble) * w.view({1, 3, 1}));
    EXPECT_EQ(input.scalar_type(), at::kDouble);
    EXPECT_EQ(input.sizes(), (std::vector<int64_t>{2, 3, 4}));
    at::Tensor out = input * w.view({1, 3, 1});
    if (rank == S - 1) return out.sum();
    return out;
  };
  f.parameters = [&](int) { return std::vector<at::Tensor>{w}; };
  Executor exec(s, dist::world(), f);
  auto losses = exec.run();
  if (rank == S - 1) {
    // sum over mb of (mb+1) * 8 per w entry, w = 1: 8 * sum(mb+1) * 3.
    double expect = 0;
    for (int mb = 0; mb < S; ++mb) expect += 24.0 * (mb + 1);
    double got = 0;
    for (auto& l : losses) got += l.item<double>();
    EXPECT_DOUBLE_EQ(got, expect);
  }
  // loss = sum over mb of 8 (mb+1) prod_r w_r[j] summed over j: d/dw_r[j] = 8 sum(mb+1) (w = 1).
  double sum_mb = 0;
  for (int mb = 0; mb < S; ++mb) sum_mb += mb + 1;
  EXPECT_TRUE(at::allclose(w.grad(), at::full({3}, 8.0 * sum_mb, at::kDouble)));
}

TEST(Executor, RefusesAScheduleForAnotherNumberOfStages) {
  const int S = dist::world_size();
  Schedule s = make_schedule({"1f1b", S + 1, S + 1, 1});
  StageFunctions f;
  f.forward = [](int, int, const at::Tensor& x) { return x; };
  f.parameters = [](int) { return std::vector<at::Tensor>{}; };
  try {
    Executor exec(s, dist::world(), f);
    ADD_FAILURE() << "accepted a schedule of " << S + 1 << " stages on " << S << " ranks";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("stages"), std::string::npos) << e.what();
  }
}

// One rank, two chunks of a real model (the V placement's turn and interleaved's two chunks are
// hand-overs on the rank, no messages), on the CPU and, where there is one, on the GPU through the
// fused kernels: ZB-V's B/W split (with the weight-gradient store, the linears deferring their
// dW GEMMs to W, and without it) and the interleaved order equal the whole model run on the same
// micro-batches. fp32; the fused kernels round differently from the unfused path by float
// rounding: 1e-4 of the largest entry (1e-5 on the CPU, where the operations are the same).
static void two_chunks_of_a_model(const at::Device dev, double tol) {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.layer_sliding.assign(4, false);
  c.tie_word_embeddings = true;
  auto make = [&] {
    auto m = std::make_shared<models::CausalLM>(c, at::TensorOptions().device(dev));
    nn::InitOptions io;
    io.seed = 5;
    io.std = 0.2;
    nn::init_parameters(*m, io);
    return m;
  };
  constexpr int M = 4;
  std::vector<at::Tensor> ids, targets;
  for (int mb = 0; mb < M; ++mb) {
    at::manual_seed(300 + mb);
    ids.push_back(at::randint(0, c.vocab_size, {2, 16}, at::kLong).to(dev));
    targets.push_back(at::randint(0, c.vocab_size, {2, 16}, at::kLong).to(dev));
  }
  auto whole = make();
  for (int mb = 0; mb < M; ++mb) (whole->forward_loss(ids[mb], targets[mb]) / M).backward();
  auto want = whole->named_parameters(true);
  for (auto [style, store] : std::vector<std::pair<std::string, bool>>{
           {"zbv", true}, {"zbv", false}, {"interleaved", false}}) {
    auto stage = make();
    int64_t deferring = 0;
    if (store)
      for (auto& m : stage->modules(false))
        if (auto* linear = dynamic_cast<nn::Linear*>(m.get())) {
          linear->set_defer_weight_grad(true);
          ++deferring;
        }
    stage->keep_chunks(rank_block_ranges(distribute_layers(c.num_hidden_layers, 1, 2), 1, 0, true));
    Schedule s = make_schedule({style, 1, M, 2});
    StageFunctions f;
    f.forward = [&](int mb, int chunk, const at::Tensor& input) {
      if (chunk == 0) return stage->forward_chunk(0, ids[mb]);
      return stage->forward_chunk_loss(1, input, targets[mb]) / M;
    };
    f.parameters = [&](int) {
      std::vector<at::Tensor> out;
      for (auto& p : stage->parameters()) out.push_back(p);
      return out;
    };
    ExecutorOptions eo;
    eo.device = dev;
    eo.weight_grad_store = store;
    Executor exec(s, dist::world(), f, eo);
    exec.run();
    if (store) {
      EXPECT_GT(deferring, 0);
    }
    for (auto& item : stage->named_parameters(true)) {
      const at::Tensor& w = want[item.key()].grad();
      ASSERT_TRUE(item.value().grad().defined()) << style << " " << item.key();
      EXPECT_LE((item.value().grad() - w).abs().max().item<double>(),
                tol * w.abs().max().item<double>() + 1e-12)
          << style << " store " << store << " " << item.key();
    }
  }
}

TEST(Executor, TwoChunksOfAModelOnOneRank) {
  if (dist::world_size() != 1) GTEST_SKIP() << "one rank";
  two_chunks_of_a_model(at::kCPU, 1e-5);
}

TEST(Executor, TwoChunksOfAModelOnOneGpu) {
  if (dist::world_size() != 1) GTEST_SKIP() << "one rank";
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  two_chunks_of_a_model(Accelerator::cuda().device(), 1e-4);
}
