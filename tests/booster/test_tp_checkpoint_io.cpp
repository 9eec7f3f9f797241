// TensorParallelCheckpointIO over Gloo (registered with 2 and 4 ranks): a tiny Llama sharded by
// the tensor-parallel plan against the same weights unsharded (the single-process reference is
// DataParallelCheckpointIO on the whole model). Saves are byte-identical files; loads give each
// rank exactly its slices; optimizer states go through one full-shape file across tp sizes
// (tp = world; with 4 ranks also tp2 x dp2); the streamed save never holds more than one full
// tensor (plus one received shard) at a time on any rank. (Temporary folders go through
// checkpoint::remove_tree: std::filesystem::remove_all crashes with this LibTorch.)
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "colossal/booster/booster.h"
#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/plugins/factory.h"
#include "colossal/booster/tensor_parallel_checkpoint_io.h"
#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/embedding.h"
#include "colossal/nn/init.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/module.h"
#include "colossal/nn/plan.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/optimizer.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;
namespace fs = std::filesystem;

// Large enough that size_per_shard_mb = 1 cuts several files (the embedding and the head are
// 1 MiB each in fp32); kv heads divisible by 4 so tp4 applies.
models::ModelConfig tiny_config() {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = 16;
  c.layer_sliding.assign(2, false);
  c.qkv_bias = true;  // column-split biases
  c.o_bias = true;    // a row-parallel bias: kept whole, written once
  return c;
}

// A tensor-parallel group of `tp` consecutive ranks and the data-parallel group across them.
struct Layout {
  dist::Communicator tp, dp;
};
// Made once per size (a group name is created once per job).
Layout make_layout(int tp) {
  static std::map<int, Layout> made;
  if (made.count(tp)) return made[tp];
  const int w = dist::world_size(), r = dist::rank();
  EXPECT_EQ(w % tp, 0);
  std::vector<int> tp_ranks, dp_ranks;
  for (int i = 0; i < tp; ++i) tp_ranks.push_back((r / tp) * tp + i);
  for (int j = 0; j < w / tp; ++j) dp_ranks.push_back(j * tp + r % tp);
  Layout l;
  l.tp = dist::new_group(tp_ranks, "ckpt_tp" + std::to_string(tp) + "_" + std::to_string(r / tp));
  l.dp = dist::new_group(dp_ranks, "ckpt_dp" + std::to_string(tp) + "_" + std::to_string(r % tp));
  made[tp] = l;
  return l;
}

