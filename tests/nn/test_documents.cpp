// Packed documents (--doc_mask) and masked targets on the CPU: the data side (targets, positions,
// document ids and counted targets of TokenDataset with a document index and a loss mask, and
// their files' validation) and the model side: a packed row with document_ids and restarting
// position_ids gives the logits, loss and parameter gradients of each document run on its own
// (the masked composite: SDPA with the dense document-causal mask), with and without a sliding
// window; forward_loss's divisor. The variable-length CUDA kernel is checked against the same
// separate runs in tests/kernels/test_model_cuda.cpp.
//
// Tolerances: fp32 on the CPU. Packed and separate runs compute the same sums over the same keys
// (masked keys add exp(-inf) = 0 exactly) but SDPA's blocking and the GEMMs' row counts differ,
// so results agree to float rounding: 1e-5 relative to the largest magnitude.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/data/documents.h"
#include "colossal/data/token_file.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/init.h"
#include "common/document_files.h"
#include "common/tiny_llama.h"

using namespace colossal;
using namespace colossal::models;

namespace {

std::string temp_path(const std::string& name) {
  return str(::testing::TempDir(), "/docs_", ::getpid(), "_", name);
}

void write_index(const std::string& path, const std::vector<uint64_t>& off) {
  tests::write_doc_index(path, off);
}

void write_mask(const std::string& path, const std::vector<uint8_t>& m, int32_t packed = 0) {
  tests::write_loss_mask(path, m, packed);
}

ModelConfig small_config(bool sliding) {
  ModelConfig c = tests::tiny_llama();
  c.layer_sliding.assign(2, sliding);
  if (sliding) c.sliding_window = 3;
  return c;
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& c) {
  auto m = std::make_shared<CausalLM>(c);
  nn::InitOptions io;
  io.seed = 5;
  io.std = 0.2;
  nn::init_parameters(*m, io);
  return m;
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-12);
}

}  // namespace

TEST(DocumentData, TargetsPositionsAndCounts) {
  // 25 tokens, documents [0,4) [4,4) (empty) [4,11) [11,25); S = 6: samples 0..3.
  std::vector<int64_t> tokens(25);
  for (int i = 0; i < 25; ++i) tokens[i] = 10 + i;
  const std::string tok = temp_path("a.bin");
  data::write_token_file(tok, tokens, data::TokenFormat::LlmcGpt2);
  write_index(tok + ".docs", {0, 4, 4, 11, 25});
  std::vector<uint8_t> mask(25, 1);
  for (int i : {0, 1, 4, 5, 6, 11, 12}) mask[i] = 0;  // prompts
  write_mask(tok + ".mask", mask);

  auto file = std::make_shared<data::TokenFile>(tok);
  data::TokenDataset ds(file, 6);
  ds.set_loss_mask(std::make_shared<data::LossMaskFile>(tok + ".mask"));
  ds.set_documents(data::read_doc_index(tok + ".docs"), tok + ".docs");
  ds.set_document_mask(true);
  for (int64_t k = 0; k < ds.num_samples(); ++k) {
    data::Batch b = ds.make_batch({k});
    const int64_t base = k * 6;
    int64_t counted = 0, doc = 0, pos = 0;
    for (int64_t j = 0; j < 6; ++j) {
      const int64_t t = base + j + 1;  // target token
      const bool starts = t == 4 || t == 11;
      const bool counts = mask[t] && !starts;
      EXPECT_EQ(b.targets[0][j].item<int64_t>(), counts ? tokens[t] : -100) << k << " " << j;
      counted += counts;
      const int64_t here = base + j;
      if (j > 0 && (here == 4 || here == 11)) ++doc, pos = 0;
      EXPECT_EQ(b.position_ids[0][j].item<int64_t>(), pos++) << k << " " << j;
      EXPECT_EQ(b.document_ids[0][j].item<int64_t>(), doc) << k << " " << j;
      EXPECT_EQ(b.inputs[0][j].item<int64_t>(), tokens[here]);
    }
    EXPECT_EQ(ds.counted_targets(k), counted) << k;
  }
  // The mask alone (no document mask): only the mask's zeros are ignored.
  data::TokenDataset plain(file, 6);
  plain.set_loss_mask(std::make_shared<data::LossMaskFile>(tok + ".mask"));
  data::Batch b = plain.make_batch({0, 1});
  EXPECT_FALSE(b.document_ids.defined());
  EXPECT_EQ(b.targets[1][3].item<int64_t>(), tokens[10]);  // token 10: mask 1
  EXPECT_EQ(b.targets[0][0].item<int64_t>(), -100);        // token 1: mask 0
  EXPECT_EQ(plain.counted_targets(0), 2);                  // tokens 1..6: 1, 4, 5, 6 masked
}

