// TensorParallelCheckpointIO with pipeline stages over Gloo (registered with 2 and 4 ranks):
// every rank builds the same tiny Llama (name-keyed initial values), keeps its stage's blocks
// (keep_blocks; the tensor-parallel plan when tp > 1) and saves or loads through the IO with the
// mesh's (tp, dp, pp) groups. Layouts: pp2 at 2 ranks; pp2 x tp2, pp4 and pp2 x dp2 at 4.
// Checked against the single-process files of DataParallelCheckpointIO: the same tensors, one
// index over every stage's shards, loads across layouts both ways, a tied embedding held by two
// stages written once and loaded into both, full-shape optimizer states across pp, bad input
// named. (Temporary folders go through checkpoint::remove_tree: std::filesystem::remove_all
// crashes with this LibTorch.)
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/tensor_parallel_checkpoint_io.h"
#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/init.h"
#include "colossal/nn/module.h"
#include "colossal/nn/plan.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/optimizer.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;
namespace fs = std::filesystem;

// Large enough that size_per_shard_mb = 1 cuts several files per stage (the embedding and the
// head are 1 MiB each in fp32); four layers so that pp4 has a layer or two per stage.
models::ModelConfig tiny_config(bool tied) {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = 16;
  c.layer_sliding.assign(4, false);
  c.qkv_bias = true;
  c.o_bias = true;
  c.tie_word_embeddings = tied;
  return c;
}

struct Layout {
  int dp = 1, pp = 1, tp = 1;
  std::string name() const {
    return "dp" + std::to_string(dp) + "_pp" + std::to_string(pp) + "_tp" + std::to_string(tp);
  }
};

// The pipelined layouts of this world size.
std::vector<Layout> pp_layouts() {
  if (dist::world_size() == 2) return {{1, 2, 1}};
  if (dist::world_size() == 4) return {{1, 2, 2}, {1, 4, 1}, {2, 2, 1}};
  ADD_FAILURE() << "run with 2 or 4 ranks";
  return {};
}

// One mesh per layout over the world (made once: a group is created once per job).
dist::ParallelDims& dims_of(const Layout& l) {
  static std::map<std::tuple<int, int, int>, std::unique_ptr<dist::ParallelDims>> made;
  auto& d = made[{l.dp, l.pp, l.tp}];
  if (!d) {
    dist::ParallelDegrees deg;
    deg.dp = l.dp;
    deg.pp = l.pp;
    deg.tp = l.tp;
    d = std::make_unique<dist::ParallelDims>(deg, dist::world());
  }
  return *d;
}

// Blocks [begin, end) of stage s of pp: the spec's halves for pp2 (embedding + L/2 layers, the
// rest + norm + head), even contiguous cuts otherwise.
std::pair<int64_t, int64_t> stage_range(int64_t n, int pp, int s) {
  return {s * n / pp, (s + 1) * n / pp};
}

