// Gemini chunks and the gemini plugin at the world size `colossal run` gives (1, 2 and 4 in make
// test): the tensor state machine refuses illegal transitions by name; the chunk size search
// picks the least waste; a tiny Llama under the plugin trains as ddp does (with and without
// activation checkpointing); between steps every sharded chunk holds only its shard (the
// manager's accounting and the chunk objects agree); a no_grad forward releases every sharded
// chunk; a checkpointed forward keeps the decoder layers' chunks released until backward.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

#include "colossal/amp/grad_reducer.h"
#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/booster/plugins/gemini_plugin.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/optim/adamw.h"
#include "colossal/zero/gemini/chunk.h"
#include "colossal/zero/gemini/chunk_manager.h"
#include "common/adamw_groups.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;
namespace gm = colossal::zero::gemini;

TEST(GeminiChunk, OnlyLegalTransitions) {
  using S = gm::TensorState;
  const S all[] = {S::Free, S::Compute, S::Hold, S::HoldAfterBwd, S::ReadyForReduce};
  int legal = 0;
  for (S a : all)
    for (S b : all) legal += gm::legal_transition(a, b) ? 1 : 0;
  EXPECT_EQ(legal, 10);  // the table in chunk.h
  EXPECT_FALSE(gm::legal_transition(S::Free, S::HoldAfterBwd));
  EXPECT_FALSE(gm::legal_transition(S::ReadyForReduce, S::Compute));

  // A chunk of two parameters over the world group.
  const int W = dist::world_size();
  auto a = at::arange(10, at::kFloat).set_requires_grad(true);
  auto b = at::arange(7, at::kFloat).reshape({7, 1}).set_requires_grad(true);
  gm::Chunk c(3, 20 * W, at::kFloat, at::kCPU, /*sharded=*/true, dist::world());
  c.append("a", a);
  c.append("b", b);
  c.finalize();
  EXPECT_EQ(c.used(), 17);
  EXPECT_TRUE(c.gathered());
  EXPECT_EQ(a.data_ptr<float>(), c.full().data_ptr<float>());  // the parameter is a view now
  c.release();
  if (W > 1) {
    EXPECT_FALSE(c.gathered());
    EXPECT_EQ(a.sizes(), at::IntArrayRef({10}));  // shape kept, storage one element
    EXPECT_TRUE(at::isnan(a).all().item<bool>());
    EXPECT_EQ(c.tensors()[0].state, S::Free);
    // A gradient for a parameter whose chunk was never gathered: an Error naming everything.
    try {
      c.set_state(0, S::HoldAfterBwd);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("chunk 3"), std::string::npos) << m;
      EXPECT_NE(m.find("'a'"), std::string::npos) << m;
      EXPECT_NE(m.find("FREE -> HOLD_AFTER_BWD"), std::string::npos) << m;
    }
  }
  c.access();
  EXPECT_TRUE(c.gathered());
  EXPECT_TRUE(a.equal(at::arange(10, at::kFloat)));
  EXPECT_TRUE(b.equal(at::arange(7, at::kFloat).reshape({7, 1})));
  c.set_state(1, S::Compute);
  if (W > 1) {
    EXPECT_THROW(c.release(), Error);  // in use
  }
  c.set_state(1, S::Hold);
  c.release();
}

TEST(GeminiChunk, SearchPicksLeastWaste) {
  const std::vector<int64_t> numels = {5000, 3000, 9000, 100, 100, 7000, 2500, 9000};
  gm::ChunkSearchOptions o;
  o.min_chunk_size_m = 8000.0 / (1 << 20);
  o.search_range_m = 8192.0 / (1 << 20);
  o.hidden_dim = 256;
  for (int dp : {1, 2, 4}) {
    auto r = gm::search_chunk_size(numels, dp, o);
    EXPECT_EQ(r.chunk_size % dp, 0);
    EXPECT_GE(r.chunk_size, 9000);
    // Brute force over the same candidates.
    int64_t best = -1;
    for (int64_t s = 9216; s <= 9216 + 8192; s += 256) {
      int64_t size = (s + dp - 1) / dp * dp;
      auto [n, w] = gm::pack(numels, size, dp);
      if (best < 0 || w < best) best = w;
    }
    EXPECT_EQ(r.wasted, best);
    EXPECT_EQ(gm::pack(numels, r.chunk_size, dp).second, r.wasted);
  }
  // A model below min_chunk_size is one chunk of its own size (rounded to dp).
  o.min_chunk_size_m = 1;
  auto r = gm::search_chunk_size(numels, 4, o);
  EXPECT_EQ(r.num_chunks, 1);
  EXPECT_EQ(r.chunk_size, 35700);
}

