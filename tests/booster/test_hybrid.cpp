// The hybrid plugin through the Booster against the single-process run (RANKS 2 and RANKS 4 over
// Gloo; each case runs where the world size fits it): tp 2, tp 4, tp2 x dp2 with ZeRO 0, 1 and
// 2, tp 2 with split_gather sequence parallelism (also x dp2). Every rank also runs the whole
// model in one process on the whole global batch (the reference). Checked: the initial shards
// are slices of the whole model (layout-invariant init), every step's loss and gradient norm over
// 10 steps, every parameter's gradient after step 1 (each rank's shard against its slice of the
// whole gradient, which covers the gathered tensor), the final weights, and the per-rank
// parameter / gradient / optimizer bytes against the split they should have. Plus the options'
// named errors and make_plugin's refusal of non-dp layouts for data-parallel plugins.
//
// Tolerances (fp32): the sharded GEMMs sum the hidden dimension in tp partial products plus an
// all-reduce, the data-parallel ranks average per-rank means; both differ from the one-process
// sums by rounding (2^-24 relative per operation), so losses agree to 1e-5 relative. Gradients
// pass through every layer backwards: 1e-5 relative of the tensor's largest entry.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/factory.h"
#include "colossal/booster/plugins/hybrid_plugin.h"
#include "colossal/booster/tensor_parallel_checkpoint_io.h"
#include "colossal/core/error.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/lora.h"
#include "colossal/nn/module.h"
#include "colossal/nn/plan.h"
#include "colossal/optim/adamw.h"
#include "colossal/zero/low_level_optim.h"
#include "dist/dist_test_env.h"

using namespace colossal;
using namespace colossal::booster;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kSeq = 8, kRowsPerDp = 2;

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

models::ModelConfig tiny_config(int64_t kv_heads) {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.layer_sliding.assign(2, false);
  c.qkv_bias = true;  // column biases split, the row bias replicated (added after the reduce)
  c.o_bias = true;
  c.tie_word_embeddings = false;
  return c;
}

std::shared_ptr<models::CausalLM> build(const models::ModelConfig& c) {
  auto m = std::make_shared<models::CausalLM>(c);
  nn::InitOptions io;
  io.seed = 11;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

std::shared_ptr<optim::AdamW> adamw_of(models::CausalLM& m) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> params;
  for (auto& item : m.named_parameters(true)) params.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = 1e-3;
  g.weight_decay = 0.1;
  opt->add_param_group(params, g);
  return opt;
}

// The global batch of step `step` (the same on every rank): ids and next-token targets.
std::pair<at::Tensor, at::Tensor> global_batch(int step, int64_t rows, int64_t vocab) {
  at::manual_seed(1000 + step);
  at::Tensor ids = at::randint(0, vocab, {rows, kSeq + 1}, at::kLong);
  return {ids.narrow(1, 0, kSeq).contiguous(), ids.narrow(1, 1, kSeq).contiguous()};
}

// Whether the Llama plan splits this parameter over tp (written from the plan's rules, not
// from the plugin's bookkeeping).
bool split_by_plan(const std::string& name) {
  for (const char* p :
       {"q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.", "embed_tokens.", "lm_head."})
    if (name.find(p) != std::string::npos) return true;
  for (const char* p : {"o_proj.weight", "down_proj.weight"})
    if (name.find(p) != std::string::npos) return true;
  return false;
}

// This rank's element count of a parameter of `full` elements under the plan at tp (key/value
// projections split over min(tp, kv heads): fewer heads than tp are replicated).
int64_t local_numel(const std::string& name, int64_t full, int64_t tp, int64_t kv_heads) {
  if (tp == 1 || !split_by_plan(name)) return full;
  const bool kv =
      name.find("k_proj.") != std::string::npos || name.find("v_proj.") != std::string::npos;
  return full / (kv ? std::min(tp, kv_heads) : tp);
}

nn::Module& layer_of(torch::nn::Module& root, const std::string& name) {
  auto* layer =
      dynamic_cast<nn::Module*>(nn::find_module(root, name.substr(0, name.rfind('.'))).get());
  COLOSSAL_CHECK(layer, "no layer for ", name);
  return *layer;
}

at::Tensor slice_of(torch::nn::Module& root, const std::string& name, const at::Tensor& full) {
  return layer_of(root, name).shard_slice(name.substr(name.rfind('.') + 1), full);
}