// This rank's stage of the model (the whole model without dims) with name-keyed initial values
// of `seed`. A tied model's last stage keeps the embedding as its head's weight: keep_blocks
// refuses a tied head without it, so that stage holds the embedding and drops the layers of
// the earlier stages by hand (the copy a pipeline keeps; its name is model.embed_tokens.weight).
std::shared_ptr<models::CausalLM> build(dist::ParallelDims* dims, uint64_t seed,
                                        bool tied = false) {
  const models::ModelConfig c = tiny_config(tied);
  auto m = std::make_shared<models::CausalLM>(c, at::TensorOptions().device(at::kMeta));
  const int pp = dims ? dims->degrees().pp : 1, tp = dims ? dims->degrees().tp : 1;
  if (pp > 1) {
    const int64_t n = m->num_blocks();
    auto [b, e] = stage_range(n, pp, dims->pp().rank());
    if (tied && b > 0 && e == n) {
      for (int64_t i = 0; i + 1 < b; ++i) m->model->layers->drop(i);
    } else {
      m->keep_blocks(b, e);
    }
  }
  if (tp > 1) {
    models::check_tensor_parallel(c, tp);
    nn::PlanOptions po;
    po.tp = dims->tp();
    po.every_rule_matches = pp == 1;  // a stage holds only some of the blocks
    nn::apply_plan(*m, models::tensor_parallel_plan(c), po);
  }
  nn::InitOptions io;
  io.seed = seed;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

std::unique_ptr<booster::TensorParallelCheckpointIO> make_io(dist::ParallelDims& d) {
  return std::make_unique<booster::TensorParallelCheckpointIO>(d.tp(), d.dp(), d.pp());
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
               ("colossal_pp_ckpt_" + name + "_" + std::to_string(pid.item<int64_t>()));
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

std::vector<std::string> listing(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::map<std::string, at::Tensor> by_name(const checkpoint::TensorList& l) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [n, t] : l) out.emplace(n, t);
  return out;
}

// The same names, shapes and values.
void expect_same_tensors(const fs::path& got_dir, const fs::path& ref_dir) {
  auto got = by_name(checkpoint::load_state_dict(got_dir.string()));
  auto ref = by_name(checkpoint::load_state_dict(ref_dir.string()));
  ASSERT_EQ(got.size(), ref.size());
  for (const auto& [n, t] : ref) {
    ASSERT_TRUE(got.count(n)) << n << " missing";
    EXPECT_EQ(got[n].sizes(), t.sizes()) << n;
    EXPECT_TRUE(at::equal(got[n], t)) << n;
  }
}

// The index lists every tensor once and covers exactly the shard files of the folder, each file
// holding exactly the tensors the index maps to it; total_size is their bytes.
void expect_index_covers_shards(const fs::path& d) {
  json::Value index = json::parse_file((d / "model.safetensors.index.json").string());
  const auto& wm = index.at("weight_map").as_object();
  std::map<std::string, std::set<std::string>> per_file;
  for (const auto& [n, f] : wm) per_file[f.as_string()].insert(n);
  std::set<std::string> on_disk;
  for (const auto& n : listing(d))
    if (n.size() > 12 && n.substr(n.size() - 12) == ".safetensors") on_disk.insert(n);
  std::set<std::string> indexed;
  for (const auto& [f, names] : per_file) indexed.insert(f);
  EXPECT_EQ(indexed, on_disk);
  EXPECT_GT(on_disk.size(), 1u);
  EXPECT_FALSE(on_disk.count("model.safetensors"));
  uint64_t bytes = 0;
  size_t count = 0;
  for (const auto& [f, names] : per_file) {
    checkpoint::SafetensorsReader r((d / f).string());
    std::set<std::string> in_file;
    for (const auto& info : r.tensors()) {
      in_file.insert(info.name);
      bytes += info.end - info.begin;
    }
    EXPECT_EQ(in_file, names) << f;
    count += in_file.size();
  }
  EXPECT_EQ(count, wm.size()) << "a tensor is held by two files";
  EXPECT_EQ(static_cast<uint64_t>(index.at("metadata").at("total_size").as_int()), bytes);
}

void expect_params_equal(torch::nn::Module& m, torch::nn::Module& whole) {
  auto w = whole.named_parameters();
  for (const auto& p : m.named_parameters()) {
    ASSERT_TRUE(w.contains(p.key())) << p.key();
    EXPECT_TRUE(at::equal(p.value(), slice_of(m, p.key(), w[p.key()]))) << p.key();
  }
}

TEST(PipelineCheckpointIO, StageSavesEqualTheSingleProcessSave) {
  for (const Layout& l : pp_layouts()) {
    for (bool shard : {true, false}) {
      SCOPED_TRACE(l.name() + (shard ? " sharded" : " shard=false"));
      dist::ParallelDims& d = dims_of(l);
      const fs::path dir = shared_dir("save");
      auto whole = build(nullptr, 5);
      booster::ModelWrapper whole_w(whole);
      booster::DataParallelCheckpointIO().save_model(whole_w, (dir / "ref").string(), shard, 1);
      auto part = build(&d, 5);
      booster::ModelWrapper part_w(part);
      auto io = make_io(d);
      io->save_model(part_w, (dir / "pp").string(), shard, 1);
      EXPECT_LE(io->last_save_stats().peak_full_tensors, 1);
      // Every stage writer gathers its stage's tp-sharded tensors (the others gather none).
      const bool stage_writer = d.tp().rank() == 0 && d.dp().rank() == 0;
      EXPECT_EQ(io->last_save_stats().gathered > 0, stage_writer && l.tp > 1);
      if (dist::rank() == 0) {
        expect_same_tensors(dir / "pp", dir / "ref");
        expect_index_covers_shards(dir / "pp");
        EXPECT_TRUE(fs::exists(dir / "pp" / "config.json"));
        EXPECT_FALSE(fs::exists(dir / "pp.staging"));
        // shard=false: one file per stage.
        if (!shard) {
          size_t files = 0;
          for (const auto& n : listing(dir / "pp")) files += n.find("-of-") != std::string::npos;
          EXPECT_EQ(files, static_cast<size_t>(l.pp));
        }
      }
      // For the Python check (test_pp_checkpoint_interop.py): the pp2 sharded save.
      const char* keep = std::getenv("COLOSSAL_PP_CKPT_OUT");
      if (keep && dist::rank() == 0 && shard && l.pp == 2 && l.tp == 1 && l.dp == 1)
        fs::copy(dir / "pp", keep,
                 fs::copy_options::recursive | fs::copy_options::overwrite_existing);
      drop_dir(dir);
    }
  }
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A pp group of one is the tensor-parallel IO: byte-identical files, in place (no staging).
TEST(PipelineCheckpointIO, APipelineGroupOfOneWritesTheSingleProcessFiles) {
  dist::ParallelDims& d = dims_of({dist::world_size(), 1, 1});
  for (bool shard : {true, false}) {
    const fs::path dir = shared_dir("pp1");
    auto m = build(&d, 5);
    booster::ModelWrapper m_w(m);
    booster::DataParallelCheckpointIO().save_model(m_w, (dir / "ref").string(), shard, 1);
    auto io = make_io(d);
    EXPECT_FALSE(io->pipelined());
    io->save_model(m_w, (dir / "pp1").string(), shard, 1);
    if (dist::rank() == 0) {
      const auto names = listing(dir / "ref");
      EXPECT_EQ(listing(dir / "pp1"), names);
      for (const auto& n : names)
        EXPECT_TRUE(file_bytes(dir / "ref" / n) == file_bytes(dir / "pp1" / n)) << n;
    }
    drop_dir(dir);
  }
}

// A save over an existing checkpoint replaces its model files as a whole and keeps the others.
TEST(PipelineCheckpointIO, ASaveReplacesTheFolderAndKeepsOtherFiles) {
  const Layout l = pp_layouts().front();
  dist::ParallelDims& d = dims_of(l);
  const fs::path dir = shared_dir("again");
  auto io = make_io(d);
  auto a = build(&d, 5);
  booster::ModelWrapper a_w(a);
  io->save_model(a_w, (dir / "pp").string(), true, 1);
  if (dist::rank() == 0) {
    std::ofstream((dir / "pp" / "optimizer.json").string()) << "{}";
    // A stale shard name of another count must not survive.
    std::ofstream((dir / "pp" / "model-00009-of-00099.safetensors").string()) << "x";
  }
  dist::world().barrier();
  auto b = build(&d, 6);
  booster::ModelWrapper b_w(b);
  io->save_model(b_w, (dir / "pp").string(), false, 1);
  if (dist::rank() == 0) {
    EXPECT_TRUE(fs::exists(dir / "pp" / "optimizer.json"));
    EXPECT_FALSE(fs::exists(dir / "pp" / "model-00009-of-00099.safetensors"));
    expect_index_covers_shards(dir / "pp");
  }
  dist::world().barrier();
  auto whole = build(nullptr, 1);
  booster::ModelWrapper whole_w(whole);
  booster::DataParallelCheckpointIO().load_model(whole_w, (dir / "pp").string(), true, nullptr);
  expect_params_equal(*whole, *build(nullptr, 6));
  drop_dir(dir);
}

TEST(PipelineCheckpointIO, LoadsAcrossLayoutsBothWays) {
  for (const Layout& l : pp_layouts()) {
    SCOPED_TRACE(l.name());
    dist::ParallelDims& d = dims_of(l);
    const fs::path dir = shared_dir("load");
    auto ref = build(nullptr, 5);
    booster::ModelWrapper ref_w(ref);
    booster::DataParallelCheckpointIO().save_model(ref_w, (dir / "one").string(), false, 1024);
    booster::DataParallelCheckpointIO().save_model(ref_w, (dir / "sharded").string(), true, 1);
    auto io = make_io(d);
    // The single-process files (one file, and index + shards) into the stages.
    for (const char* src : {"one", "sharded"}) {
      auto part = build(&d, 7);
      booster::ModelWrapper part_w(part);
      io->load_model(part_w, (dir / src).string(), /*strict=*/true, nullptr);
      expect_params_equal(*part, *ref);
    }
    // A stage save into the whole model and into tp2.
    auto part = build(&d, 5);
    booster::ModelWrapper part_w(part);
    io->save_model(part_w, (dir / "pp").string(), true, 1);
    auto whole = build(nullptr, 7);
    booster::ModelWrapper whole_w(whole);
    booster::DataParallelCheckpointIO().load_model(whole_w, (dir / "pp").string(), true, nullptr);
    expect_params_equal(*whole, *ref);
    dist::ParallelDims& t = dims_of({dist::world_size() / 2, 1, 2});
    auto tp2 = build(&t, 7);
    booster::ModelWrapper tp2_w(tp2);
    booster::TensorParallelCheckpointIO(t.tp(), t.dp())
        .load_model(tp2_w, (dir / "pp").string(), true, nullptr);
    expect_params_equal(*tp2, *ref);
    // And back into the stages.
    auto again = build(&d, 9);
    booster::ModelWrapper again_w(again);
    io->load_model(again_w, (dir / "pp").string(), true, nullptr);
    expect_params_equal(*again, *ref);
    drop_dir(dir);
  }
}

TEST(PipelineCheckpointIO, ATiedEmbeddingHeldByTwoStagesIsWrittenOnceAndLoadedIntoBoth) {
  for (const Layout& l : pp_layouts()) {
    if (l.tp > 1) continue;
    SCOPED_TRACE(l.name());
    dist::ParallelDims& d = dims_of(l);
    const fs::path dir = shared_dir("tied");
    auto part = build(&d, 5, true);
    const bool holds_embedding = part->named_parameters().contains("model.embed_tokens.weight");
    const int last = l.pp - 1;
    EXPECT_EQ(holds_embedding, d.pp().rank() == 0 || d.pp().rank() == last);
    booster::ModelWrapper part_w(part);
    auto io = make_io(d);
    io->save_model(part_w, (dir / "pp").string(), true, 1);
    auto ref = build(nullptr, 5, true);
    booster::ModelWrapper ref_w(ref);
    booster::DataParallelCheckpointIO().save_model(ref_w, (dir / "ref").string(), true, 1);
    if (dist::rank() == 0) {
      expect_same_tensors(dir / "pp", dir / "ref");
      expect_index_covers_shards(dir / "pp");  // written once: no file holds it twice
      json::Value index = json::parse_file((dir / "pp" / "model.safetensors.index.json").string());
      EXPECT_EQ(index.at("weight_map").at("model.embed_tokens.weight").as_string(),
                "model-00001-of-" +
                    index.at("weight_map").at("model.norm.weight").as_string().substr(15));
    }
    // Loaded into both holders (from the single-process and the stage files).
    for (const char* src : {"ref", "pp"}) {
      auto fresh = build(&d, 8, true);
      booster::ModelWrapper fresh_w(fresh);
      io->load_model(fresh_w, (dir / src).string(), true, nullptr);
      expect_params_equal(*fresh, *ref);
    }
    drop_dir(dir);
  }
}

// AdamW wrapped as the none/ddp plugins wrap it (fp32).
std::shared_ptr<booster::OptimizerWrapper> make_optimizer(torch::nn::Module& m) {
  auto opt = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> ps;
  for (auto& item : m.named_parameters(true)) ps.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = 1e-2;
  g.weight_decay = 0.1;
  opt->add_param_group(ps, g);
  return std::make_shared<booster::OptimizerWrapper>(opt, booster::Precision::FP32,
                                                     booster::LossScaleOptions{});
}

// Two AdamW steps with the whole model's gradients (by name and step), sliced for a shard.
void train(torch::nn::Module& m, torch::nn::Module& whole, booster::OptimizerWrapper& opt) {
  auto whole_params = whole.named_parameters();
  for (int step = 0; step < 2; ++step) {
    for (auto& p : m.named_parameters()) {
      const at::Tensor& full = whole_params[p.key()];
      auto gen = at::make_generator<at::CPUGeneratorImpl>(nn::param_seed(100 + step, p.key()));
      at::Tensor g = at::empty(full.sizes()).normal_(0.0, 1.0, gen);
      p.value().mutable_grad() = slice_of(m, p.key(), g).contiguous();
    }
    opt.step();
  }
}

// The states of `part` are the slices of the whole model's states of its parameters.
void expect_stage_states(torch::nn::Module& part, const optim::StateDict& got,
                         const optim::StateDict& whole) {
  std::map<std::string, at::Tensor> want;
  auto params = part.named_parameters();
  for (const auto& [n, t] : whole.tensors)
    if (params.contains(n.substr(0, n.rfind('.')))) want[n] = t;
  ASSERT_EQ(got.tensors.size(), want.size());
  for (const auto& [n, t] : got.tensors) {
    ASSERT_TRUE(want.count(n)) << n;
    EXPECT_TRUE(at::equal(t, slice_of(part, n.substr(0, n.rfind('.')), want[n]))) << n;
  }
  for (const auto& p : params)
    EXPECT_EQ(got.scalars.at("steps").at(p.key()).as_int(),
              whole.scalars.at("steps").at(p.key()).as_int());
}

TEST(PipelineCheckpointIO, OptimizerStatesMoveBetweenStagesAndOneProcess) {
  std::vector<std::pair<Layout, bool>> cases;
  for (const Layout& l : pp_layouts()) {
    cases.emplace_back(l, false);
    if (l.tp == 1) cases.emplace_back(l, true);
  }
  for (const auto& [l, tied] : cases) {
    SCOPED_TRACE(l.name() + (tied ? " tied" : ""));
    dist::ParallelDims& d = dims_of(l);
    const fs::path dir = shared_dir("optim");
    auto whole = build(nullptr, 5, tied);
    auto whole_opt = make_optimizer(*whole);
    train(*whole, *whole, *whole_opt);
    booster::DataParallelCheckpointIO().save_optimizer(*whole_opt, (dir / "ref").string());
    const optim::StateDict ref = whole_opt->full_state_dict();

    auto io = make_io(d);
    auto part = build(&d, 5, tied);
    auto part_opt = make_optimizer(*part);
    train(*part, *whole, *part_opt);
    expect_stage_states(*part, part_opt->full_state_dict(), ref);
    io->set_model(part);
    io->save_optimizer(*part_opt, (dir / "pp").string());
    EXPECT_LE(io->last_save_stats().peak_full_tensors, 1);
    if (dist::rank() == 0) {
      // One file: the single-process tensors (a tied copy's states once) and scalars.
      auto a = checkpoint::load_safetensors((dir / "ref" / "optimizer.safetensors").string());
      auto b = checkpoint::load_safetensors((dir / "pp" / "optimizer.safetensors").string());
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].first, b[i].first);
        EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
      }
      EXPECT_EQ(json::parse_file((dir / "ref" / "optimizer.json").string()),
                json::parse_file((dir / "pp" / "optimizer.json").string()));
    }
    // pp -> one process (DataParallelCheckpointIO) and -> tp2 (no pp).
    auto whole2 = build(nullptr, 5, tied);
    auto whole2_opt = make_optimizer(*whole2);
    booster::DataParallelCheckpointIO().load_optimizer(*whole2_opt, (dir / "pp").string());
    expect_stage_states(*whole2, whole2_opt->full_state_dict(), ref);
    if (!tied) {
      dist::ParallelDims& t = dims_of({dist::world_size() / 2, 1, 2});
      booster::TensorParallelCheckpointIO tio(t.tp(), t.dp());
      auto tp2 = build(&t, 5);
      auto tp2_opt = make_optimizer(*tp2);
      tio.set_model(tp2);
      tio.load_optimizer(*tp2_opt, (dir / "pp").string());
      expect_stage_states(*tp2, tp2_opt->full_state_dict(), ref);
    }
    // One process -> pp, and pp -> pp.
    for (const char* src : {"ref", "pp"}) {
      auto fresh = build(&d, 5, tied);
      auto fresh_opt = make_optimizer(*fresh);
      io->set_model(fresh);
      io->load_optimizer(*fresh_opt, (dir / src).string());
      expect_stage_states(*fresh, fresh_opt->full_state_dict(), ref);
    }
    drop_dir(dir);
  }
}