models::ModelConfig tiny_config() {
  return models::ModelConfig::from_json(json::parse(
      R"({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": false})"));
}

std::shared_ptr<models::CausalLM> tiny_model() {
  auto m = std::make_shared<models::CausalLM>(tiny_config());
  nn::InitOptions io;
  io.seed = 5;
  nn::init_parameters(*m, io);
  return m;
}

std::shared_ptr<optim::AdamW> adamw(torch::nn::Module& m) {
  return tests::adamw_decay_groups(m, 3e-3, 0.1);
}

std::pair<at::Tensor, at::Tensor> batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(31 + step));
  at::Tensor ids = at::randint(0, 96, {rows, 17}, gen, at::TensorOptions().dtype(at::kLong));
  return {ids.narrow(1, 0, 16), ids.narrow(1, 1, 16)};
}

struct TrainRun {
  std::shared_ptr<models::CausalLM> model;
  std::unique_ptr<booster::Booster> booster;
  booster::Boosted b;
  std::vector<double> losses;
  std::vector<double> norms;  // the global gradient norm before clipping, per step
  at::Device device{at::kCPU};
};

TrainRun boosted(std::shared_ptr<booster::Plugin> plugin,
                 nn::CheckpointMode ckpt = nn::CheckpointMode::None) {
  TrainRun r;
  r.model = tiny_model();
  r.model->set_activation_checkpointing(ckpt);
  r.booster = std::make_unique<booster::Booster>(std::move(plugin));
  r.b = r.booster->boost(r.model, adamw(*r.model));
  return r;
}

std::shared_ptr<booster::GeminiPlugin> gemini(double shard = 1.0, double optim = 0.0,
                                              double param = 0.0, bool overlap = true) {
  booster::GeminiPluginOptions o;
  o.overlap_cpu_adam = overlap;
  o.precision = "fp32";
  o.shard_param_frac = shard;
  o.offload_optim_frac = optim;
  o.offload_param_frac = param;
  o.min_chunk_size_m = 0.005;  // 5243 elements: chunks hold one to a few weights
  o.search_range_m = 0.01;
  o.max_prefetch = 1;
  return std::make_shared<booster::GeminiPlugin>(o);
}

// Checks the invariant between two steps: nothing gathered, each sharded chunk holds only its
// shard, and the manager's report says the same.
void expect_only_shards(gm::ChunkManager& m) {
  int64_t shard_bytes = 0;
  for (size_t i = 0; i < m.num_chunks(); ++i) {
    const gm::Chunk& c = m.chunk(i);
    EXPECT_FALSE(c.gather_in_flight()) << "chunk " << i;
    if (c.releasable()) {  // sharded over W > 1, or one rank with its parameters on the host
      EXPECT_FALSE(c.gathered()) << "chunk " << i;
      for (auto& t : c.tensors()) EXPECT_EQ(t.state, gm::TensorState::Free) << t.name;
    }
    shard_bytes += c.shard_bytes();
  }
  auto r = m.memory_report();
  EXPECT_EQ(r.gathered_chunks, 0);
  EXPECT_EQ(r.param_device + r.param_host, shard_bytes);
}