// Every gradient of `model` against its slice of `ref`'s: .grad (ZeRO 0 and 1: averaged over dp),
// or ZeRO-2's shards gathered over dp.
void check_grads(HybridParallelPlugin& plugin, models::CausalLM& model, models::CausalLM& ref,
                 OptimizerWrapper& opt, int64_t zero) {
  auto ref_params = ref.named_parameters(true);
  auto* zw = dynamic_cast<ZeroOptimizerWrapper*>(&opt);
  int64_t compared = 0;
  for (auto& item : model.named_parameters(true)) {
    const std::string& n = item.key();
    at::Tensor expect = slice_of(model, n, ref_params[n].grad());
    at::Tensor got;
    if (zero == 2) {
      ASSERT_NE(zw, nullptr);
      auto& z = zw->zero();
      const int64_t i = z.index_of(item.value());
      ASSERT_GE(i, 0) << n;
      at::Tensor shard = z.grad_shard(static_cast<size_t>(i));
      ASSERT_TRUE(shard.defined()) << n;
      shard = shard.to(at::kFloat).contiguous();
      dist::Communicator& g =
          plugin.dims().degrees().sp > 1 ? plugin.dims().dp_sp() : plugin.dims().dp();
      at::Tensor all = at::empty({shard.numel() * g.size()}, shard.options());
      g.all_gather(all, shard);
      got = all.narrow(0, 0, item.value().numel()).view(item.value().sizes());
    } else {
      got = item.value().grad();
    }
    ASSERT_TRUE(got.defined()) << n;
    EXPECT_LT(max_rel(got, expect), 1e-5) << n << " zero " << zero;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(ref_params.size()));
}

struct Case {
  int64_t tp = 2, zero = 0, kv_heads = 2;
  std::string mode;  // sequence_parallelism_mode
  double max_norm = 1.0;
  int64_t sp = 1;  // the sequence axis (all_to_all, ring_attn)
  int64_t inner_ring_size = 0;
};

