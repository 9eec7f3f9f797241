// Module base (hooks, set_data, sharding), name-keyed init, meta construction, pipeline blocks
// and the KV cache of colossal::nn, checked against ATen computations.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
#include "common/temp_dir.h"
#include "common/tiny_llama.h"

using namespace colossal;
using namespace colossal::nn;
using namespace colossal::models;

namespace {

ModelConfig small_config() {
  return tests::tiny_llama(3, 96);
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& c, uint64_t seed = 1) {
  auto m = std::make_shared<CausalLM>(c);
  InitOptions io;
  io.seed = seed;
  io.std = 0.2;
  init_parameters(*m, io);
  return m;
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

}  // namespace

TEST(Hooks, FireInOrderAndCanBeRemoved) {
  auto lin = std::make_shared<Linear>(LinearOptions(4, 3).bias(true));
  init_parameters(*lin);
  std::vector<std::string> log;
  auto h1 = lin->add_forward_pre_hook([&](Module&) { log.push_back("pre1"); });
  auto h2 = lin->add_forward_pre_hook([&](Module&) { log.push_back("pre2"); });
  auto h3 = lin->add_forward_post_hook([&](Module& m) {
    log.push_back("post");
    EXPECT_EQ(&m, lin.get());
  });
  lin->forward(at::randn({2, 4}));
  EXPECT_EQ(log, (std::vector<std::string>{"pre1", "pre2", "post"}));
  h1.remove();
  EXPECT_FALSE(h1.active());
  EXPECT_TRUE(h2.active());
  log.clear();
  lin->forward(at::randn({2, 4}));
  EXPECT_EQ(log, (std::vector<std::string>{"pre2", "post"}));
  h2.remove();
  h3.remove();
  h3.remove();  // twice is harmless
  log.clear();
  lin->forward(at::randn({2, 4}));
  EXPECT_TRUE(log.empty());
  EXPECT_EQ(lin->num_forward_hooks(), 0u);
}

TEST(Hooks, NestedModulesFireOuterFirstAndSelfRemovalIsSafe) {
  auto m = make_model(small_config());
  std::vector<std::string> log;
  HookHandle self;
  self = m->model->layers->layers[1]->add_forward_pre_hook([&](Module&) {
    log.push_back("layer1.pre");
    self.remove();  // removing itself while running
  });
  m->add_forward_pre_hook([&](Module&) { log.push_back("lm.pre"); });
  m->model->layers->layers[1]->mlp->add_forward_post_hook(
      [&](Module&) { log.push_back("layer1.mlp.post"); });
  m->add_forward_post_hook([&](Module&) { log.push_back("lm.post"); });
  at::NoGradGuard ng;
  m->forward(at::randint(0, 96, {1, 5}, at::kLong));
  EXPECT_EQ(log, (std::vector<std::string>{"lm.pre", "layer1.pre", "layer1.mlp.post", "lm.post"}));
  log.clear();
  m->forward(at::randint(0, 96, {1, 5}, at::kLong));
  EXPECT_EQ(log, (std::vector<std::string>{"lm.pre", "layer1.mlp.post", "lm.post"}));
}

TEST(Params, SetDataToViewsKeepsForwardCorrect) {
  auto m = make_model(small_config());
  at::NoGradGuard ng;
  at::Tensor ids = at::randint(0, 96, {2, 7}, at::kLong);
  at::Tensor ref = m->forward(ids);
  // Re-point every parameter into one flat buffer (what chunked storage does).
  int64_t total = 0;
  for (auto& p : m->parameters()) total += p.numel();
  at::Tensor flat = at::empty({total});
  int64_t off = 0;
  for (auto& p : m->parameters()) {
    at::Tensor view = flat.narrow(0, off, p.numel()).view(p.sizes());
    view.copy_(p);
    p.set_data(view);
    off += p.numel();
  }
  EXPECT_TRUE(at::equal(m->forward(ids), ref));
  // Writing into the buffer changes what the layers compute: nothing cached the old storage.
  flat.mul_(0.5);
  EXPECT_FALSE(at::allclose(m->forward(ids), ref));
  EXPECT_EQ(m->model->norm->weight().data_ptr<float>(),
            flat.data_ptr<float>() + (off - 32 - 96 * 32));
}

TEST(Shard, LinearColumnAndRowConcatenateBack) {
  for (int64_t world : {2, 4}) {
    Linear full(LinearOptions(8, 12).bias(true));
    init_parameters(full, {});
    at::NoGradGuard ng;
    at::Tensor x = at::randn({3, 8});
    std::vector<at::Tensor> wcol, bcol, outs, wrow, partial;
    for (int64_t r = 0; r < world; ++r) {
      Linear col(LinearOptions(8, 12).bias(true));
      col.weight().copy_(full.weight());
      col.param("bias").copy_(full.param("bias"));
      col.shard({ShardSpec::Kind::Column, r, world});
      EXPECT_EQ(col.out_features(), 12 / world);
      ASSERT_TRUE(col.shard_spec().has_value());
      wcol.push_back(col.weight());
      bcol.push_back(col.param("bias"));
      outs.push_back(col.forward(x));
      Linear row(LinearOptions(8, 12).bias(false));
      row.weight().copy_(full.weight());
      row.shard({ShardSpec::Kind::Row, r, world});
      EXPECT_EQ(row.in_features(), 8 / world);
      wrow.push_back(row.weight());
      partial.push_back(row.forward(x.narrow(1, r * (8 / world), 8 / world)));
    }
    EXPECT_TRUE(at::equal(at::cat(wcol, 0), full.weight()));
    EXPECT_TRUE(at::equal(at::cat(bcol, 0), full.param("bias")));
    EXPECT_TRUE(at::equal(at::cat(wrow, 1), full.weight()));
    EXPECT_TRUE(at::allclose(at::cat(outs, 1), full.forward(x), 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(at::stack(partial).sum(0), at::linear(x, full.weight()), 1e-5, 1e-5));
  }
}

TEST(Shard, EmbeddingVocabAndErrors) {
  Embedding full(EmbeddingOptions(12, 4));
  init_parameters(full, {});
  at::NoGradGuard ng;
  at::Tensor ids = at::tensor(std::vector<int64_t>{0, 5, 11, 6, 3}).view({1, 5});
  std::vector<at::Tensor> ws;
  at::Tensor sum = at::zeros({1, 5, 4});
  for (int64_t r = 0; r < 3; ++r) {
    Embedding e(EmbeddingOptions(12, 4));
    e.weight().copy_(full.weight());
    e.shard({ShardSpec::Kind::Vocab, r, 3});
    ws.push_back(e.weight());
    sum += e.forward(ids);  // out-of-range ids give zeros: the shards sum to the full lookup
  }
  EXPECT_TRUE(at::equal(at::cat(ws, 0), full.weight()));
  EXPECT_TRUE(at::equal(sum, full.forward(ids)));
  Linear l(LinearOptions(6, 10).bias(false));
  EXPECT_THROW(l.shard({ShardSpec::Kind::Column, 0, 4}), Error);  // 10 % 4 != 0
  EXPECT_THROW(l.shard({ShardSpec::Kind::Vocab, 0, 2}), Error);
  RMSNorm n(4, 1e-6, at::TensorOptions());
  EXPECT_THROW(n.shard({ShardSpec::Kind::Column, 0, 2}), Error);
}

TEST(Init, KeyedByNameNotByOrderOrLayout) {
  ModelConfig c = small_config();
  auto a = make_model(c, 5);
  auto b = make_model(c, 5);
  auto other_seed = make_model(c, 6);
  auto sa = a->named_parameters();
  auto sb = b->named_parameters();
  for (const auto& p : sa) EXPECT_TRUE(at::equal(p.value(), sb[p.key()])) << p.key();
  EXPECT_FALSE(at::equal(sa["model.layers.0.mlp.up_proj.weight"],
                         other_seed->named_parameters()["model.layers.0.mlp.up_proj.weight"]));
  // Construction order: a lone Linear initialized under the same full name gets the same values.
  InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  at::Tensor lone = init_value("model.layers.2.self_attn.k_proj.weight", {16, 32}, io);
  EXPECT_TRUE(at::equal(lone, sa["model.layers.2.self_attn.k_proj.weight"]));
  // Layout: a pipeline stage built and initialized alone, and a column shard, get the same values.
  CausalLM stage(c, at::TensorOptions().device(at::kMeta));
  stage.keep_blocks(2, 4);
  init_parameters(stage, io);
  EXPECT_TRUE(at::equal(stage.named_parameters()["model.layers.1.mlp.down_proj.weight"],
                        sa["model.layers.1.mlp.down_proj.weight"]));
  CausalLM sharded(c, at::TensorOptions().device(at::kMeta));
  sharded.model->layers->layers[0]->dense_mlp().up_proj->shard({ShardSpec::Kind::Column, 1, 2});
  init_parameters(sharded, io);
  EXPECT_TRUE(at::equal(sharded.named_parameters()["model.layers.0.mlp.up_proj.weight"],
                        sa["model.layers.0.mlp.up_proj.weight"].narrow(0, 24, 24)));
  // HF's distribution: normal(0, std) weights, ones for norms, zero biases.
  EXPECT_TRUE(at::equal(sa["model.norm.weight"], at::ones({32})));
  at::Tensor w = init_value("x.weight", {256, 256}, io);
  EXPECT_NEAR(w.std().item<double>(), 0.2, 0.005);
  EXPECT_NEAR(w.mean().item<double>(), 0.0, 0.005);
}

TEST(Meta, Preset70bCountsWithoutAllocating) {
  ModelConfig c = ModelConfig::preset("70b");
  CausalLM m(c, at::TensorOptions().device(at::kMeta));
  EXPECT_TRUE(has_meta_parameters(m));
  for (const auto& p : m.parameters()) ASSERT_TRUE(p.is_meta());
  const int64_t h = 8192, f = 28672, kv = 1024, v = 32000, L = 80;
  const int64_t per_layer = h * h * 2 + h * kv * 2 + 3 * h * f + 2 * h;
  EXPECT_EQ(count_parameters(m), 2 * v * h + L * per_layer + h);
  EXPECT_EQ(count_parameters(m), 68976648192LL);  // Llama-2-70B
  EXPECT_EQ(
      count_parameters(CausalLM(ModelConfig::preset("1b"), at::TensorOptions().device(at::kMeta))),
      1100048384LL);  // TinyLlama-1.1B
  EXPECT_EQ(
      count_parameters(CausalLM(ModelConfig::preset("7b"), at::TensorOptions().device(at::kMeta))),
      6738415616LL);  // Llama-2-7B
  // Materialize a small meta model: afterwards it equals an eagerly initialized one.
  ModelConfig sc = small_config();
  CausalLM lazy(sc, at::TensorOptions().device(at::kMeta));
  InitOptions io;
  io.seed = 1;
  io.std = 0.2;
  init_parameters(lazy, io);
  EXPECT_FALSE(has_meta_parameters(lazy));
  auto eager = make_model(sc, 1);
  at::NoGradGuard ng;
  at::Tensor ids = at::randint(0, 96, {1, 6}, at::kLong);
  EXPECT_TRUE(at::equal(lazy.forward(ids), eager->forward(ids)));
  EXPECT_THROW(ModelConfig::preset("3b"), InputError);
}

TEST(Blocks, StagesKeepNamesAndComposeToTheWholeModel) {
  ModelConfig c = small_config();
  auto full = make_model(c, 3);
  auto blocks = full->blocks();
  ASSERT_EQ(blocks.size(), 6u);
  EXPECT_EQ(blocks[0].name, "model.embed_tokens");
  EXPECT_EQ(blocks[2].name, "model.layers.1");
  EXPECT_EQ(blocks[4].name, "model.norm");
  EXPECT_EQ(blocks[5].name, "lm_head");
  auto s0 = make_model(c, 3);
  auto s1 = make_model(c, 3);
  s0->keep_blocks(0, 3);
  s1->keep_blocks(3, 6);
  EXPECT_EQ(s1->blocks().front().name, "model.layers.2");
  std::vector<std::string> n0, n1;
  for (const auto& p : s0->named_parameters()) n0.push_back(p.key());
  for (const auto& p : s1->named_parameters()) n1.push_back(p.key());
  EXPECT_EQ(n0.front(), "model.embed_tokens.weight");
  EXPECT_EQ(n0.back(), "model.layers.1.post_attention_layernorm.weight");
  EXPECT_EQ(n1.front(), "model.layers.2.self_attn.q_proj.weight");
  EXPECT_EQ(n1.back(), "lm_head.weight");
  EXPECT_EQ(n0.size() + n1.size(), full->named_parameters().size());
  at::NoGradGuard ng;
  at::Tensor ids = at::randint(0, 96, {2, 5}, at::kLong);
  at::Tensor hidden = s0->forward(ids);
  EXPECT_EQ(hidden.sizes(), (std::vector<int64_t>{2, 5, 32}));
  EXPECT_TRUE(at::equal(s1->forward(hidden), full->forward(ids)));
  EXPECT_THROW(s1->keep_blocks(0, 6), Error);
  ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  CausalLM t(tied, at::TensorOptions().device(at::kMeta));
  // A tied head's stage keeps the embedding as its weight, not as a block.
  t.keep_blocks(3, 6);
  EXPECT_TRUE(t.holds_tied_copy());
  EXPECT_FALSE(t.owns_block(0));
  EXPECT_TRUE(t.named_parameters().contains("model.embed_tokens.weight"));
}

TEST(KVCache, IncrementalDecodingMatchesFullForward) {
  for (bool sliding : {false, true}) {
    ModelConfig c = small_config();
    c.model_type = "mistral";
    if (sliding) {
      c.sliding_window = 4;
      c.layer_sliding.assign(3, true);
    }
    auto m = make_model(c, 9);
    at::NoGradGuard ng;
    at::Tensor prompt = at::randint(0, 96, {2, 5}, at::kLong);
    at::Tensor gen = generate_greedy(*m, prompt, 6);
    ASSERT_EQ(gen.sizes(), (std::vector<int64_t>{2, 6}));
    // Without a cache: recompute the whole sequence each step.
    at::Tensor seq = prompt;
    for (int64_t t = 0; t < 6; ++t) {
      at::Tensor logits = m->forward(seq);
      at::Tensor next = logits.select(1, seq.size(1) - 1).argmax(-1);
      EXPECT_TRUE(at::equal(next, gen.select(1, t))) << "step " << t << " sliding " << sliding;
      seq = at::cat({seq, next.unsqueeze(1)}, 1);
    }
    // A cached prefill of 3 then a chunk of 4 equals one forward of 7 (explicit mask path).
    KVCache cache(3);
    ForwardOptions fo;
    fo.cache = &cache;
    m->forward(seq.narrow(1, 0, 3), fo);
    at::Tensor chunk = m->forward(seq.narrow(1, 3, 4), fo);
    EXPECT_LT(max_rel(chunk, m->forward(seq.narrow(1, 0, 7)).narrow(1, 3, 4)), 1e-5);
  }
}

TEST(Config, RejectsWhatWeDoNotImplement) {
  auto parse = [](const std::string& s) { return ModelConfig::from_json(json::parse(s)); };
  EXPECT_THROW(parse(R"({"model_type": "gpt2"})"), InputError);
  EXPECT_THROW(parse(R"({"model_type": "llama", "hidden_act": "gelu"})"), InputError);
  EXPECT_THROW(
      parse(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})"),
      InputError);
  EXPECT_THROW(parse(R"({"model_type": "llama", "rope_scaling": {"type": "linear"}})"), InputError);
  try {
    parse(R"({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("longrope"), std::string::npos);
  }
  // Old-style rope_theta + rope_scaling and new-style rope_parameters agree.
  ModelConfig a = parse(R"({"model_type": "llama", "rope_theta": 500000.0,
      "rope_scaling": {"type": "linear", "factor": 4.0}})");
  ModelConfig b = parse(R"({"model_type": "llama",
      "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}})");
  EXPECT_EQ(a.rope.type, "linear");
  EXPECT_EQ(a.rope.theta, 500000.0);
  EXPECT_EQ(b.rope.factor, 4.0);
  EXPECT_TRUE(at::equal(rope_inv_freq(a), rope_inv_freq(b)));
  // Round trip through to_json.
  ModelConfig q =
      parse(R"({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": true,
      "sliding_window": 16, "max_window_layers": 2, "hidden_size": 64, "num_attention_heads": 4})");
  EXPECT_EQ(q.layer_sliding, (std::vector<bool>{false, false, true, true}));
  EXPECT_TRUE(q.qkv_bias);
  ModelConfig q2 = ModelConfig::from_json(q.to_json());
  EXPECT_EQ(q2.layer_sliding, q.layer_sliding);
  EXPECT_EQ(q2.sliding_window, q.sliding_window);
}

