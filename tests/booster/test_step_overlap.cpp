// overlap_step (booster/step_overlap.h) under the ddp plugin: training with the update left
// pending (Deferred: run in each layer's forward pre hook; Stream: a CUDA side stream, each
// layer's forward waiting for its event) equals training without it bit for bit, losses,
// weights and optimizer states, with the learning rate changed after every step and the
// gradient norm clipping (both must be taken at step() time, not when the update runs). Also:
// saves and state exports between step() and the next forward see the updated values; a
// parameter outside any colossal layer is updated at step(); and a layer that reads another
// layer's weight without that layer's hook is caught by the comparison (the test can fail).
// On the CPU at the world size `colossal run` gives (2 in make test: gradients all-reduced);
// the CUDA cases run on the GPU machine (scripts/device_bench.sh ktests) and skip without one.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/booster/plugins/factory.h"
#include "colossal/booster/step_overlap.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/kernels/fused.h"
#include "colossal/models/llama/config.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/optim/adamw.h"

#include "common/adamw_groups.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;

enum class Overlap { Off, Deferred, Stream, Option };

bool have_gpu() {
  return Accelerator::cuda().available();
}

models::ModelConfig small_config(bool tied) {
  models::ModelConfig cfg = models::ModelConfig::preset("tiny");
  cfg.num_hidden_layers = 2;
  cfg.layer_sliding.assign(2, false);
  cfg.vocab_size = 512;
  cfg.tie_word_embeddings = tied;
  return cfg;
}

std::shared_ptr<models::CausalLM> small_model(const models::ModelConfig& cfg, at::Device dev) {
  auto model = std::make_shared<models::CausalLM>(cfg, at::TensorOptions().device(at::kMeta));
  nn::InitOptions io;
  io.seed = 3;
  io.std = cfg.initializer_range;
  io.device = dev;
  nn::init_parameters(*model, io);
  return model;
}

std::shared_ptr<optim::AdamW> adamw(torch::nn::Module& m) {
  return tests::adamw_decay_groups(m, 3e-3, 0.1);
}

struct Result {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> weights, states;
};

// `steps` ddp steps of the small model on the same tokens (per rank), so the loss falls. After
// each step the learning rate halves (what a scheduler does between steps), and every other
// step the optimizer states are read through the Booster before the next forward.
Result train(Overlap mode, bool cuda, const std::string& precision, bool tied, int steps = 4) {
  const at::Device dev = cuda ? Accelerator::cuda().device() : at::Device(at::kCPU);
  const models::ModelConfig cfg = small_config(tied);
  auto model = small_model(cfg, dev);
  booster::DDPOptions o;
  o.precision = precision;
  o.device = cuda ? "cuda" : "cpu";
  o.overlap_step = mode == Overlap::Option;
  booster::Booster booster(std::make_shared<booster::DDPPlugin>(o));
  auto b = booster.boost(model, adamw(*model));
  if (mode == Overlap::Deferred || mode == Overlap::Stream)
    b.optimizer->enable_step_overlap(*model, mode == Overlap::Deferred);
  Result r;
  for (int s = 0; s < steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(dist::rank() + 1));
    at::Tensor ids = at::randint(0, cfg.vocab_size, {2, 24}, gen, at::kLong).to(dev);
    at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, 23), {0, 1}, -100);
    at::Tensor loss = model->forward_loss(ids, targets, 16);
    booster.backward(loss, *b.optimizer);
    b.optimizer->clip_grad_by_norm(0.5);  // small enough to clip: the divisor is not 1
    EXPECT_TRUE(b.optimizer->step());
    b.optimizer->zero_grad(true);
    auto& groups = b.optimizer->optimizer().param_groups();
    b.optimizer->optimizer().set_lr(groups[0].options.lr * 0.5);
    r.losses.push_back(loss.item<double>());
    if (s % 2 == 1) {  // a state export between step() and the next forward
      optim::StateDict sd = b.optimizer->full_state_dict();
      for (auto& [name, t] : sd.tensors)
        r.states[str("step", s, ".", name)] = t.detach().to(at::kFloat).cpu().clone();
    }
  }
  b.model->wait_weights();
  for (auto& item : model->named_parameters(true))
    r.weights[item.key()] = item.value().detach().to(at::kFloat).cpu().clone();
  for (auto& [name, t] : b.optimizer->full_state_dict().tensors)
    r.states[name] = t.detach().to(at::kFloat).cpu().clone();
  return r;
}