void train(TrainRun& r, int steps, bool check_shards = false) {
  const int W = dist::world_size(), rank = dist::rank();
  const int64_t B = 8 / W;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s % 2, 8);  // two batches, seen again and again: the loss falls
    at::Tensor loss = r.model->forward_loss(x.narrow(0, rank * B, B).to(r.device),
                                            y.narrow(0, rank * B, B).to(r.device));
    r.booster->backward(loss, *r.b.optimizer);
    r.norms.push_back(r.booster->clip_grad_by_norm(*r.b.optimizer, 1.0));
    EXPECT_TRUE(r.b.optimizer->step());
    r.b.optimizer->zero_grad();
    at::Tensor l = loss.detach().to(at::kCPU, at::kDouble);
    dist::world().all_reduce(l, dist::ReduceOp::Avg);
    r.losses.push_back(l.item<double>());
    if (check_shards)
      expect_only_shards(dynamic_cast<booster::GeminiOptimizerWrapper&>(*r.b.optimizer).manager());
  }
}

double rel(double a, double b) {
  return std::abs(a - b) / std::max(1e-12, std::abs(b));
}

TEST(GeminiPlugin, TrainsAsDdpAndHoldsOnlyShardsBetweenSteps) {
  TrainRun ddp = boosted(std::make_shared<booster::DDPPlugin>(booster::DDPOptions{}));
  train(ddp, 6);
  EXPECT_LT(ddp.losses.back(), ddp.losses.front());
  for (auto [shard, optim, param] :
       {std::tuple{1.0, 0.0, 0.0}, std::tuple{1.0, 1.0, 1.0}, std::tuple{0.5, 0.5, 0.5}}) {
    TrainRun g = boosted(gemini(shard, optim, param));
    auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
    EXPECT_GT(m.num_chunks(), 3u);
    expect_only_shards(m);  // right after boost, too
    train(g, 6, /*check_shards=*/true);
    for (size_t s = 0; s < ddp.losses.size(); ++s) {
      EXPECT_LT(rel(g.losses[s], ddp.losses[s]), 1e-5)
          << shard << "/" << optim << "/" << param << " step " << s;
      EXPECT_LT(rel(g.norms[s], ddp.norms[s]), 1e-5)
          << shard << "/" << optim << "/" << param << " step " << s;
    }
    // Offloaded optimizer chunks are host-resident, and counted there.
    auto r = m.memory_report();
    int64_t host_chunks = 0;
    for (size_t i = 0; i < m.num_chunks(); ++i)
      host_chunks += m.optim_place(i) == gm::Place::Host ? 1 : 0;
    if (optim == 0.0) {
      EXPECT_EQ(r.master_host + r.optim_host + r.grad_host, 0);
    }
    if (optim == 1.0) {
      EXPECT_EQ(r.master_device + r.optim_device + r.grad_device, 0);
    }
    if (optim == 0.5) {
      EXPECT_TRUE(host_chunks > 0 && host_chunks < static_cast<int64_t>(m.num_chunks()));
    }
    // The report as JSON.
    json::Value j = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).memory_report();
    EXPECT_EQ(j.at("num_chunks").as_int(), static_cast<int64_t>(m.num_chunks()));
    EXPECT_GT(j.at("peak_device").as_int(), 0);
  }
}