void run_case(const Case& k) {
  const int world = dist::world_size();
  HybridOptions o;
  o.tp_size = k.tp;
  o.zero_stage = k.zero;
  o.sequence_parallelism_mode = k.mode;
  o.sp_size = k.sp;
  o.inner_ring_size = k.inner_ring_size;
  o.precision = "fp32";
  o.max_norm = k.max_norm;
  o.zero_bucket_size_in_m = 0.001;  // several buckets
  o.ddp_bucket_cap_mb = 0.004;
  // The vocabulary (96) splits without padding, so local_numel is a plain division; the head
  // gathers its logits (parallel_output=false) for the steps that take the loss from them.
  o.make_vocab_size_divisible_by = 8;
  o.parallel_output = false;
  auto plugin = std::make_shared<HybridParallelPlugin>(o);
  const int dp = plugin->dp_size(), dp_rank = plugin->dp_rank();
  ASSERT_EQ(dp * k.tp * k.sp, world);
  const int64_t zdp = dp * k.sp;  // ZeRO and the gradient average run over dp x sp
  const models::ModelConfig cfg = tiny_config(k.kv_heads);

  // The reference: the whole model, one process, the whole global batch.
  auto ref = build(cfg);
  auto ref_opt =
      std::make_shared<OptimizerWrapper>(adamw_of(*ref), Precision::FP32, LossScaleOptions{});

  auto model = build(cfg);
  Booster booster(plugin);
  Boosted b = booster.boost(model, adamw_of(*model));
  OptimizerWrapper& opt = *b.optimizer;

  // Layout-invariant init: every shard is its slice of the whole model's value.
  auto ref_params = ref->named_parameters(true);
  for (auto& item : model->named_parameters(true)) {
    const std::string& n = item.key();
    at::Tensor expect = slice_of(*model, n, ref_params[n]);
    EXPECT_TRUE(at::equal(item.value(), expect)) << n;
    EXPECT_EQ(item.value().numel(), local_numel(n, ref_params[n].numel(), k.tp, k.kv_heads)) << n;
  }

  for (int step = 0; step < kSteps; ++step) {
    auto [ids, targets] = global_batch(step, kRowsPerDp * dp, cfg.vocab_size);
    // Reference.
    at::Tensor ref_loss = ref->forward_loss(ids, targets);
    ref_loss.backward();
    // Hybrid: this dp rank's rows, then the plugin's part of them.
    at::Tensor my_ids = ids.narrow(0, dp_rank * kRowsPerDp, kRowsPerDp);
    at::Tensor my_targets = targets.narrow(0, dp_rank * kRowsPerDp, kRowsPerDp);
    LocalBatch lb = plugin->local_batch(my_ids, my_targets);
    models::ForwardOptions fo;
    fo.positions = lb.positions;
    at::Tensor loss;
    if (step % 2 == 0) {
      loss = model->forward_loss(lb.inputs, lb.targets, 4096, fo);
    } else {
      // The vocab-parallel head gathers a split_gather sequence: its logits are of whole rows.
      at::Tensor logits = model->forward(lb.inputs, fo);
      at::Tensor t = logits.size(1) == lb.targets.size(1) ? lb.targets : my_targets;
      loss = at::cross_entropy_loss(logits.reshape({-1, cfg.vocab_size}), t.reshape({-1}));
    }
    booster.backward(loss * lb.loss_weight, opt);
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble).clone();
    dist::world().all_reduce(mean, dist::ReduceOp::Avg);
    EXPECT_LE(std::abs(mean.item<double>() - ref_loss.item<double>()),
              1e-5 * std::abs(ref_loss.item<double>()))
        << "step " << step;

    if (step == 0) {
      check_grads(*plugin, *model, *ref, opt, k.zero);
      // Bytes after backward: fp32 parameters of the split, full local .grad (ZeRO 0 and 1) or
      // dp shards of them (ZeRO 2).
      HybridMemoryReport r = plugin->memory_report(*b.model, &opt);
      int64_t param_bytes = 0, shard_bytes = 0;
      for (auto& item : ref->named_parameters(true)) {
        const int64_t n = local_numel(item.key(), item.value().numel(), k.tp, k.kv_heads);
        param_bytes += 4 * n;
        shard_bytes += 4 * ((n + zdp - 1) / zdp);
      }
      EXPECT_EQ(r.parameter_bytes, param_bytes);
      const int64_t grad_bytes = k.zero == 0   ? param_bytes
                                 : k.zero == 1 ? param_bytes + (zdp > 1 ? shard_bytes : 0)
                                               : shard_bytes;
      EXPECT_EQ(r.gradient_bytes, grad_bytes);
      // Before the first step: no AdamW state; ZeRO holds its fp32 master shards from boost.
      EXPECT_EQ(r.optimizer_bytes, k.zero == 0 ? 0 : shard_bytes);
    }

    const double ref_norm = ref_opt->clip_grad_by_norm(k.max_norm);
    const double norm = opt.clip_grad_by_norm(k.max_norm);
    EXPECT_LE(std::abs(norm - ref_norm), 1e-5 * ref_norm) << "step " << step;
    ASSERT_TRUE(ref_opt->step());
    ASSERT_TRUE(opt.step());
    ref_opt->zero_grad(true);
    opt.zero_grad(true);

    if (step == 0) {
      // Optimizer state: two fp32 moments of the local parameters (ZeRO 0), or of their dp
      // shards plus the fp32 master shard (ZeRO 1, 2).
      HybridMemoryReport r = plugin->memory_report(*b.model, &opt);
      int64_t expect = 0;
      for (auto& item : ref->named_parameters(true)) {
        const int64_t n = local_numel(item.key(), item.value().numel(), k.tp, k.kv_heads);
        expect += k.zero == 0 ? 8 * n : 12 * ((n + zdp - 1) / zdp);
      }
      EXPECT_EQ(r.optimizer_bytes, expect);
    }
  }
  // Final weights: every shard against its slice of the reference, norm-wise, to 5e-5: AdamW's
  // early steps move an entry by about lr * sign(gradient), so entries whose gradient is near
  // zero carry the runs' rounding differences at full size; on a 16-entry bias that reaches
  // ~1e-5 of its norm after 10 steps (losses, norms and step-1 gradients are held to 1e-5
  // above). The key biases are left out: softmax is invariant to adding q.b_k to every score of
  // a query, so their true gradient is zero and backward gives rounding noise only.
  for (auto& item : model->named_parameters(true)) {
    const std::string& n = item.key();
    if (n.find("k_proj.bias") != std::string::npos) continue;
    at::Tensor expect = slice_of(*model, n, ref_params[n]);
    const double d = ((item.value() - expect).norm() / expect.norm()).item<double>();
    EXPECT_LE(d, 5e-5) << n;
  }
}