void expect_bitwise(const Result& a, const Result& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << ": loss of step " << i;
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (auto& [name, t] : a.weights)
    EXPECT_TRUE(at::equal(t, b.weights.at(name))) << what << ": weight " << name;
  ASSERT_EQ(a.states.size(), b.states.size()) << what;
  for (auto& [name, t] : a.states)
    EXPECT_TRUE(at::equal(t, b.states.at(name))) << what << ": state " << name;
}

TEST(StepOverlap, DeferredEqualsTheSynchronousStepOnTheCpu) {
  for (bool tied : {false, true})
    for (const char* precision : {"fp32", "bf16"}) {
      const std::string what = str(precision, tied ? ", tied embeddings" : "");
      Result off = train(Overlap::Off, false, precision, tied);
      Result deferred = train(Overlap::Option, false, precision, tied);  // CPU: deferred
      expect_bitwise(off, deferred, what);
      // Not a vacuous comparison: the weights moved and the loss fell.
      EXPECT_LT(off.losses.back(), off.losses.front()) << what;
    }
}

TEST(StepOverlap, BucketsFollowTheLayersAndThePendingUpdateRunsInTheHooks) {
  const models::ModelConfig cfg = small_config(false);
  auto model = small_model(cfg, at::Device(at::kCPU));
  booster::DDPOptions o;
  o.overlap_step = true;
  booster::Booster booster(std::make_shared<booster::DDPPlugin>(o));
  auto b = booster.boost(model, adamw(*model));
  const auto& ov = b.optimizer->step_overlap();
  ASSERT_TRUE(ov);
  EXPECT_EQ(ov->mode(), booster::StepOverlap::Mode::Deferred);
  // One bucket per layer with parameters: embedding, per block 2 norms + q, k, v, o + gate, up,
  // down, the final norm, the head. Every parameter is inside one.
  const size_t per_block = 2 + 4 + 3;
  EXPECT_EQ(ov->num_buckets(), 1 + per_block * cfg.num_hidden_layers + 1 + 1);
  EXPECT_EQ(ov->num_unhooked(), 0u);
  at::Tensor ids = at::randint(0, cfg.vocab_size, {1, 8}, at::kLong);
  at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, 7), {0, 1}, -100);
  booster.backward(model->forward_loss(ids, targets, 16), *b.optimizer);
  at::Tensor head_before = model->lm_head->param("weight").detach().clone();
  b.optimizer->step();
  b.optimizer->zero_grad(true);
  EXPECT_TRUE(ov->pending());
  // The head's update waits for the head's forward (or a wait_weights).
  EXPECT_TRUE(at::equal(model->lm_head->param("weight"), head_before));
  model->forward(ids);
  EXPECT_FALSE(ov->pending());
  EXPECT_FALSE(at::equal(model->lm_head->param("weight"), head_before));
}

// A parameter of a plain torch::nn::Module with no colossal layer above it has no hook to wait
// in: it is updated at step().
struct PlainScale : torch::nn::Module {
  PlainScale() { scale = register_parameter("scale", at::ones({4})); }
  at::Tensor scale;
};
struct Mixed : torch::nn::Module {
  Mixed() {
    fc = register_module("fc", std::make_shared<nn::Linear>(nn::LinearOptions(4, 4)));
    plain = register_module("plain", std::make_shared<PlainScale>());
  }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x) * plain->scale; }
  std::shared_ptr<nn::Linear> fc;
  std::shared_ptr<PlainScale> plain;
};