TEST(DocumentData, BadFilesAreNamedErrors) {
  std::vector<int64_t> tokens(20, 3);
  const std::string tok = temp_path("b.bin");
  data::write_token_file(tok, tokens, data::TokenFormat::LlmcGpt2);
  auto file = std::make_shared<data::TokenFile>(tok);
  data::TokenDataset ds(file, 4);
  auto expect_input_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      FAIL() << "no error; expected one mentioning " << needle;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string m = tok + ".mask";
  write_mask(m, std::vector<uint8_t>(19, 1));
  expect_input_error([&] { ds.set_loss_mask(std::make_shared<data::LossMaskFile>(m)); },
                     "covers 19 tokens");
  write_mask(m, std::vector<uint8_t>(20, 1), 8);
  expect_input_error([&] { ds.set_loss_mask(std::make_shared<data::LossMaskFile>(m)); },
                     "packed for seq_len 8");
  std::vector<uint8_t> two(20, 1);
  two[7] = 2;
  write_mask(m, two);
  expect_input_error([&] { data::LossMaskFile f(m); }, "byte 2 at token 7");
  const std::vector<uint8_t> five(5, 1);
  tests::write_document_file(m, tests::document_file_header(data::kLossMaskMagic, 20), five.data(),
                             five.size());
  expect_input_error([&] { data::LossMaskFile f(m); }, "holds 5 mask bytes");
  tests::write_document_file(m, std::vector<int32_t>(25, 0), nullptr, 0);
  expect_input_error([&] { data::LossMaskFile f(m); }, "shorter than its header");
  const std::string d = tok + ".docs";
  write_index(d, {0, 5, 19});
  expect_input_error([&] { ds.set_documents(data::read_doc_index(d), d); }, "ends at token 19");
  write_index(d, {0, 9, 5, 20});
  expect_input_error([&] { data::read_doc_index(d); }, "offsets decrease");
  expect_input_error([&] { ds.set_document_mask(true); }, "needs the document index");
}

// A packed batch of two rows (row 0: documents of 5, 1, 6 tokens; row 1: 12 tokens, one
// document) against each document run alone: logits, the summed loss and every gradient.
void check_packed_equals_separate(bool sliding) {
  const ModelConfig c = small_config(sliding);
  auto model = make_model(c);
  at::manual_seed(3);
  const int64_t S = 12;
  at::Tensor ids = at::randint(0, c.vocab_size, {2, S}, at::kLong);
  at::Tensor targets = at::randint(0, c.vocab_size, {2, S}, at::kLong);
  targets[0][2] = -100;  // a masked target inside a document
  const std::vector<std::vector<int64_t>> lens{{5, 1, 6}, {12}};
  at::Tensor doc = at::empty({2, S}, at::kLong), pos = at::empty({2, S}, at::kLong);
  for (int64_t r = 0; r < 2; ++r) {
    int64_t j = 0;
    for (size_t d = 0; d < lens[r].size(); ++d) {
      for (int64_t i = 0; i < lens[r][d]; ++i, ++j) {
        doc[r][j] = static_cast<int64_t>(d);
        pos[r][j] = i;
      }
    }
  }
  ForwardOptions fo;
  fo.document_ids = doc;
  fo.position_ids = pos;
  at::Tensor packed_logits = model->forward(ids, fo);
  fo.loss_divisor = 7.0;
  model->zero_grad();
  at::Tensor packed_loss = model->forward_loss(ids, targets, 4, fo);
  packed_loss.backward();
  std::vector<at::Tensor> packed_grads;
  for (auto& p : model->parameters()) packed_grads.push_back(p.grad().clone());

  model->zero_grad();
  at::Tensor sum = at::zeros({}, at::kFloat);
  for (int64_t r = 0; r < 2; ++r) {
    int64_t j = 0;
    for (int64_t len : lens[r]) {
      at::Tensor in = ids[r].narrow(0, j, len).unsqueeze(0);
      at::Tensor alone = model->forward(in);
      EXPECT_LE(max_rel(packed_logits[r].narrow(0, j, len), alone[0]), 1e-5)
          << "row " << r << " document at " << j;
      at::Tensor t = targets[r].narrow(0, j, len).unsqueeze(0);
      ForwardOptions so;
      so.loss_divisor = 1.0;  // the sum
      sum = sum + model->forward_loss(in, t, 4, so);
      j += len;
    }
  }
  at::Tensor separate_loss = sum / 7.0;
  separate_loss.backward();
  EXPECT_LE(max_rel(packed_loss, separate_loss), 1e-5);
  size_t i = 0;
  for (auto& p : model->parameters()) EXPECT_LE(max_rel(packed_grads[i++], p.grad()), 1e-5);
}