#define NEED_WORLD(n) \
  if (dist::world_size() != (n)) GTEST_SKIP() << "needs " << (n) << " ranks"

}  // namespace

TEST(Hybrid, Tp2Zero0) {
  NEED_WORLD(2);
  run_case({2, 0, 2, "", 1.0});
}
TEST(Hybrid, Tp2Zero1) {
  NEED_WORLD(2);
  run_case({2, 1, 2, "", 1.0});
}
TEST(Hybrid, Tp2Zero2) {
  NEED_WORLD(2);
  run_case({2, 2, 2, "", 1.0});
}
TEST(Hybrid, Tp2SplitGather) {
  NEED_WORLD(2);
  run_case({2, 0, 2, "split_gather", 1.0});
}
TEST(Hybrid, Tp2Ring) {
  NEED_WORLD(2);
  run_case({2, 1, 2, "ring", 1.0});
}
// One key/value head over tp 2: replicated on both ranks (counted once in the norm).
TEST(Hybrid, Tp2OneKvHeadSplitGather) {
  NEED_WORLD(2);
  run_case({2, 0, 1, "split_gather", 1.0});
}
TEST(Hybrid, Tp4TwoKvHeadsZero1) {
  NEED_WORLD(4);
  run_case({4, 1, 2, "", 1.0});
}
TEST(Hybrid, Tp2Dp2RingZero1) {
  NEED_WORLD(4);
  run_case({2, 1, 2, "ring", 1.0});
}
TEST(Hybrid, Tp4) {
  NEED_WORLD(4);
  run_case({4, 0, 4, "", 1.0});
}
TEST(Hybrid, Tp2Dp2Zero0) {
  NEED_WORLD(4);
  run_case({2, 0, 2, "", 1.0});
}
TEST(Hybrid, Tp2Dp2Zero1) {
  NEED_WORLD(4);
  run_case({2, 1, 2, "", 1.0});
}
TEST(Hybrid, Tp2Dp2Zero2) {
  NEED_WORLD(4);
  run_case({2, 2, 2, "", 1.0});
}
TEST(Hybrid, Tp2Dp2SplitGatherZero2) {
  NEED_WORLD(4);
  run_case({2, 2, 2, "split_gather", 1.0});
}

// The sequence axis: all_to_all (Ulysses) and ring_attn (zigzag ring attention, and its double
// ring), alone, with tensor parallelism and with ZeRO over dp x sp.
TEST(Hybrid, Sp2AllToAll) {
  NEED_WORLD(2);
  run_case({1, 0, 2, "all_to_all", 1.0, 2});
}
TEST(Hybrid, Sp2RingAttnZero2) {
  NEED_WORLD(2);
  run_case({1, 2, 2, "ring_attn", 1.0, 2});
}
TEST(Hybrid, Sp4AllToAllZero1) {
  NEED_WORLD(4);
  run_case({1, 1, 4, "all_to_all", 1.0, 4});
}
TEST(Hybrid, Sp4RingAttnDoubleRing) {
  NEED_WORLD(4);
  run_case({1, 0, 2, "ring_attn", 1.0, 4, 2});
}
TEST(Hybrid, Tp2Sp2AllToAllZero1) {
  NEED_WORLD(4);
  run_case({2, 1, 2, "all_to_all", 1.0, 2});
}
TEST(Hybrid, Tp2Sp2RingAttn) {
  NEED_WORLD(4);
  run_case({2, 0, 2, "ring_attn", 1.0, 2});
}
TEST(Hybrid, Dp2Sp2RingAttnZero2) {
  NEED_WORLD(4);
  run_case({1, 2, 2, "ring_attn", 1.0, 2});
}

