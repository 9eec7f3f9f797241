// A Hugging Face model folder <-> a colossal::models::CausalLM: config.json plus safetensors
// weights in HF names (one file or index + shards). What save_pretrained writes loads with
// transformers.AutoModelForCausalLM.from_pretrained, and the other way round.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "colossal/checkpoint/hf.h"
#include "colossal/nn/quantized_linear.h"

namespace colossal::models {
class CausalLM;
}

namespace colossal::checkpoint {

struct PretrainedOptions {
  std::optional<at::Device> device;     // default CPU
  std::optional<at::ScalarType> dtype;  // default fp32
  // Ignore LoRA adapter tensors ("*.lora_A.*", "*.lora_B.*") in the folder: the base of a LoRA
  // run's checkpoint (its adapters come from an adapter folder).
  bool skip_lora_tensors = false;
  // QLoRA: every linear layer but lm_head (and quantize->skip_modules) becomes an
  // nn::QuantizedLinear whose weight is quantized as it is read, tensor by tensor on
  // quantize_device (default: device), so the full-precision model never exists in memory: the
  // checkpoint is mapped, and each tensor's pages are given back once it is placed.
  std::optional<nn::QuantizeConfig> quantize;
  std::optional<at::Device> quantize_device;
};

// Builds the model from DIR/config.json and loads its weights strictly (a missing, unexpected
// or mis-shaped tensor is an InputError naming it). A tied model's redundant lm_head.weight in
// the checkpoint is accepted and ignored, as transformers does.
std::shared_ptr<models::CausalLM> load_pretrained(const std::string& dir,
                                                  const PretrainedOptions& opts = {});

// Writes DIR/config.json (dtype taken from the parameters) and the weights.
void save_pretrained(const models::CausalLM& model, const std::string& dir,
                     const SaveOptions& opts = {});
// The same with the weights produced one at a time (save_state_dict_streamed): `produce(i)`
// returns tensor i of module_state(model), called in plan_state_dict's order; the model's
// tensors give only names, dtypes and shapes (they may hold no data: sharded weights).
void save_pretrained_streamed(const models::CausalLM& model, const std::string& dir,
                              const std::function<at::Tensor(size_t)>& produce,
                              const SaveOptions& opts = {});

// "float32" / "bfloat16" / "float16" <-> ScalarType (InputError for anything else).
std::string hf_dtype_name(at::ScalarType t);
at::ScalarType hf_dtype_from_name(const std::string& name);

}  // namespace colossal::checkpoint