// A stage opens only the shards holding its tensors: a damaged shard of other tensors does not
// stop it, and the names of every tensor come back from the index.
TEST(PipelineCheckpointIO, AFilteredLoadOpensOnlyTheShardsItNeeds) {
  const fs::path dir = shared_dir("filter");
  if (dist::rank() == 0) {
    auto ref = build(nullptr, 5);
    checkpoint::SaveOptions so;
    so.size_per_shard_mb = 1;
    checkpoint::save_state_dict((dir / "ref").string(), checkpoint::module_state(*ref), so);
    json::Value index = json::parse_file((dir / "ref" / "model.safetensors.index.json").string());
    const std::string keep = index.at("weight_map").at("model.norm.weight").as_string();
    std::string damaged;
    for (const auto& n : listing(dir / "ref"))
      if (n.find("-of-") != std::string::npos && n != keep) damaged = n;
    ASSERT_FALSE(damaged.empty());
    std::ofstream((dir / "ref" / damaged).string(), std::ios::trunc) << "not a safetensors file";
    std::vector<std::string> names;
    auto got = checkpoint::load_state_dict(
        (dir / "ref").string(), [](const std::string& n) { return n == "model.norm.weight"; },
        &names);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_TRUE(at::equal(got[0].second, ref->named_parameters()["model.norm.weight"]));
    EXPECT_EQ(names.size(), index.at("weight_map").size());
    EXPECT_THROW(checkpoint::load_state_dict((dir / "ref").string()), InputError);
  }
  drop_dir(dir);
}