// LoRA under tensor parallelism (tp 2; ZeRO 0, and split_gather with ZeRO 1): the plan shards
// each adapter with its base (nn/lora.h), only the adapters get gradients and optimizer state
// (the frozen base none: no .grad, no moments, no fp32 master), and the losses, the adapters'
// step-1 gradients (each rank's tensor against its slice of the whole gradient), the gradient
// norms and the trained adapters equal the one-process run's.
void run_lora_case(int64_t zero, const std::string& mode) {
  HybridOptions o;
  o.tp_size = 2;
  o.zero_stage = zero;
  o.sequence_parallelism_mode = mode;
  o.precision = "fp32";
  o.max_norm = 1.0;
  o.make_vocab_size_divisible_by = 8;
  auto plugin = std::make_shared<HybridParallelPlugin>(o);
  const models::ModelConfig cfg = tiny_config(2);
  auto lora_model = [&] {
    auto m = build(cfg);
    nn::LoraConfig lc;
    lc.r = 4;
    lc.lora_alpha = 8;
    lc.target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                         "gate_proj", "up_proj", "down_proj"};
    nn::apply_lora(*m, lc, 5);
    at::manual_seed(6);
    at::NoGradGuard ng;
    for (auto& item : m->named_parameters(true))
      if (nn::is_lora_parameter(item.key())) item.value().copy_(at::randn_like(item.value()) * 0.1);
    return m;
  };
  auto adamw_trainable = [](models::CausalLM& m) {
    auto opt = std::make_shared<optim::AdamW>();
    std::vector<optim::NamedParam> params;
    for (auto& item : m.named_parameters(true))
      if (item.value().requires_grad()) params.push_back({item.key(), item.value()});
    optim::GroupOptions g;
    g.lr = 1e-2;
    g.weight_decay = 0.1;
    opt->add_param_group(params, g);
    return opt;
  };
  auto ref = lora_model();
  auto ref_opt = std::make_shared<OptimizerWrapper>(adamw_trainable(*ref), Precision::FP32,
                                                    LossScaleOptions{});
  auto model = lora_model();
  Booster booster(plugin);
  Boosted b = booster.boost(model, adamw_trainable(*model));
  OptimizerWrapper& opt = *b.optimizer;
  auto ref_params = ref->named_parameters(true);
  // This rank's adapter elements: per layer, column bases (q, k, v, gate, up) hold A whole and
  // half of B, row bases (o, down) half of A and B whole.
  int64_t adapter_numel = 0;
  for (auto& item : model->named_parameters(true))
    if (nn::is_lora_parameter(item.key())) adapter_numel += item.value().numel();
  const int64_t per_layer = (128 + 64) + 2 * (128 + 32) + (64 + 128) + 2 * (128 + 96) + (96 + 128);
  EXPECT_EQ(adapter_numel, cfg.num_hidden_layers * per_layer);
  for (int step = 0; step < 4; ++step) {
    auto [ids, targets] = global_batch(step, kRowsPerDp, cfg.vocab_size);
    at::Tensor ref_loss = ref->forward_loss(ids, targets);
    ref_loss.backward();
    LocalBatch lb = plugin->local_batch(ids, targets);
    at::Tensor loss = model->forward_loss(lb.inputs, lb.targets);
    booster.backward(loss * lb.loss_weight, opt);
    EXPECT_LE(std::abs(loss.item<double>() - ref_loss.item<double>()),
              1e-5 * std::abs(ref_loss.item<double>()))
        << "step " << step;
    if (step == 0) {
      for (auto& item : model->named_parameters(true)) {
        const std::string& n = item.key();
        if (!nn::is_lora_parameter(n)) {
          EXPECT_FALSE(item.value().grad().defined()) << n;
          continue;
        }
        ASSERT_TRUE(item.value().grad().defined()) << n;
        EXPECT_LT(max_rel(item.value().grad(), slice_of(*model, n, ref_params[n].grad())), 1e-5)
            << n;
      }
      EXPECT_EQ(plugin->memory_report(*b.model, &opt).gradient_bytes, 4 * adapter_numel);
    }
    const double ref_norm = ref_opt->clip_grad_by_norm(1.0);
    const double norm = opt.clip_grad_by_norm(1.0);
    EXPECT_LE(std::abs(norm - ref_norm), 1e-5 * ref_norm) << "step " << step;
    ASSERT_TRUE(ref_opt->step());
    ASSERT_TRUE(opt.step());
    ref_opt->zero_grad(true);
    opt.zero_grad(true);
    // Two fp32 moments per adapter element, plus ZeRO's fp32 master (one dp rank: whole).
    if (step == 0) {
      EXPECT_EQ(plugin->memory_report(*b.model, &opt).optimizer_bytes,
                (zero == 0 ? 8 : 12) * adapter_numel);
    }
  }
  for (auto& item : model->named_parameters(true)) {
    const std::string& n = item.key();
    const at::Tensor expect = slice_of(*model, n, ref_params[n]);
    if (!nn::is_lora_parameter(n)) {
      EXPECT_TRUE(at::equal(item.value(), expect)) << n;  // the base never moves
      continue;
    }
    EXPECT_LE(((item.value() - expect).norm() / expect.norm()).item<double>(), 1e-5) << n;
  }
}