// The model with name-keyed initial values of `seed`, sharded over `tp` when it has >1 rank.
std::shared_ptr<models::CausalLM> build(const dist::Communicator& tp, uint64_t seed) {
  const models::ModelConfig c = tiny_config();
  auto m = std::make_shared<models::CausalLM>(c, at::TensorOptions().device(at::kMeta));
  if (tp.valid() && tp.size() > 1) {
    models::check_tensor_parallel(c, tp.size());
    nn::PlanOptions po;
    po.tp = tp;
    nn::apply_plan(*m, models::tensor_parallel_plan(c), po);
  }
  nn::InitOptions io;
  io.seed = seed;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

// This rank's slice of a full tensor of parameter `name` (the layer's own shard_slice).
at::Tensor slice_of(torch::nn::Module& model, const std::string& name, const at::Tensor& full) {
  const size_t dot = name.rfind('.');
  auto* layer = dynamic_cast<nn::Module*>(nn::find_module(model, name.substr(0, dot)).get());
  if (!layer) return full;
  return layer->shard_slice(name.substr(dot + 1), full);
}

// One folder name for every rank (rank 0's pid).
fs::path shared_dir(const std::string& name) {
  at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  dist::world().broadcast(pid, 0);
  fs::path d = fs::temp_directory_path() /
               ("colossal_tp_ckpt_" + name + "_" + std::to_string(pid.item<int64_t>()));
  if (dist::rank() == 0) {
    checkpoint::remove_tree(d.string());
    fs::create_directories(d);
  }
  dist::world().barrier();
  return d;
}
void drop_dir(const fs::path& d) {
  dist::world().barrier();
  if (dist::rank() == 0) checkpoint::remove_tree(d.string());
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> listing(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The tp sizes to try: the whole world, and 2 x dp when the world allows it.
std::vector<int> tp_sizes() {
  std::vector<int> out{dist::world_size()};
  if (dist::world_size() == 4) out.push_back(2);
  return out;
}

TEST(TensorParallelCheckpointIO, SaveWritesTheSingleProcessFilesWithOneFullTensorAtATime) {
  std::vector<int> sizes = tp_sizes();
  sizes.push_back(1);  // the IO over groups of one: a data-parallel layout
  for (int tp : sizes) {
    for (bool shard : {true, false}) {
      SCOPED_TRACE("tp " + std::to_string(tp) + (shard ? " sharded files" : " one file"));
      Layout l = make_layout(tp);
      const fs::path d = shared_dir("save");
      auto whole = build({}, 5);
      booster::ModelWrapper whole_w(whole);
      booster::DataParallelCheckpointIO().save_model(whole_w, (d / "ref").string(), shard, 1);
      auto part = build(l.tp, 5);
      booster::ModelWrapper part_w(part);
      booster::TensorParallelCheckpointIO io(l.tp, l.dp);
      io.save_model(part_w, (d / "tp").string(), shard, 1);

      if (dist::rank() == 0) {
        const auto names = listing(d / "ref");
        EXPECT_EQ(listing(d / "tp"), names);
        if (shard) {
          EXPECT_TRUE(std::count(names.begin(), names.end(), "model.safetensors.index.json"))
              << "size_per_shard_mb = 1 did not cut shards";
        }
        for (const auto& n : names)
          EXPECT_TRUE(file_bytes(d / "ref" / n) == file_bytes(d / "tp" / n)) << n << " differs";
        // Tensor by tensor as well (names the first difference if the bytes differ).
        auto ref = checkpoint::load_state_dict((d / "ref").string());
        auto got = checkpoint::load_state_dict((d / "tp").string());
        ASSERT_EQ(got.size(), ref.size());
        for (size_t i = 0; i < ref.size(); ++i) {
          EXPECT_EQ(got[i].first, ref[i].first);
          EXPECT_TRUE(at::equal(got[i].second, ref[i].second)) << ref[i].first;
        }
      }

      // The memory bound, from the IO's own counters: never two full tensors alive, and never
      // more bytes than the largest full tensor plus the largest shard of the model.
      uint64_t largest_full = 0, largest_shard = 0;
      int64_t sharded_count = 0;
      auto whole_params = whole->named_parameters();
      for (const auto& p : part->named_parameters()) {
        const at::Tensor& full = whole_params[p.key()];
        largest_full = std::max<uint64_t>(largest_full, full.numel() * full.element_size());
        if (!p.value().sizes().equals(full.sizes())) {
          ++sharded_count;
          largest_shard =
              std::max<uint64_t>(largest_shard, p.value().numel() * p.value().element_size());
        }
      }
      const auto& st = io.last_save_stats();
      EXPECT_LE(st.peak_full_tensors, 1);
      EXPECT_LE(st.peak_bytes, largest_full + largest_shard);
      if (dist::rank() == 0) {
        EXPECT_EQ(st.gathered, sharded_count);  // the meter saw every gather
        EXPECT_EQ(sharded_count > 0, tp > 1);
        EXPECT_EQ(st.largest_full_bytes, tp > 1 ? largest_full : 0);  // the embedding
      } else {
        EXPECT_EQ(st.gathered, 0);
      }
      // For the Python check (test_tp_checkpoint_interop.py): the tp = world, sharded save.
      const char* keep = std::getenv("COLOSSAL_TP_CKPT_OUT");
      if (keep && dist::rank() == 0 && shard && tp == dist::world_size())
        fs::copy(d / "tp", keep,
                 fs::copy_options::recursive | fs::copy_options::overwrite_existing);
      drop_dir(d);
    }
  }
}

TEST(TensorParallelCheckpointIO, LoadGivesEachRankItsSlices) {
  for (int tp : tp_sizes()) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    Layout l = make_layout(tp);
    const fs::path d = shared_dir("load");
    auto whole = build({}, 5);
    booster::ModelWrapper whole_w(whole);
    booster::DataParallelCheckpointIO().save_model(whole_w, (d / "ref").string(), true, 1);

    auto part = build(l.tp, 7);  // other values, so a tensor the load skips shows
    booster::ModelWrapper part_w(part);
    booster::TensorParallelCheckpointIO io(l.tp, l.dp);
    io.load_model(part_w, (d / "ref").string(), /*strict=*/true, nullptr);
    auto whole_params = whole->named_parameters();
    for (const auto& p : part->named_parameters()) {
      EXPECT_TRUE(at::equal(p.value(), slice_of(*part, p.key(), whole_params[p.key()]))) << p.key();
    }

    // Strict: a missing and an unexpected tensor are named; non-strict loads the rest.
    if (dist::rank() == 0) {
      auto state = checkpoint::module_state(*whole);
      std::erase_if(state, [](const auto& nt) { return nt.first == "model.norm.weight"; });
      state.emplace_back("bogus.weight", at::ones({3}));
      checkpoint::save_state_dict((d / "bad").string(), state);
    }
    dist::world().barrier();
    try {
      io.load_model(part_w, (d / "bad").string(), /*strict=*/true, nullptr);
      ADD_FAILURE() << "a strict load accepted a checkpoint with a missing tensor";
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("missing from the checkpoint: model.norm.weight"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("not in the model: bogus.weight"), std::string::npos) << msg;
    }
    auto other = build(l.tp, 9);
    booster::ModelWrapper other_w(other);
    io.load_model(other_w, (d / "bad").string(), /*strict=*/false, nullptr);
    auto other_params = other->named_parameters();
    EXPECT_TRUE(at::equal(other_params["model.layers.1.mlp.down_proj.weight"],
                          part->named_parameters()["model.layers.1.mlp.down_proj.weight"]));
    drop_dir(d);
  }
}

TEST(TensorParallelCheckpointIO, TensorParallelSavesLoadIntoOtherLayouts) {
  const int w = dist::world_size();
  Layout full = make_layout(w);
  const fs::path d = shared_dir("cross");
  // Saved from tp = world.
  auto saved = build(full.tp, 5);
  booster::ModelWrapper saved_w(saved);
  booster::TensorParallelCheckpointIO(full.tp, full.dp)
      .save_model(saved_w, (d / "tp").string(), true, 1);
  auto ref = build({}, 5);
  auto ref_params = ref->named_parameters();
  // Into the whole model (tp1) through the data-parallel IO.
  auto whole = build({}, 7);
  booster::ModelWrapper whole_w(whole);
  booster::DataParallelCheckpointIO().load_model(whole_w, (d / "tp").string(), true, nullptr);
  for (const auto& p : whole->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), ref_params[p.key()])) << p.key();
  // Into the whole model through the tensor-parallel IO over a group of one.
  Layout one = make_layout(1);
  auto whole2 = build({}, 7);
  booster::ModelWrapper whole2_w(whole2);
  booster::TensorParallelCheckpointIO(one.tp, one.dp)
      .load_model(whole2_w, (d / "tp").string(), true, nullptr);
  for (const auto& p : whole2->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), ref_params[p.key()])) << p.key();
  // Into another tp size.
  for (int tp : tp_sizes()) {
    if (tp == w) continue;
    Layout l = make_layout(tp);
    auto part = build(l.tp, 7);
    booster::ModelWrapper part_w(part);
    booster::TensorParallelCheckpointIO(l.tp, l.dp)
        .load_model(part_w, (d / "tp").string(), true, nullptr);
    for (const auto& p : part->named_parameters())
      EXPECT_TRUE(at::equal(p.value(), slice_of(*part, p.key(), ref_params[p.key()]))) << p.key();
  }
  drop_dir(d);
}