// Impossible sizes and constants in a config.json are InputErrors naming the field (a negative
// layer count was a raw std::vector length error; eps or theta of 0 trained NaN), and
// from_file names the file.
TEST(Config, ImpossibleValuesNameTheField) {
  auto error_of = [](const std::string& fields) -> std::string {
    try {
      ModelConfig::from_json(json::parse(R"({"model_type": "llama", )" + fields + "}"));
    } catch (const InputError& e) {
      return e.what();
    }
    return "(no error)";
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("num_hidden_layers": -1)", "num_hidden_layers must be positive, got -1"},
      {R"("num_hidden_layers": 0)", "num_hidden_layers must be positive, got 0"},
      {R"("hidden_size": 0)", "hidden_size must be positive, got 0"},
      {R"("hidden_size": -64)", "hidden_size must be positive, got -64"},
      {R"("num_attention_heads": 0)", "num_attention_heads must be positive, got 0"},
      {R"("num_key_value_heads": -2)", "num_key_value_heads must be positive, got -2"},
      {R"("intermediate_size": 0)", "intermediate_size must be positive, got 0"},
      {R"("vocab_size": 0)", "vocab_size must be positive, got 0"},
      {R"("max_position_embeddings": 0)", "max_position_embeddings must be positive, got 0"},
      {R"("hidden_size": 100, "num_attention_heads": 32)",
       "hidden_size (100) must be a multiple of num_attention_heads (32)"},
      {R"("num_attention_heads": 32, "num_key_value_heads": 5)",
       "num_attention_heads (32) must be a multiple of num_key_value_heads (5)"},
      {R"("rms_norm_eps": 0)", "rms_norm_eps must be a positive finite number, got 0"},
      {R"("rms_norm_eps": -1e-6)", "rms_norm_eps must be a positive finite number"},
      {R"("rope_theta": 0)", "rope_theta must be a positive finite number, got 0"},
      {R"("rope_parameters": {"rope_type": "default", "rope_theta": -5.0})",
       "rope_theta must be a positive finite number, got -5"},
      {R"("rope_scaling": {"type": "linear", "factor": 0.0})",
       "rope factor must be a positive finite number, got 0"},
      {R"("hidden_size": 4000000000, "num_attention_heads": 1, "head_dim": 128,
          "intermediate_size": 4000000000, "vocab_size": 4000000000)",
       "parameter count overflows"},
  };
  for (const auto& [fields, needle] : cases) {
    const std::string msg = error_of(fields);
    EXPECT_NE(msg.find(needle), std::string::npos) << fields << " -> " << msg;
  }
  EXPECT_EQ(error_of(R"("hidden_size": 96, "num_attention_heads": 4, "head_dim": 32)"),
            "(no error)");  // an explicit head_dim need not divide hidden_size
  // from_file names the file; a folder is an error of its own.
  tests::TempDir tmp;
  const std::string dir = tmp.path().string();
  const std::string path = tmp.file("config.json");
  {
    std::ofstream f(path);
    f << R"({"model_type": "llama", "num_hidden_layers": -1})";
  }
  try {
    ModelConfig::from_file(path);
    ADD_FAILURE() << "num_hidden_layers -1 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": num_hidden_layers must be positive, got -1"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ModelConfig::from_file(dir), InputError);
}