// The injected norm reducer (obstacle 7): the RMSNorm weights stand for parameters replicated
// over a "tp" axis whose second rank is simulated by adding its contribution by hand. Counted
// on tp rank 0 only, they enter the composed norm once from either tp rank: |a|^2 + 2|b|^2
// (a: norm weights, b: the rest, split over tp), read through the per-parameter path over
// chunks that mix both kinds.
TEST(GeminiPlugin, ComposedNormReducerCountsReplicatedParametersOnce) {
  TrainRun g = boosted(gemini(0.5));
  auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
  const int W = dist::world_size(), rank = dist::rank();
  auto [x, y] = batch(0, 8);
  at::Tensor loss =
      g.model->forward_loss(x.narrow(0, rank * (8 / W), 8 / W), y.narrow(0, rank * (8 / W), 8 / W));
  g.booster->backward(loss, *g.b.optimizer);
  const double all2 = std::pow(m.grad_norm(1.0), 2);
  auto replicated = [](const std::string& name) {
    return name.find("norm") != std::string::npos ? std::vector<std::string>{"tp"}
                                                  : std::vector<std::string>{};
  };
  auto with_peer = [&](int tp_rank, double theirs) {
    amp::GradReducer peer;
    peer.axes.push_back({"tp", tp_rank, 2});
    peer.all_reduce_sum = [theirs](at::Tensor& t) { t.add_(theirs); };
    peer.all_reduce_max = [](at::Tensor&) {};
    m.set_norm_reducer(
        amp::compose(
            {amp::over(W > 1 ? dist::world() : dist::Communicator(), at::kCPU, "dp"), peer}),
        replicated);
    return std::pow(m.grad_norm(1.0), 2);
  };
  const double b2 = with_peer(1, 0.0);  // tp rank 1 alone: the norm weights are not its to count
  const double a2 = all2 - b2;
  EXPECT_GT(a2, 1e-6 * all2);  // the norm weights have gradients: counting them matters
  EXPECT_NEAR(with_peer(0, 0.0), all2, 1e-12 * all2);  // tp rank 0 alone counts everything
  EXPECT_NEAR(with_peer(0, b2), a2 + 2 * b2, 1e-12 * all2);
  EXPECT_NEAR(with_peer(1, a2 + b2), a2 + 2 * b2, 1e-12 * all2);
  g.b.optimizer->zero_grad();
}

// The CPU Adam of host chunks (optimizer data and parameter shard on the host) runs on a
// background thread beside the next forward; each chunk's access waits for its own update. The
// arithmetic is the same, so losses, norms and the final weights equal those of the in-step
// update bit for bit; with the overlap off nothing is deferred.
TEST(GeminiPlugin, CpuAdamBesideTheNextForwardIsExact) {
  std::vector<TrainRun> runs;
  for (bool overlap : {true, false}) {
    runs.push_back(boosted(gemini(1.0, 1.0, 1.0, overlap)));
    TrainRun& g = runs.back();
    auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
    train(g, 5, /*check_shards=*/true);
    if (overlap) {
      EXPECT_GT(m.deferred_updates(), 0);  // in every rank: each holds a shard of every chunk
    } else {
      EXPECT_EQ(m.deferred_updates(), 0);
    }
    g.b.model->wait_weights();  // waits for the last step's deferred updates
  }
  for (size_t s = 0; s < runs[0].losses.size(); ++s) {
    EXPECT_EQ(runs[0].losses[s], runs[1].losses[s]) << "step " << s;
    EXPECT_EQ(runs[0].norms[s], runs[1].norms[s]) << "step " << s;
  }
  auto off = runs[1].model->named_parameters(true);
  for (auto& item : runs[0].model->named_parameters(true))
    EXPECT_TRUE(item.value().equal(off[item.key()])) << item.key();
  // The optimizer state (moments written by the deferred update) as well.
  auto on_sd = runs[0].b.optimizer->full_state_dict();
  auto off_sd = runs[1].b.optimizer->full_state_dict();
  ASSERT_EQ(on_sd.tensors.size(), off_sd.tensors.size());
  for (size_t i = 0; i < on_sd.tensors.size(); ++i) {
    EXPECT_EQ(on_sd.tensors[i].first, off_sd.tensors[i].first);
    EXPECT_TRUE(on_sd.tensors[i].second.equal(off_sd.tensors[i].second)) << on_sd.tensors[i].first;
  }
}