// AdamW wrapped as the none/ddp plugins wrap it (fp32).
std::shared_ptr<optim::AdamW> make_adamw(torch::nn::Module& m) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> ps;
  for (auto& item : m.named_parameters(true)) ps.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = 1e-2;
  g.weight_decay = 0.1;
  opt->add_param_group(ps, g);
  return opt;
}
std::shared_ptr<booster::OptimizerWrapper> make_optimizer(torch::nn::Module& m) {
  return std::make_shared<booster::OptimizerWrapper>(make_adamw(m), booster::Precision::FP32,
                                                     booster::LossScaleOptions{});
}

// Gradients as the unsharded model would have them (by name and step), sliced for a shard.
void set_grads(torch::nn::Module& m, torch::nn::Module& whole, int step) {
  auto whole_params = whole.named_parameters();
  for (auto& p : m.named_parameters()) {
    const at::Tensor& full = whole_params[p.key()];
    auto gen = at::make_generator<at::CPUGeneratorImpl>(nn::param_seed(100 + step, p.key()));
    at::Tensor g = at::empty(full.sizes()).normal_(0.0, 1.0, gen);
    p.value().mutable_grad() = slice_of(m, p.key(), g).contiguous();
  }
}

// Two AdamW steps on `m` with the unsharded model's gradients.
void train(torch::nn::Module& m, torch::nn::Module& whole, booster::OptimizerWrapper& opt) {
  for (int step = 0; step < 2; ++step) {
    set_grads(m, whole, step);
    opt.step();
  }
}