// parameter_count matches the built model's, and a model larger than memory is refused with
// the byte count before anything is allocated.
TEST(Config, ParameterCountAndMemoryCheck) {
  for (const char* name : {"tiny", "1b", "7b", "70b"}) {
    ModelConfig c = ModelConfig::preset(name);
    EXPECT_EQ(parameter_count(c),
              count_parameters(CausalLM(c, at::TensorOptions().device(at::kMeta))))
        << name;
  }
  ModelConfig biased = small_config();
  biased.qkv_bias = biased.o_bias = biased.mlp_bias = true;
  biased.tie_word_embeddings = true;
  EXPECT_EQ(parameter_count(biased),
            count_parameters(CausalLM(biased, at::TensorOptions().device(at::kMeta))));
  EXPECT_NO_THROW(check_fits_memory(small_config(), at::Device(at::kCPU), 4, "tiny"));
  ModelConfig huge = ModelConfig::preset("tiny");
  huge.hidden_size = 10000000;
  huge.num_attention_heads = 10;
  huge.num_key_value_heads = 10;
  huge.head_dim = 1000000;
  try {
    check_fits_memory(huge, at::Device(at::kCPU), 4, "model huge.json");
    ADD_FAILURE() << "a model of " << parameter_count(huge) << " parameters fit";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(
        msg.find("model huge.json: " + std::to_string(parameter_count(huge)) + " parameters need "),
        std::string::npos)
        << msg;
    EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
  }
}