// auto placement never plans more host memory than host_capacity_mb: what the host cannot hold
// goes to the device already in warm-up (whose own budget would have sent it to the host), and
// a model that fits neither side is refused at boost with both sizes named, before it allocates.
TEST(GeminiPlugin, AutoPlacementRespectsTheHostCapacity) {
  const double W = dist::world_size();  // each rank holds 1/W of the sharded chunk data
  auto plugin = [W](double device_mb, double host_mb) {
    device_mb /= W;
    host_mb /= W;
    booster::GeminiPluginOptions o;
    o.precision = "fp32";
    o.placement_policy = "auto";
    o.min_chunk_size_m = 0.005;
    o.search_range_m = 0.01;
    o.device_capacity_mb = device_mb;
    o.host_capacity_mb = host_mb;
    return std::make_shared<booster::GeminiPlugin>(o);
  };
  auto host_bytes = [](TrainRun& r) {
    auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*r.b.optimizer).manager();
    auto rep = m.memory_report();
    return rep.param_host + rep.master_host;
  };
  // Warm-up keeps 80 % of a 6 MB "device" for non-model data: 1.2 MB, less than the chunks'
  // 2.3 MB (parameters, masters, moments and gradients of the tiny model).
  TrainRun roomy = boosted(plugin(6, 0));
  EXPECT_GT(host_bytes(roomy), 0);
  TrainRun tight = boosted(plugin(6, 0.05));  // the host holds ~52 KB: the rest goes up
  EXPECT_LE(host_bytes(tight), static_cast<int64_t>(0.05 * 1024 * 1024 / W));
  EXPECT_LT(host_bytes(tight), host_bytes(roomy));
  train(tight, 2);
  EXPECT_LE(host_bytes(tight), static_cast<int64_t>(0.05 * 1024 * 1024 / W));
  try {
    boosted(plugin(0.2, 0.05));
    ADD_FAILURE() << "expected an InputError";
  } catch (const InputError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("host_capacity_mb"), std::string::npos) << w;
    EXPECT_NE(w.find("steady_cuda_cap_ratio"), std::string::npos) << w;
  }
}

TEST(GeminiPlugin, NoGradForwardReleasesEverySharedChunk) {
  TrainRun g = boosted(gemini());
  auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
  auto [x, y] = batch(0, 2);
  {
    c10::NoGradGuard no_grad;
    at::Tensor logits = g.model->forward(x);
    EXPECT_FALSE(at::isnan(logits).any().item<bool>());
  }
  expect_only_shards(m);
  // With grad on, the weights stay gathered for backward, then the reduce releases them.
  at::Tensor loss = g.model->forward_loss(x, y);
  if (dist::world_size() > 1) {
    EXPECT_GT(m.memory_report().gathered_chunks, 0);
  }
  g.booster->backward(loss, *g.b.optimizer);
  expect_only_shards(m);
  // Reading the weights from outside (checkpoint save) gathers them: values equal ddp's init.
  g.b.model->wait_weights();
  auto ref = tiny_model();
  auto rp = ref->named_parameters(true);
  for (auto& item : g.model->named_parameters(true))
    EXPECT_TRUE(item.value().equal(rp[item.key()])) << item.key();
  g.b.optimizer->zero_grad();
}

TEST(GeminiPlugin, CheckpointedLayersStayReleasedUntilBackward) {
  // Full activation checkpointing runs each decoder layer's forward under no_grad: its chunks are
  // released right after it and gathered again by the recompute in backward. Losses equal ddp.
  TrainRun ddp = boosted(std::make_shared<booster::DDPPlugin>(booster::DDPOptions{}),
                         nn::CheckpointMode::Full);
  train(ddp, 4);
  TrainRun g = boosted(gemini(), nn::CheckpointMode::Full);
  auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
  TrainRun plain = boosted(gemini());
  auto& mp = dynamic_cast<booster::GeminiOptimizerWrapper&>(*plain.b.optimizer).manager();
  auto [x, y] = batch(0, 2);
  at::Tensor l1 = g.model->forward_loss(x, y);
  at::Tensor l2 = plain.model->forward_loss(x, y);
  EXPECT_TRUE(l1.equal(l2));
  if (dist::world_size() > 1) {
    EXPECT_LT(m.memory_report().gathered_chunks, mp.memory_report().gathered_chunks);
  }
  g.booster->backward(l1, *g.b.optimizer);
  plain.booster->backward(l2, *plain.b.optimizer);
  expect_only_shards(m);
  g.b.optimizer->zero_grad();
  plain.b.optimizer->zero_grad();
  TrainRun g2 = boosted(gemini(), nn::CheckpointMode::Full);
  train(g2, 4, true);
  for (size_t s = 0; s < ddp.losses.size(); ++s)
    EXPECT_LT(rel(g2.losses[s], ddp.losses[s]), 1e-5) << "step " << s;
}