TEST(PipelineCheckpointIO, BadInputIsNamedOnEveryRank) {
  const Layout l = pp_layouts().front();
  dist::ParallelDims& d = dims_of(l);
  const fs::path dir = shared_dir("bad");
  auto io = make_io(d);
  auto part = build(&d, 5);
  booster::ModelWrapper part_w(part);
  io->save_model(part_w, (dir / "pp").string(), true, 1);
  std::string gone;
  if (dist::rank() == 0) {
    // An index naming a shard that is not there.
    fs::create_directories(dir / "holey");
    for (const auto& n : listing(dir / "pp")) {
      if (gone.empty() && n.find("-of-") != std::string::npos) {
        gone = n;
        continue;
      }
      fs::copy_file(dir / "pp" / n, dir / "holey" / n);
    }
    // The last stage's norm missing, and a tensor no stage holds.
    auto state = checkpoint::module_state(*build(nullptr, 5));
    std::erase_if(state, [](const auto& nt) { return nt.first == "model.norm.weight"; });
    state.emplace_back("bogus.weight", at::ones({3}));
    checkpoint::save_state_dict((dir / "lacking").string(), state);
  }
  at::Tensor name_len = at::full({1}, static_cast<int64_t>(gone.size()), at::kLong);
  dist::world().broadcast(name_len, 0);
  ASSERT_GT(name_len.item<int64_t>(), 0);
  try {
    io->load_model(part_w, (dir / "holey").string(), true, nullptr);
    ADD_FAILURE() << "an index naming a missing shard was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
    if (dist::rank() == 0) {
      EXPECT_NE(std::string(e.what()).find(gone), std::string::npos) << e.what();
    }
  }
  const std::string last = std::to_string(l.pp - 1);
  try {
    io->load_model(part_w, (dir / "lacking").string(), true, nullptr);
    ADD_FAILURE() << "a strict load accepted a checkpoint missing a stage's tensor";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("stage " + last + ": missing from the checkpoint: model.norm.weight"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("not in the model: bogus.weight"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("stage 0"), std::string::npos) << msg;
  }
  // Non-strict: the rest loads on every stage.
  auto other = build(&d, 9);
  booster::ModelWrapper other_w(other);
  io->load_model(other_w, (dir / "lacking").string(), false, nullptr);
  auto ref = build(nullptr, 5);
  auto w = ref->named_parameters();
  for (const auto& p : other->named_parameters())
    if (p.key() != "model.norm.weight") {
      EXPECT_TRUE(at::equal(p.value(), slice_of(*other, p.key(), w[p.key()]))) << p.key();
    }
  drop_dir(dir);
}

}  // namespace