// AdamW is elementwise: a shard's update computes the same float operations on each element as
// the whole tensor's update, so the states are compared bitwise.
void expect_states_are_slices(torch::nn::Module& part, const optim::StateDict& got,
                              const optim::StateDict& whole) {
  std::map<std::string, at::Tensor> want;
  for (const auto& [n, t] : whole.tensors) want[n] = t;
  ASSERT_EQ(got.tensors.size(), want.size());
  for (const auto& [n, t] : got.tensors) {
    ASSERT_TRUE(want.count(n)) << n;
    const std::string param = n.substr(0, n.rfind('.'));
    EXPECT_TRUE(at::equal(t, slice_of(part, param, want[n]))) << n;
  }
  EXPECT_EQ(got.scalars.at("steps").dump(), whole.scalars.at("steps").dump());
}

TEST(TensorParallelCheckpointIO, OptimizerStatesRoundTripThroughOneFullShapeFile) {
  const fs::path d = shared_dir("optim");
  // The single-process reference: the whole model trained two steps.
  auto whole = build({}, 5);
  auto whole_opt = make_optimizer(*whole);
  train(*whole, *whole, *whole_opt);
  booster::DataParallelCheckpointIO().save_optimizer(*whole_opt, (d / "ref").string());
  const optim::StateDict ref = whole_opt->full_state_dict();

  for (int tp : tp_sizes()) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    Layout l = make_layout(tp);
    booster::TensorParallelCheckpointIO io(l.tp, l.dp);
    // Trained sharded, the same steps: states are the slices of the reference's.
    auto part = build(l.tp, 5);
    auto part_opt = make_optimizer(*part);
    train(*part, *whole, *part_opt);
    expect_states_are_slices(*part, part_opt->full_state_dict(), ref);
    io.set_model(part);
    const fs::path dir = d / ("tp" + std::to_string(tp));
    io.save_optimizer(*part_opt, dir.string());
    EXPECT_LE(io.last_save_stats().peak_full_tensors, 1);
    if (dist::rank() == 0) {
      // Same tensors, shapes and values as the single-process file.
      auto a = checkpoint::load_safetensors((d / "ref" / "optimizer.safetensors").string());
      auto b = checkpoint::load_safetensors((dir / "optimizer.safetensors").string());
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].first, b[i].first);
        EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
      }
      EXPECT_EQ(file_bytes(d / "ref" / "optimizer.json"), file_bytes(dir / "optimizer.json"));
    }

    // The single-process file into a fresh sharded optimizer: its slices.
    auto fresh = build(l.tp, 5);
    auto fresh_opt = make_optimizer(*fresh);
    io.set_model(fresh);
    io.load_optimizer(*fresh_opt, (d / "ref").string());
    expect_states_are_slices(*fresh, fresh_opt->full_state_dict(), ref);
    // The tp-written file into the whole model's optimizer (tp1): the reference states.
    auto whole2 = build({}, 5);
    auto whole2_opt = make_optimizer(*whole2);
    booster::DataParallelCheckpointIO().load_optimizer(*whole2_opt, dir.string());
    expect_states_are_slices(*whole2, whole2_opt->full_state_dict(), ref);
    // And into every other tp size.
    for (int other : tp_sizes()) {
      if (other == tp) continue;
      Layout lo = make_layout(other);
      booster::TensorParallelCheckpointIO io2(lo.tp, lo.dp);
      auto m = build(lo.tp, 5);
      auto m_opt = make_optimizer(*m);
      io2.set_model(m);
      io2.load_optimizer(*m_opt, dir.string());
      expect_states_are_slices(*m, m_opt->full_state_dict(), ref);
    }
  }
  // Without a model the IO cannot lay states out, and says so.
  Layout l = make_layout(dist::world_size());
  booster::TensorParallelCheckpointIO lonely(l.tp, l.dp);
  EXPECT_THROW(lonely.load_optimizer(*whole_opt, (d / "ref").string()), Error);
  drop_dir(d);
}