// A layer whose forward reads another layer's weight without running that layer: nothing waits
// for that weight's update before it is read.
struct Peeker : nn::Module {
  explicit Peeker(std::shared_ptr<nn::Linear> other) : other_(std::move(other)) {}
  at::Tensor forward(const at::Tensor& x) {
    ForwardScope scope(*this);
    return at::matmul(x, other_->param("weight").t());
  }
  std::shared_ptr<nn::Linear> other_;
};
struct PeekNet : nn::Module {
  PeekNet() {
    fc = register_module("fc", std::make_shared<nn::Linear>(nn::LinearOptions(4, 4)));
    peek = register_module("peek", std::make_shared<Peeker>(fc));
  }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(peek->forward(x)); }
  std::shared_ptr<nn::Linear> fc;
  std::shared_ptr<Peeker> peek;
};

template <class Net>
std::vector<at::Tensor> train_small(bool overlap) {
  auto net = std::make_shared<Net>();
  nn::InitOptions io;
  io.seed = 5;
  if constexpr (std::is_same_v<Net, Mixed>)
    nn::init_parameters(*net->fc, io);  // `plain` starts at ones
  else
    nn::init_parameters(*net, io);
  booster::DDPOptions o;
  o.overlap_step = overlap;
  booster::Booster booster(std::make_shared<booster::DDPPlugin>(o));
  auto b = booster.boost(net, adamw(*net));
  std::vector<at::Tensor> outs;
  for (int s = 0; s < 3; ++s) {
    at::Tensor x = at::full({2, 4}, 0.5 + s);
    at::Tensor y = net->forward(x);
    outs.push_back(y.detach().clone());
    booster.backward(y.square().mean(), *b.optimizer);
    b.optimizer->step();
    b.optimizer->zero_grad(true);
  }
  if (overlap) {
    const size_t unhooked = std::is_same_v<Net, Mixed> ? 1 : 0;
    EXPECT_EQ(b.optimizer->step_overlap()->num_unhooked(), unhooked);
  }
  return outs;
}

TEST(StepOverlap, UnhookedParametersAreUpdatedAtStep) {
  auto off = train_small<Mixed>(false), on = train_small<Mixed>(true);
  for (size_t i = 0; i < off.size(); ++i) EXPECT_TRUE(at::equal(off[i], on[i])) << "step " << i;
}

TEST(StepOverlap, AReaderThatBypassesTheOwnersHookIsCaught) {
  auto off = train_small<PeekNet>(false), on = train_small<PeekNet>(true);
  EXPECT_TRUE(at::equal(off[0], on[0]));   // before any update
  EXPECT_FALSE(at::equal(off[1], on[1]));  // the peek read fc's weight before fc's hook ran
}

TEST(StepOverlap, RejectedWhereItDoesNotApply) {
  booster::PluginOptions p;
  p.ddp.overlap_step = true;
  for (const char* name : {"none", "zero2", "gemini", "3d"}) {
    p.name = name;
    EXPECT_THROW(p.validate(), InputError) << name;
  }
  p.name = "ddp";
  EXPECT_NO_THROW(p.validate());
  // The side stream needs CUDA parameters.
  auto net = std::make_shared<Mixed>();
  auto opt = adamw(*net);
  EXPECT_THROW(booster::StepOverlap::create(*net, *opt, booster::StepOverlap::Mode::Stream),
               InputError);
}

// The GPU: the real side stream (the update of later layers running beside the forward of
// earlier ones) and the deferred mode, which checks every fused path fires the hooks of the
// layers whose weights it reads (a fused path that bypassed one would read a stale weight).
TEST(StepOverlapCuda, StreamAndDeferredEqualTheSynchronousStep) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (bool fused : {true, false}) {
    kernels::set_enabled(fused);
    for (bool tied : {false, true})
      for (const char* precision : {"bf16", "fp32"}) {
        const std::string what = str(precision, tied ? ", tied" : "", fused ? ", fused" : "");
        Result off = train(Overlap::Off, true, precision, tied);
        expect_bitwise(off, train(Overlap::Stream, true, precision, tied), what + ", stream");
        expect_bitwise(off, train(Overlap::Deferred, true, precision, tied), what + ", deferred");
        expect_bitwise(off, train(Overlap::Option, true, precision, tied), what + ", option");
      }
  }
  kernels::set_enabled(true);
}

}  // namespace