TEST(Hybrid, Tp2LoraZero0) {
  NEED_WORLD(2);
  run_lora_case(0, "");
}
TEST(Hybrid, Tp2LoraSplitGatherZero1) {
  NEED_WORLD(2);
  run_lora_case(1, "split_gather");
}

// A user's own model built from our layers, not a CausalLM: ColossalAI's custom_policy is a plan
// by module-path pattern (custom_plan). tp over the whole world, ZeRO 0 and 1, against the same
// model in one process: losses and every gradient (the shard against its slice) to 1e-5.
struct UserMlp : torch::nn::Module {
  UserMlp() {
    up = register_module("up", std::make_shared<nn::Linear>(nn::LinearOptions(6, 16)));
    down = register_module("down", std::make_shared<nn::Linear>(nn::LinearOptions(16, 6)));
    out = register_module("out", std::make_shared<nn::Linear>(nn::LinearOptions(6, 3)));
  }
  at::Tensor forward(const at::Tensor& x) {
    return out->forward(x + down->forward(at::gelu(up->forward(x))));
  }
  std::shared_ptr<nn::Linear> up, down, out;
};

TEST(Hybrid, CustomPlanShardsAUsersModel) {
  const int world = dist::world_size();
  for (int64_t zero : {0, 1}) {
    HybridOptions o;
    o.tp_size = world;
    o.zero_stage = zero;
    o.precision = "fp32";
    o.max_norm = 1.0;
    o.custom_plan = {{"up", {}, nn::ShardSpec::Kind::Column},
                     {"down", {}, nn::ShardSpec::Kind::Row}};
    auto plugin = std::make_shared<HybridParallelPlugin>(o);
    auto make = [] {
      auto m = std::make_shared<UserMlp>();
      nn::InitOptions io;
      io.seed = 5;
      io.std = 0.3;
      nn::init_parameters(*m, io);
      return m;
    };
    auto ref = make(), model = make();
    auto opt_of = [](torch::nn::Module& m) {
      auto a = std::make_shared<optim::AdamW>();
      std::vector<optim::NamedParam> ps;
      for (auto& item : m.named_parameters(true)) ps.push_back({item.key(), item.value()});
      optim::GroupOptions g;
      g.lr = 1e-2;
      a->add_param_group(ps, g);
      return a;
    };
    auto ref_w =
        std::make_shared<OptimizerWrapper>(opt_of(*ref), Precision::FP32, LossScaleOptions{});
    Booster booster(plugin);
    Boosted b = booster.boost(model, opt_of(*model));
    EXPECT_EQ(model->up->out_features(), 16 / world);
    EXPECT_EQ(model->down->in_features(), 16 / world);
    EXPECT_EQ(model->out->out_features(), 3);  // no rule: whole on every rank
    auto ref_params = ref->named_parameters(true);
    for (int step = 0; step < 5; ++step) {
      at::manual_seed(70 + step);
      const at::Tensor x = at::randn({4, 5, 6}), y = at::randn({4, 5, 3});
      at::Tensor ref_loss = at::mse_loss(ref->forward(x), y);
      ref_loss.backward();
      at::Tensor loss = at::mse_loss(model->forward(x), y);
      booster.backward(loss, *b.optimizer);
      EXPECT_LE(std::abs(loss.item<double>() - ref_loss.item<double>()),
                1e-5 * std::abs(ref_loss.item<double>()))
          << "zero " << zero << " step " << step;
      if (step == 0 && zero == 0) {
        for (auto& item : model->named_parameters(true)) {
          EXPECT_LT(max_rel(item.value().grad(),
                            slice_of(*model, item.key(), ref_params[item.key()].grad())),
                    1e-5)
              << item.key();
        }
      }
      const double rn = ref_w->clip_grad_by_norm(1.0), n = b.optimizer->clip_grad_by_norm(1.0);
      EXPECT_LE(std::abs(n - rn), 1e-5 * rn) << "zero " << zero << " step " << step;
      ASSERT_TRUE(ref_w->step());
      ASSERT_TRUE(b.optimizer->step());
      ref_w->zero_grad(true);
      b.optimizer->zero_grad(true);
    }
  }
  // Sequence parallelism needs the built-in plans.
  HybridOptions sp;
  sp.tp_size = world;
  sp.sequence_parallelism_mode = "split_gather";
  sp.precision = "fp32";
  sp.custom_plan = {{"up", {}, nn::ShardSpec::Kind::Column}};
  auto p = std::make_shared<HybridParallelPlugin>(sp);
  Booster booster(p);
  std::string what;
  try {
    booster.boost(std::make_shared<UserMlp>(), nullptr);
  } catch (const InputError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("custom_plan takes no sequence parallelism"), std::string::npos) << what;
}

