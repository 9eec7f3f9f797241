// `colossal lora merge`: a Hugging Face model folder plus a PEFT LoRA adapter folder -> one HF
// model folder with the adapters folded into the weights (nn::merge_lora), loadable by
// transformers' from_pretrained like any other checkpoint.
#include <cstdio>
#include <string>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/checkpoint/lora.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/lora.h"

namespace colossal::cli {
namespace {

int run_lora(int argc, char** argv) {
  Args args("lora", "LoRA adapters: `merge` folds a PEFT adapter into its base model");
  args.option("model", "the base model: a Hugging Face model folder", "", true)
      .option("adapter",
              "the PEFT adapter folder (adapter_config.json + adapter_model.safetensors)", "", true)
      .option("out", "the merged Hugging Face model folder to write", "", true)
      .option("dtype", "dtype of the merged weights: fp32 | bf16 | fp16", "fp32");
  // The action comes first (`colossal lora merge --model ...`); the options parse after it.
  const std::string action = argc > 1 ? argv[1] : "";
  if (action == "--help" || action == "-h") {
    args.parse(argc, argv);
    return 0;
  }
  COLOSSAL_CHECK_INPUT(action == "merge", "colossal lora: unknown action '", action,
                       "'; usage: colossal lora merge --model BASE --adapter ADAPTER --out DIR");
  args.parse(argc - 1, argv + 1);
  const std::string dtype = args.str("dtype");
  COLOSSAL_CHECK_INPUT(dtype == "fp32" || dtype == "bf16" || dtype == "fp16",
                       "--dtype must be fp32, bf16 or fp16, got '", dtype, "'");
  checkpoint::PretrainedOptions po;
  po.dtype = dtype == "bf16" ? at::kBFloat16 : dtype == "fp16" ? at::kHalf : at::kFloat;
  po.skip_lora_tensors = true;  // a LoRA run's checkpoint folder is a valid base too
  auto model = checkpoint::load_pretrained(args.str("model"), po);
  const nn::LoraConfig cfg = checkpoint::load_lora_adapter(*model, args.str("adapter"));
  const auto merged = nn::merge_lora(*model);
  checkpoint::save_pretrained(*model, args.str("out"));
  log_info("merged ", merged.size(), " adapters (r ", cfg.r, ", scaling ", cfg.scaling(), ") into ",
           args.str("out"));
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("lora", "LoRA adapters: merge a PEFT adapter into its base model", run_lora);

}  // namespace colossal::cli
