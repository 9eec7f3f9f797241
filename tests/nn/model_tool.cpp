// Test driver for the HF parity tests (test_hf_parity.py):
//   model_tool run  MODEL_DIR INPUTS.safetensors OUT.safetensors
//       inputs: input_ids [B,S] int64, labels [B,S] int64, optional attention_mask [B,S];
//       writes logits, loss and grad.<param name> (fp32) to OUT.
//   model_tool resave MODEL_DIR OUT_DIR SHARD_MB     load_pretrained + save_pretrained
//   model_tool init CONFIG.json OUT_DIR SEED           our name-keyed init, then save_pretrained
#include <ATen/ATen.h>

#include <cstdio>
#include <string>

#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"

using namespace colossal;

static int run(const std::string& dir, const std::string& in, const std::string& out) {
  auto model = checkpoint::load_pretrained(dir);
  at::Tensor ids, labels, mask;
  for (auto& [n, t] : checkpoint::load_safetensors(in)) {
    if (n == "input_ids") ids = t.clone();
    if (n == "labels") labels = t.clone();
    if (n == "attention_mask") mask = t.clone();
  }
  COLOSSAL_CHECK(ids.defined() && labels.defined(), "inputs need input_ids and labels");
  models::ForwardOptions fo;
  fo.attention_mask = mask;
  at::Tensor logits = model->forward(ids, fo);
  at::Tensor loss = models::causal_lm_loss(logits, labels);
  loss.backward();
  checkpoint::TensorList res{{"logits", logits.detach()}, {"loss", loss.detach().reshape({1})}};
  for (const auto& p : model->named_parameters()) {
    COLOSSAL_CHECK(p.value().grad().defined(), "no gradient for ", p.key());
    res.emplace_back("grad." + p.key(), p.value().grad());
  }
  checkpoint::save_safetensors(out, res);
  return 0;
}

int main(int argc, char** argv) {
  try {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "run" && argc == 5) return run(argv[2], argv[3], argv[4]);
    if (mode == "resave" && argc == 5) {
      auto model = checkpoint::load_pretrained(argv[2]);
      checkpoint::SaveOptions so;
      so.size_per_shard_mb = std::stoll(argv[4]);
      checkpoint::save_pretrained(*model, argv[3], so);
      return 0;
    }
    if (mode == "init" && argc == 5) {
      models::ModelConfig cfg = models::ModelConfig::from_file(argv[2]);
      models::CausalLM model(cfg, at::TensorOptions().device(at::kMeta));
      nn::InitOptions io;
      io.seed = std::stoull(argv[4]);
      io.std = cfg.initializer_range;
      nn::init_parameters(model, io);
      checkpoint::save_pretrained(model, argv[3]);
      return 0;
    }
    std::fprintf(
        stderr,
        "usage: model_tool run DIR IN OUT | resave DIR OUT SHARD_MB | init CONFIG OUT SEED\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_tool: %s\n", e.what());
    return 1;
  }
}