// no_sync: two micro-batches accumulated then one step equal the reference on both at once.
TEST(Hybrid, NoSyncAccumulationIsExact) {
  const int world = dist::world_size();
  for (int64_t zero : {0, 1, 2}) {
    HybridOptions o;
    o.tp_size = 2;
    o.zero_stage = zero;
    o.sequence_parallelism_mode = world == 2 ? "split_gather" : "";
    o.precision = "fp32";
    auto plugin = std::make_shared<HybridParallelPlugin>(o);
    const int dp = plugin->dp_size(), dp_rank = plugin->dp_rank();
    const models::ModelConfig cfg = tiny_config(2);
    auto ref = build(cfg);
    auto ref_opt =
        std::make_shared<OptimizerWrapper>(adamw_of(*ref), Precision::FP32, LossScaleOptions{});
    auto model = build(cfg);
    Booster booster(plugin);
    Boosted b = booster.boost(model, adamw_of(*model));
    auto [ids, targets] = global_batch(0, 2 * kRowsPerDp * dp, cfg.vocab_size);
    ref->forward_loss(ids, targets).backward();
    for (int micro = 0; micro < 2; ++micro) {
      // Micro-batch `micro` of this dp rank: rows [(2 dp_rank + micro) R, ...).
      const int64_t first = (2 * dp_rank + micro) * kRowsPerDp;
      LocalBatch lb = plugin->local_batch(ids.narrow(0, first, kRowsPerDp),
                                          targets.narrow(0, first, kRowsPerDp));
      std::unique_ptr<NoSyncGuard> guard;
      if (micro == 0) guard = booster.no_sync(*b.model, b.optimizer.get());
      booster.backward(model->forward_loss(lb.inputs, lb.targets) * (lb.loss_weight / 2.0),
                       *b.optimizer);
    }
    // The accumulated gradients (gathered where sharded) and the global norm.
    check_grads(*plugin, *model, *ref, *b.optimizer, zero);
    const double ref_norm = ref_opt->clip_grad_by_norm(1e9);
    const double norm = b.optimizer->clip_grad_by_norm(1e9);
    EXPECT_LE(std::abs(norm - ref_norm), 1e-5 * ref_norm) << "zero " << zero;
  }
}

// A non-finite gradient on one rank only (a tp shard of the last rank) skips the step on every
// rank of every axis, for ZeRO 0 (the norm's reducer spans dp, tp and pp) and ZeRO 1 (the shard
// norm's reducer likewise); the weights stay unchanged everywhere.
TEST(Hybrid, NonFiniteGradientSkipsTheStepEverywhere) {
  for (int64_t zero : {0, 1}) {
    HybridOptions o;
    o.tp_size = 2;
    o.zero_stage = zero;
    o.precision = "fp32";
    auto plugin = std::make_shared<HybridParallelPlugin>(o);
    auto model = build(tiny_config(2));
    Booster booster(plugin);
    Boosted b = booster.boost(model, adamw_of(*model));
    auto [ids, targets] = global_batch(0, kRowsPerDp, 96);
    booster.backward(model->forward_loss(ids, targets), *b.optimizer);
    at::Tensor w = model->model->layers->layers[0]->dense_mlp().up_proj->weight();
    const at::Tensor before = w.detach().clone();
    // After the dp all-reduce, on the last rank only, in the last element (the part of the
    // gradient that rank's ZeRO shard holds: the last dp rank owns the tail).
    if (dist::rank() == dist::world_size() - 1) w.grad().view({-1})[-1].fill_(INFINITY);
    EXPECT_FALSE(b.optimizer->step()) << "zero " << zero;
    EXPECT_TRUE(b.optimizer->last_step_skipped());
    EXPECT_TRUE(at::equal(w, before));
    b.optimizer->zero_grad(true);
  }
}