// For the H200 (skipped without CUDA; one rank): a bf16 model on the GPU with half of its
// optimizer chunks and half of its parameter chunks offloaded trains as ddp on the GPU does; the
// offloaded data sits in host memory and the weights are copied up for each use.
TEST(GeminiCuda, HalfOffloadedTrainsAsDdp) {
  if (!Accelerator::cuda().available() || dist::world_size() != 1)
    GTEST_SKIP() << "needs CUDA and one rank";
  booster::DDPOptions d;
  d.device = "cuda";
  d.precision = "bf16";
  TrainRun ddp = boosted(std::make_shared<booster::DDPPlugin>(d));
  ddp.device = Accelerator::cuda().device();
  train(ddp, 6);
  booster::GeminiPluginOptions o;
  o.device = "cuda";
  o.precision = "bf16";
  // The first 3/4 of the chunks keep their optimizer data on the host, the last half their
  // weights (one rank: copied up per use); the quarter with both takes its CPU Adam beside the
  // next forward.
  o.offload_optim_frac = 0.75;
  o.offload_param_frac = 0.5;
  o.min_chunk_size_m = 0.005;
  o.search_range_m = 0.01;
  TrainRun g = boosted(std::make_shared<booster::GeminiPlugin>(o));
  g.device = Accelerator::cuda().device();
  train(g, 6);
  // bf16 weights: the fused AdamW casts from masters that agree to ~1e-6; 1e-2 on the loss.
  // The norm is checked on its own (Adam hides a wrong clip coefficient from the loss): host
  // chunks' squares are summed on the GPU before their gradients go down; bf16 gradients of
  // the two runs differ by rounding, 1e-2.
  for (size_t s = 0; s < ddp.losses.size(); ++s) {
    EXPECT_LT(rel(g.losses[s], ddp.losses[s]), 1e-2) << "step " << s;
    EXPECT_LT(rel(g.norms[s], ddp.norms[s]), 1e-2) << "step " << s;
  }
  auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
  auto r = m.memory_report();
  EXPECT_GT(r.master_host, 0);
  EXPECT_GT(r.master_device, 0);
  EXPECT_GT(r.param_host, 0);
  EXPECT_GT(r.host_to_device, 0);
  EXPECT_GT(r.peak_device, 0);
  EXPECT_GT(m.deferred_updates(), 0);
  for (auto& p : g.model->parameters()) EXPECT_TRUE(p.is_cuda());
}

// A plain LibTorch model (no colossal::nn::Module, so no hook can gather its weights): every
// chunk stays replicated (ZeRO-DDP) and it trains as ddp. Its unused layer never completes its
// chunk: the end-of-backward path reduces it, and the unused weights take no step and keep no
// state, as in one process.
struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(7, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 5));
    unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(at::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, unused{nullptr};
};

std::vector<double> train_mlp(std::shared_ptr<booster::Plugin> plugin,
                              std::shared_ptr<MLPImpl>& model, booster::Boosted& b,
                              std::unique_ptr<booster::Booster>& booster) {
  at::manual_seed(0);
  model = std::make_shared<MLPImpl>();
  booster = std::make_unique<booster::Booster>(std::move(plugin));
  b = booster->boost(model, adamw(*model));
  const int W = dist::world_size(), rank = dist::rank();
  std::vector<double> losses;
  for (int s = 0; s < 5; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(7 + s));
    at::Tensor x = at::randn({4 * W, 7}, gen).narrow(0, 4 * rank, 4);
    at::Tensor loss = at::mse_loss(model->forward(x), at::sin(x.narrow(1, 0, 5)));
    booster->backward(loss, *b.optimizer);
    EXPECT_TRUE(b.optimizer->step());
    b.optimizer->zero_grad();
    at::Tensor l = loss.detach().to(at::kDouble);
    dist::world().all_reduce(l, dist::ReduceOp::Avg);
    losses.push_back(l.item<double>());
  }
  return losses;
}

