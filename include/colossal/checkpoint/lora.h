// LoRA adapters in PEFT's folder format: adapter_config.json (peft_type "LORA", r, lora_alpha,
// lora_dropout, target_modules, bias, use_rslora, ...) and adapter_model.safetensors with PEFT's
// tensor names ("base_model.model.<module path>.lora_A.weight" / ".lora_B.weight"), so that
// Python's `peft.PeftModel.from_pretrained(hf_model, dir)` loads what we save and we load what
// it saves.
#pragma once

#include <string>
#include <vector>

#include "colossal/checkpoint/safetensors.h"
#include "colossal/nn/lora.h"

namespace colossal::checkpoint {

// The adapters of `root` (every LoraLinear) and `cfg` into `dir` (created; both files written
// atomically). `base_model` goes to base_model_name_or_path. InputError when root has no adapter.
void save_lora_adapter(torch::nn::Module& root, const nn::LoraConfig& cfg, const std::string& dir,
                       const std::string& base_model = "");
// The same from tensors under our parameter names ("<path>.lora_A.weight", ...), e.g. read back
// from a training checkpoint's model folder, which every plugin writes whole however it holds
// the parameters (Gemini's chunks, ZeRO shards). InputError when there is none.
void save_lora_adapter(const TensorList& named, const nn::LoraConfig& cfg, const std::string& dir,
                       const std::string& base_model = "");

// adapter_config.json of `dir` as our config. InputError naming the file and field for what we
// do not implement rather than ignore it: another peft_type, DoRA, fan_in_fan_out, per-layer
// rank/alpha patterns, layers_to_transform, modules_to_save, a regex target_modules, bias other
// than "none".
nn::LoraConfig read_lora_config(const std::string& dir);

// Applies the adapter of `dir` to `root` (nn::apply_lora with its config) and loads its tensors
// strictly: a missing, unexpected or mis-shaped tensor is an InputError naming it. Returns the
// config.
nn::LoraConfig load_lora_adapter(torch::nn::Module& root, const std::string& dir);

}  // namespace colossal::checkpoint
