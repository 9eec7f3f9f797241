// Test driver for the PEFT parity tests (test_lora_peft.py):
//   lora_tool run MODEL_DIR ADAPTER_DIR INPUTS.safetensors OUT.safetensors
//       inputs: input_ids [B,S], labels [B,S] int64; the HF model with the PEFT adapter applied:
//       writes logits, loss, grad.<PEFT tensor name> of every adapter tensor (fp32), and
//       frozen_with_grad (how many other parameters got a gradient: must be 0).
//   lora_tool resave MODEL_DIR ADAPTER_DIR OUT_DIR       load_lora_adapter + save_lora_adapter
//   lora_tool init MODEL_DIR OUT_DIR R ALPHA TARGETS SEED  apply_lora (our init) + save
// InputError: exit 2 with the message; any other error: exit 1.
#include <ATen/ATen.h>

#include <cstdio>
#include <sstream>
#include <string>

#include "colossal/checkpoint/lora.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/lora.h"

using namespace colossal;

static int run(const std::string& dir, const std::string& adapter, const std::string& in,
               const std::string& out) {
  auto model = checkpoint::load_pretrained(dir);
  checkpoint::load_lora_adapter(*model, adapter);
  at::Tensor ids, labels;
  for (auto& [n, t] : checkpoint::load_safetensors(in)) {
    if (n == "input_ids") ids = t.clone();
    if (n == "labels") labels = t.clone();
  }
  COLOSSAL_CHECK(ids.defined() && labels.defined(), "inputs need input_ids and labels");
  at::Tensor logits = model->forward(ids);
  at::Tensor loss = models::causal_lm_loss(logits, labels);
  loss.backward();
  checkpoint::TensorList res{{"logits", logits.detach()}, {"loss", loss.detach().reshape({1})}};
  int64_t frozen_with_grad = 0;
  for (const auto& p : model->named_parameters()) {
    const bool lora = p.key().find(".lora_") != std::string::npos;
    if (lora) {
      COLOSSAL_CHECK(p.value().grad().defined(), "no gradient for ", p.key());
      res.emplace_back("grad.base_model.model." + p.key(), p.value().grad());
    } else if (p.value().grad().defined() || p.value().requires_grad()) {
      ++frozen_with_grad;
    }
  }
  res.emplace_back("frozen_with_grad", at::full({1}, frozen_with_grad, at::kLong));
  checkpoint::save_safetensors(out, res);
  return 0;
}

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "run" && argc == 6) return run(argv[2], argv[3], argv[4], argv[5]);
    if (mode == "resave" && argc == 5) {
      auto model = checkpoint::load_pretrained(argv[2]);
      nn::LoraConfig cfg = checkpoint::load_lora_adapter(*model, argv[3]);
      checkpoint::save_lora_adapter(*model, cfg, argv[4], argv[2]);
      return 0;
    }
    if (mode == "init" && argc == 8) {
      auto model = checkpoint::load_pretrained(argv[2]);
      nn::LoraConfig cfg;
      cfg.r = std::stoll(argv[4]);
      cfg.lora_alpha = std::stod(argv[5]);
      std::stringstream ss(argv[6]);
      for (std::string t; std::getline(ss, t, ',');) cfg.target_modules.push_back(t);
      nn::apply_lora(*model, cfg, std::stoull(argv[7]));
      checkpoint::save_lora_adapter(*model, cfg, argv[3], argv[2]);
      return 0;
    }
    std::fprintf(stderr,
                 "usage: lora_tool run MODEL ADAPTER IN OUT | resave MODEL ADAPTER OUT | init "
                 "MODEL OUT R ALPHA TARGETS SEED\n");
    return 2;
  } catch (const InputError& e) {
    std::fprintf(stderr, "lora_tool: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lora_tool: %s\n", e.what());
    return 1;
  }
}
