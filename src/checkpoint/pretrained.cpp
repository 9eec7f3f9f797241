// load_pretrained / save_pretrained for the Llama family.
#include "colossal/checkpoint/pretrained.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/lora.h"

namespace colossal::checkpoint {

namespace fs = std::filesystem;

std::string hf_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      throw InputError(str("dtype ", t, " has no Hugging Face name (float32, bfloat16, float16)"));
  }
}

at::ScalarType hf_dtype_from_name(const std::string& n) {
  if (n == "float32" || n == "fp32") return at::kFloat;
  if (n == "bfloat16" || n == "bf16") return at::kBFloat16;
  if (n == "float16" || n == "fp16") return at::kHalf;
  throw InputError(str("dtype '", n, "' is not supported (float32, bfloat16, float16)"));
}

std::shared_ptr<models::CausalLM> load_pretrained(const std::string& dir,
                                                  const PretrainedOptions& opts) {
  COLOSSAL_CHECK_INPUT(fs::is_directory(dir), "model folder '", dir,
                       "' does not exist or is not a folder");
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  COLOSSAL_CHECK_INPUT(fs::exists(cfg_path), "model folder '", dir, "' has no config.json");
  models::ModelConfig cfg = models::ModelConfig::from_file(cfg_path);
  auto topts = at::TensorOptions()
                   .device(opts.device.value_or(at::Device(at::kCPU)))
                   .dtype(opts.dtype.value_or(at::kFloat));
  models::check_fits_memory(cfg, topts.device(), static_cast<int64_t>(topts.dtype().itemsize()),
                            cfg_path);
  auto model = std::make_shared<models::CausalLM>(cfg, topts);
  TensorList tensors = load_state_dict(dir);
  if (cfg.tie_word_embeddings) {
    std::erase_if(tensors, [](const auto& p) { return p.first == "lm_head.weight"; });
  }
  if (opts.skip_lora_tensors) {
    std::erase_if(tensors, [](const auto& p) { return nn::is_lora_parameter(p.first); });
  }
  load_into_module(*model, tensors, /*strict=*/true);
  log_info("loaded ", cfg.model_type, " model from ", dir, ": ", nn::count_parameters(*model),
           " parameters");
  return model;
}

namespace {
void save_pretrained_impl(const models::CausalLM& model, const std::string& dir,
                          const SaveOptions& opts,
                          const std::function<at::Tensor(size_t)>* produce) {
  COLOSSAL_CHECK(model.whole(), "save_pretrained needs the whole model (this one holds blocks [",
                 model.first_block(), ", ", model.end_block(), "))");
  TensorList state = module_state(model);
  COLOSSAL_CHECK(!state.empty(), "save_pretrained: the model has no parameters");
  for (const auto& [n, t] : state) {
    COLOSSAL_CHECK(!t.is_meta(), "save_pretrained: ", n,
                   " is on the meta device; materialize the model first");
  }
  models::ModelConfig cfg = model.config();
  cfg.dtype = hf_dtype_name(state.front().second.scalar_type());
  fs::create_directories(dir);
  if (produce) {
    std::vector<TensorDecl> decls;
    for (const auto& [n, t] : state) decls.push_back({n, t.scalar_type(), t.sizes().vec()});
    save_state_dict_streamed(dir, decls, *produce, opts);
  } else {
    save_state_dict(dir, state, opts);
  }
  const std::string path = (fs::path(dir) / "config.json").string();
  // Through write_file_atomic like the weights, so an asynchronous save stages it too.
  const std::string text = cfg.to_json().dump(2) + "\n";
  write_file_atomic(path, [&](int fd) { write_all(fd, text.data(), text.size(), path); });
}
}  // namespace

void save_pretrained(const models::CausalLM& model, const std::string& dir,
                     const SaveOptions& opts) {
  save_pretrained_impl(model, dir, opts, nullptr);
}

void save_pretrained_streamed(const models::CausalLM& model, const std::string& dir,
                              const std::function<at::Tensor(size_t)>& produce,
                              const SaveOptions& opts) {
  save_pretrained_impl(model, dir, opts, &produce);
}

}  // namespace colossal::checkpoint