TEST(Hybrid, NamedErrors) {
  const int world = dist::world_size();
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const InputError& e) {
      return e.what();
    }
    return "(no InputError)";
  };
  HybridOptions pp;
  pp.pp_size = 2;
  EXPECT_NE(message([&] {
              pp.degrees(world);
            }).find("needs exactly one of num_microbatches and microbatch_size"),
            std::string::npos);
  HybridOptions tp3;
  tp3.tp_size = 3;
  EXPECT_NE(message([&] { tp3.degrees(world); }).find("not divisible by tp_size * pp_size"),
            std::string::npos);
  HybridOptions enable;
  enable.enable_sequence_parallelism = true;
  EXPECT_NE(message([&] { enable.validate(); }).find("needs sequence_parallelism_mode"),
            std::string::npos);
  HybridOptions sg;  // split_gather without tensor parallelism
  sg.sequence_parallelism_mode = "split_gather";
  EXPECT_NE(message([&] { sg.degrees(world); }).find("split_gather"), std::string::npos);
  HybridOptions a2a;
  a2a.sequence_parallelism_mode = "all_to_all";
  a2a.sp_size = 2;
  a2a.precision = "fp32";
  a2a.sp_size = 3;  // 3 does not divide the world (2 or 4)
  EXPECT_NE(message([&] { HybridParallelPlugin p(a2a); }).find("sp_size"), std::string::npos);
  // Heads not divisible: 6 attention heads over tp 4 are refused at boost.
  if (world == 4) {
    HybridOptions o;
    o.tp_size = 4;
    o.precision = "fp32";
    auto plugin = std::make_shared<HybridParallelPlugin>(o);
    models::ModelConfig c = tiny_config(2);
    c.num_attention_heads = 6;
    auto m = build(c);
    Booster booster(plugin);
    EXPECT_NE(message([&] { booster.boost(m, adamw_of(*m)); }).find("heads"), std::string::npos);
  }
  // A sequence that split_gather cannot split evenly over tp is refused (not padded).
  HybridOptions odd;
  odd.tp_size = 2;
  odd.sequence_parallelism_mode = "split_gather";
  odd.precision = "fp32";
  HybridParallelPlugin sp(odd);
  const at::Tensor seq7 = at::zeros({1, 7}, at::kLong);
  EXPECT_NE(
      message([&] { sp.local_batch(seq7, seq7); }).find("sequence length divisible by tp_size"),
      std::string::npos);
  // tp > 1 saves and loads through the tensor-parallel checkpoint IO.
  HybridOptions o;
  o.tp_size = 2;
  o.precision = "fp32";
  auto plugin = std::make_shared<HybridParallelPlugin>(o);
  EXPECT_TRUE(std::dynamic_pointer_cast<TensorParallelCheckpointIO>(plugin->checkpoint_io()));
}

// The data-parallel plugins refuse a layout with other degrees, naming them.
TEST(Hybrid, DataParallelPluginsRefuseModelParallelDims) {
  dist::ParallelDegrees d;
  d.tp = 2;
  d.dp = dist::world_size() / 2;
  dist::ParallelDims dims(d);
  for (const char* name : {"ddp", "low_level_zero", "zero2", "gemini"}) {
    PluginOptions po;
    po.name = name;
    try {
      make_plugin(po, "cpu", dims);
      ADD_FAILURE() << name << " accepted " << d.describe();
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("needs the hybrid plugin"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("tp=2"), std::string::npos) << e.what();
    }
  }
  // ... and the hybrid layout flags given to another plugin.
  PluginOptions po;
  po.name = "ddp";
  po.hybrid.tp_size = 2;
  try {
    po.validate();
    ADD_FAILURE() << "ddp accepted --tp_size 2";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("apply to --plugin hybrid"), std::string::npos);
  }
  // The hybrid plugin over the same dims.
  PluginOptions h;
  h.name = "3d";
  h.hybrid.tp_size = 2;
  auto p = make_plugin(h, "cpu", dims);
  EXPECT_EQ(p->name(), "hybrid");
  EXPECT_EQ(p->dp_size(), dist::world_size() / 2);
}