TEST(GeminiPlugin, PlainTorchModelStaysReplicatedAndUnusedWeightsKeepNoState) {
  std::shared_ptr<MLPImpl> dm, gm_;
  booster::Boosted db, gb;
  std::unique_ptr<booster::Booster> dbo, gbo;
  auto ref = train_mlp(std::make_shared<booster::DDPPlugin>(booster::DDPOptions{}), dm, db, dbo);
  auto got = train_mlp(gemini(), gm_, gb, gbo);
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_LT(rel(got[s], ref[s]), 1e-5) << "step " << s;
  auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*gb.optimizer).manager();
  for (size_t i = 0; i < m.num_chunks(); ++i) EXPECT_FALSE(m.chunk(i).sharded()) << "chunk " << i;
  at::manual_seed(0);
  auto fresh = std::make_shared<MLPImpl>();
  EXPECT_TRUE(gm_->unused->weight.equal(fresh->unused->weight));
  EXPECT_TRUE(gm_->fc1->weight.allclose(dm->fc1->weight, 1e-5, 1e-6));
  auto sd = gb.optimizer->full_state_dict();
  for (auto& [name, t] : sd.tensors) EXPECT_EQ(name.find("unused"), std::string::npos) << name;
  EXPECT_FALSE(sd.scalars.at("steps").find("unused.weight"));
  EXPECT_EQ(sd.scalars.at("steps").at("fc1.weight").as_int(), 5);
}

// Frozen parameters (LoRA's base weights; ColossalAI's Gemini refuses them) get chunks of their
// own, with no gradient or optimizer data; the rest trains as ddp with the same freeze.
TEST(GeminiPlugin, FrozenParametersAreChunkedWithoutState) {
  auto freeze = [](TrainRun& r, std::shared_ptr<booster::Plugin> plugin) {
    r.model = tiny_model();
    for (auto& item : r.model->named_parameters(true))
      if (item.key().find("mlp") != std::string::npos) item.value().set_requires_grad(false);
    auto opt = std::make_shared<optim::AdamW>();
    std::vector<optim::NamedParam> ps;
    for (auto& item : r.model->named_parameters(true))
      if (item.value().requires_grad()) ps.push_back({item.key(), item.value()});
    optim::GroupOptions g;
    g.lr = 3e-3;
    opt->add_param_group(ps, g);
    r.booster = std::make_unique<booster::Booster>(std::move(plugin));
    r.b = r.booster->boost(r.model, opt);
  };
  TrainRun ddp, g;
  freeze(ddp, std::make_shared<booster::DDPPlugin>(booster::DDPOptions{}));
  freeze(g, gemini());
  train(ddp, 4);
  train(g, 4, /*check_shards=*/true);
  for (size_t s = 0; s < ddp.losses.size(); ++s)
    EXPECT_LT(rel(g.losses[s], ddp.losses[s]), 1e-5) << "step " << s;
  auto& m = dynamic_cast<booster::GeminiOptimizerWrapper&>(*g.b.optimizer).manager();
  int frozen_chunks = 0;
  for (size_t i = 0; i < m.num_chunks(); ++i) {
    const auto& ts = m.chunk(i).tensors();
    const bool frozen = !ts.front().requires_grad;
    for (auto& t : ts) EXPECT_EQ(t.requires_grad, !frozen) << t.name;  // never mixed
    frozen_chunks += frozen ? 1 : 0;
  }
  EXPECT_GT(frozen_chunks, 0);
  g.b.model->wait_weights();
  auto fresh = tiny_model();
  auto fp = fresh->named_parameters(true);
  for (auto& item : g.model->named_parameters(true))
    if (!item.value().requires_grad()) {
      EXPECT_TRUE(item.value().equal(fp[item.key()])) << item.key();
    }
}

}  // namespace