TEST(DocumentModel, PackedRowsEqualSeparateDocuments) {
  check_packed_equals_separate(false);
}

TEST(DocumentModel, PackedRowsEqualSeparateDocumentsUnderASlidingWindow) {
  check_packed_equals_separate(true);
}

TEST(DocumentModel, MaskLayoutAndArguments) {
  // Row 0: documents of 2 and 2 tokens; row 1: 1 and 3 (a new row starts a new document).
  at::Tensor doc = at::tensor(std::vector<int64_t>{0, 0, 1, 1, 1, 0, 0, 0}, at::kLong).view({2, 4});
  nn::DocumentMask d = nn::make_documents(doc, at::kCPU);
  EXPECT_TRUE(at::equal(d.cu_seqlens, at::tensor(std::vector<int32_t>{0, 2, 4, 5, 8}, at::kInt)));
  EXPECT_EQ(d.max_len, 3);
  at::Tensor dense = nn::document_causal_mask(doc);
  EXPECT_TRUE(dense[0][0][3][2].item<bool>());
  EXPECT_FALSE(dense[0][0][2][1].item<bool>());  // across documents
  EXPECT_FALSE(dense[0][0][2][3].item<bool>());  // the future
  const ModelConfig c = small_config(false);
  auto model = make_model(c);
  ForwardOptions fo;
  fo.document_ids = at::zeros({2, 3}, at::kLong);
  EXPECT_THROW(model->forward(at::zeros({2, 4}, at::kLong), fo), InputError);
  fo.document_ids = at::zeros({2, 4}, at::kLong);
  fo.attention_mask = at::ones({2, 4}, at::kLong);
  EXPECT_THROW(model->forward(at::zeros({2, 4}, at::kLong), fo), InputError);
}

// --attn_backend own: the dispatcher's rules (each reason named, structural ones first so they
// show on the CPU too), and a model whose core-attention slots hold OwnAttention gives on the
// CPU exactly the SDPA model's logits (every call handed to SDPA, each counted). The kernels
// themselves: tests/kernels/test_attention_cuda.cpp and the model test in test_model_cuda.cpp.
TEST(OwnAttention, FallbackRulesNameTheirReason) {
  at::Tensor q = at::randn({1, 4, 8, 64}), k = at::randn({1, 2, 8, 64});
  nn::AttentionMask mask;
  nn::SequenceInfo seq;
  seq.local_len = seq.global_len = 8;
  const std::string kernel_reason = nn::own_attention_fallback(q, k, mask, seq);
  EXPECT_FALSE(kernel_reason.empty());  // the CPU (or a build without the kernels)
  nn::SequenceInfo cached = seq;
  cached.past = 3;
  EXPECT_NE(nn::own_attention_fallback(q, k, mask, cached).find("KV cache"), std::string::npos);
  nn::SequenceInfo shard = seq;
  shard.global_len = 16;
  EXPECT_NE(nn::own_attention_fallback(q, k, mask, shard).find("sequence shard"),
            std::string::npos);
  EXPECT_NE(
      nn::own_attention_fallback(q, at::randn({1, 2, 5, 64}), mask, seq).find("another length"),
      std::string::npos);
  nn::AttentionMask explicit_mask;
  explicit_mask.mask = at::ones({1, 1, 8, 8}, at::kBool);
  EXPECT_NE(nn::own_attention_fallback(q, k, explicit_mask, seq).find("explicit attention mask"),
            std::string::npos);
}

TEST(OwnAttention, OnTheCpuEveryCallGoesToSdpaUnchanged) {
  const ModelConfig c = small_config(false);
  auto model = make_model(c);
  at::manual_seed(4);
  at::Tensor ids = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
  at::Tensor sdpa = model->forward(ids);
  const auto [own, slots] = nn::use_own_attention(*model, false);
  EXPECT_EQ(slots, c.num_hidden_layers);
  at::Tensor mine = model->forward(ids);
  EXPECT_TRUE(at::equal(mine, sdpa));
  EXPECT_EQ(own->own_calls(), 0);
  EXPECT_EQ(own->fallback_calls(), c.num_hidden_layers);
  EXPECT_FALSE(own->fallback_reason().empty());
  // Packed documents too (the dense document-causal mask on the CPU).
  ForwardOptions fo;
  fo.document_ids = at::tensor(std::vector<int64_t>{0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2}, at::kLong)
                        .view({1, 12})
                        .expand({2, 12})
                        .contiguous();
  EXPECT_NO_THROW(model->forward(ids, fo));
}