// ZeRO-2 over every rank (the whole model, states sharded over dp) reads the tensor-parallel
// file, and its own save (DataParallelCheckpointIO's format) loads back into tensor-parallel
// shards: tp <-> zero2 through the one full-shape format.
TEST(TensorParallelCheckpointIO, OptimizerStatesMoveBetweenTensorParallelAndZero2) {
  const fs::path d = shared_dir("zero");
  auto whole = build({}, 5);
  auto whole_opt = make_optimizer(*whole);
  train(*whole, *whole, *whole_opt);
  const optim::StateDict ref = whole_opt->full_state_dict();

  Layout l = make_layout(dist::world_size());
  booster::TensorParallelCheckpointIO io(l.tp, l.dp);
  auto part = build(l.tp, 5);
  auto part_opt = make_optimizer(*part);
  train(*part, *whole, *part_opt);
  io.set_model(part);
  io.save_optimizer(*part_opt, (d / "tp").string());

  booster::PluginOptions o;
  o.name = "zero2";
  o.zero.precision = "fp32";
  booster::Booster b(booster::make_plugin(o, "cpu"));
  auto zm = build({}, 5);
  auto boosted = b.boost(zm, make_adamw(*zm));
  b.load_optimizer(*boosted.optimizer, (d / "tp").string());
  expect_states_are_slices(*zm, boosted.optimizer->full_state_dict(), ref);
  b.save_optimizer(*boosted.optimizer, (d / "zero").string());

  auto fresh = build(l.tp, 5);
  auto fresh_opt = make_optimizer(*fresh);
  io.set_model(fresh);
  io.load_optimizer(*fresh_opt, (d / "zero").string());
  expect_states_are_slices(*fresh, fresh_opt->full_state_dict(), ref);
  drop_dir(d);
}

// A user's own model built from the project's layers (no plan, sharded by hand), with a LibTorch
// layer and a buffer that stay replicated: the lookup walks any module tree.
struct UserNet : torch::nn::Module {
  UserNet(const dist::Communicator& tp) {
    emb = register_module("emb", std::make_shared<nn::Embedding>(nn::EmbeddingOptions(64, 16)));
    up = register_module("up", std::make_shared<nn::Linear>(nn::LinearOptions(16, 32)));
    down = register_module("down", std::make_shared<nn::Linear>(nn::LinearOptions(32, 16)));
    plain = register_module("plain", torch::nn::Linear(16, 8));
    scale = register_buffer("scale", at::arange(4).to(at::kFloat));
    if (tp.valid() && tp.size() > 1) {
      emb->shard(nn::ShardSpec::over(nn::ShardSpec::Kind::Vocab, tp));
      up->shard(nn::ShardSpec::over(nn::ShardSpec::Kind::Column, tp));
      down->shard(nn::ShardSpec::over(nn::ShardSpec::Kind::Row, tp));
    }
  }
  std::shared_ptr<nn::Embedding> emb;
  std::shared_ptr<nn::Linear> up, down;
  torch::nn::Linear plain{nullptr};
  at::Tensor scale;
};

// `m` takes its slices of `whole`'s values.
void copy_slices(torch::nn::Module& m, torch::nn::Module& whole) {
  at::NoGradGuard ng;
  auto w = whole.named_parameters();
  for (auto& p : m.named_parameters()) p.value().copy_(slice_of(m, p.key(), w[p.key()]));
}

TEST(TensorParallelCheckpointIO, AUsersModelFromTheLayersSavesAndLoads) {
  Layout l = make_layout(dist::world_size());
  const fs::path d = shared_dir("user");
  at::manual_seed(11);
  auto whole = std::make_shared<UserNet>(dist::Communicator());
  {
    at::NoGradGuard ng;
    for (auto& p : whole->named_parameters()) p.value().normal_();
  }
  auto part = std::make_shared<UserNet>(l.tp);
  copy_slices(*part, *whole);
  auto sharded = booster::find_sharded_parameters(*part, l.tp);
  std::vector<std::string> names;
  for (const auto& [n, sp] : sharded) names.push_back(n + "@" + std::to_string(sp.dim));
  // down.bias (row-parallel) is kept whole; plain.* is a LibTorch layer.
  EXPECT_EQ(names, (std::vector<std::string>{"down.weight@1", "emb.weight@0", "up.bias@0",
                                             "up.weight@0"}));

  booster::ModelWrapper whole_w(whole), part_w(part);
  booster::DataParallelCheckpointIO().save_model(whole_w, (d / "ref").string(), false, 1024);
  booster::TensorParallelCheckpointIO io(l.tp, l.dp);
  io.save_model(part_w, (d / "tp").string(), false, 1024);
  if (dist::rank() == 0) {
    EXPECT_EQ(listing(d / "tp"), (std::vector<std::string>{"model.safetensors"}));
    EXPECT_TRUE(file_bytes(d / "ref" / "model.safetensors") ==
                file_bytes(d / "tp" / "model.safetensors"));
  }
  auto other = std::make_shared<UserNet>(l.tp);
  booster::ModelWrapper other_w(other);
  io.load_model(other_w, (d / "ref").string(), true, nullptr);
  auto w = whole->named_parameters();
  for (const auto& p : other->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), slice_of(*other, p.key(), w[p.key()]))) << p.key();
  drop_dir(d);
}

