// Checkpoints of a padded vocabulary (2 and 4 ranks over Gloo): a tiny Llama whose vocabulary no
// tp divides, sharded by the tensor-parallel plan with its vocab-parallel embedding and head
// (tied and untied), saves through TensorParallelCheckpointIO exactly the files the unsharded
// model saves (HF-shaped: no padding row reaches a file), and loading the unsharded model's
// files gives each rank its slice with the padding rows zero.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "colossal/booster/checkpoint_io.h"
#include "colossal/booster/tensor_parallel_checkpoint_io.h"
#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/models/llama/plan.h"
#include "colossal/nn/embedding.h"
#include "colossal/nn/init.h"
#include "colossal/nn/plan.h"
#include "dist/dist_test_env.h"

namespace {

using namespace colossal;
namespace fs = std::filesystem;

models::ModelConfig tiny_config(bool tied) {
  models::ModelConfig c = models::ModelConfig::preset("tiny");
  c.vocab_size = 37;  // padded to 40 (tp 2) or 48 (tp 4) with make_vocab_size_divisible_by 4
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = 4;
  c.layer_sliding.assign(1, false);
  c.tie_word_embeddings = tied;
  return c;
}

std::shared_ptr<models::CausalLM> build(const models::ModelConfig& c, bool shard, uint64_t seed) {
  auto m = std::make_shared<models::CausalLM>(c, at::TensorOptions().device(at::kMeta));
  if (shard) {
    nn::PlanOptions po;
    po.tp = dist::world();
    models::TensorParallelOptions tpo;
    tpo.make_vocab_size_divisible_by = 4;
    nn::apply_plan(*m, models::tensor_parallel_plan(c, tpo), po);
  }
  nn::InitOptions io;
  io.seed = seed;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

fs::path shared_dir(const std::string& name) {
  at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  dist::world().broadcast(pid, 0);
  fs::path d = fs::temp_directory_path() /
               ("colossal_vocab_ckpt_" + name + "_" + std::to_string(pid.item<int64_t>()));
  if (dist::rank() == 0) {
    checkpoint::remove_tree(d.string());
    fs::create_directories(d);
  }
  dist::world().barrier();
  return d;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST(VocabParallelCheckpoint, PaddedShardsSaveAndLoadHFShapedFiles) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const models::ModelConfig c = tiny_config(tied);
    const fs::path d = shared_dir(tied ? "tied" : "untied");
    auto whole = build(c, false, 5);
    booster::ModelWrapper whole_w(whole);
    booster::DataParallelCheckpointIO().save_model(whole_w, (d / "ref").string(), false, 1024);
    auto part = build(c, true, 5);
    auto* embed = part->model->embed_tokens.get();
    ASSERT_GT(embed->padded_vocab_size(), c.vocab_size);  // the padding is there
    booster::ModelWrapper part_w(part);
    booster::TensorParallelCheckpointIO io(dist::world(), dist::Communicator());
    io.save_model(part_w, (d / "tp").string(), false, 1024);
    dist::world().barrier();
    if (dist::rank() == 0) {
      int64_t files = 0;
      for (const auto& e : fs::directory_iterator(d / "ref")) {
        const std::string n = e.path().filename().string();
        EXPECT_TRUE(file_bytes(d / "ref" / n) == file_bytes(d / "tp" / n)) << n << " differs";
        ++files;
      }
      EXPECT_GT(files, 0);
    }
    // Loading the unsharded files: each rank's slice, padding rows zero.
    auto other = build(c, true, 11);
    booster::ModelWrapper other_w(other);
    io.load_model(other_w, (d / "ref").string(), /*strict=*/true, nullptr);
    auto whole_params = whole->named_parameters();
    for (const auto& p : other->named_parameters()) {
      const std::string& name = p.key();
      const size_t dot = name.rfind('.');
      auto* layer = dynamic_cast<nn::Module*>(nn::find_module(*other, name.substr(0, dot)).get());
      ASSERT_NE(layer, nullptr) << name;
      EXPECT_TRUE(
          at::equal(p.value(), layer->shard_slice(name.substr(dot + 1), whole_params[name])))
          << name;
    }
    const auto* e = other->model->embed_tokens.get();
    EXPECT_TRUE(e->weight()
                    .narrow(0, e->valid_rows(), e->num_embeddings() - e->valid_rows())
                    .eq(0)
                    .all()
                    .item<bool>());
    dist::world().barrier();
    if (dist::rank() == 0) checkpoint::remove_tree(d.string());
  }
}