// The streaming writer checks what it is fed and leaves nothing behind when not finished.
TEST(SafetensorsStreamWriter, RefusesWrongTensorsAndCommitsOnlyWhenComplete) {
  const fs::path d =
      fs::temp_directory_path() / ("colossal_stream_writer_" + std::to_string(::getpid()));
  checkpoint::remove_tree(d.string());
  fs::create_directories(d);
  const std::string path = (d / "x.safetensors").string();
  std::vector<checkpoint::TensorDecl> decls{{"a", at::kFloat, {2, 3}}, {"b", at::kLong, {4}}};
  {
    checkpoint::SafetensorsStreamWriter w(path, decls);
    EXPECT_EQ(w.next().name, "b");  // 8-byte elements first, as save_safetensors orders them
    EXPECT_THROW(w.write_next(at::zeros({4}, at::kInt)), Error);  // wrong dtype
    EXPECT_THROW(w.finish(), Error);                              // nothing written yet
  }
  EXPECT_EQ(listing(d).size(), 0u) << "an unfinished writer left a file";
  checkpoint::SafetensorsStreamWriter w(path, decls);
  const at::Tensor a = at::arange(6).to(at::kFloat).view({2, 3}), b = at::arange(4);
  w.write_next(b);
  EXPECT_THROW(w.write_next(a.t()), Error);  // wrong shape
  w.write_next(a.t().t());
  w.finish();
  const fs::path ref = d / "ref.safetensors";
  checkpoint::save_safetensors(ref.string(), {{"a", a}, {"b", b}});
  EXPECT_TRUE(file_bytes(path) == file_bytes(ref));
  checkpoint::remove_tree(d.string());
}

// bf16 weights with fp32 norms: a file holds its 4-byte tensors first, so the gathers follow the
// files' order, not the model's.
TEST(TensorParallelCheckpointIO, MixedDtypesAreGatheredInFileOrder) {
  Layout l = make_layout(dist::world_size());
  const fs::path d = shared_dir("mixed");
  auto to_mixed = [](torch::nn::Module& m) {
    at::NoGradGuard ng;
    for (auto& p : m.named_parameters())
      if (p.key().find("norm") == std::string::npos)
        p.value().set_data(p.value().to(at::kBFloat16));
  };
  auto whole = build({}, 5);
  auto part = build(l.tp, 5);
  to_mixed(*whole);
  to_mixed(*part);
  booster::ModelWrapper whole_w(whole), part_w(part);
  booster::DataParallelCheckpointIO().save_model(whole_w, (d / "ref").string(), true, 1);
  booster::TensorParallelCheckpointIO(l.tp, l.dp).save_model(part_w, (d / "tp").string(), true, 1);
  if (dist::rank() == 0) {
    const auto names = listing(d / "ref");
    EXPECT_EQ(listing(d / "tp"), names);
    for (const auto& n : names)
      EXPECT_TRUE(file_bytes(d / "ref" / n) == file_bytes(d / "tp" / n)) << n << " differs";
    // The order really is mixed: some file holds a 4-byte tensor before a 2-byte one that
    // precedes it in the model.
    ASSERT_TRUE(std::count(names.begin(), names.end(), "model-00001-of-00002.safetensors"));
    checkpoint::SafetensorsReader r((d / "ref" / "model-00001-of-00002.safetensors").string());
    ASSERT_GE(r.tensors().size(), 2u);
    EXPECT_EQ(r.tensors().front().dtype, at::kFloat);
  }
  drop_dir(d);
}

}  // namespace
