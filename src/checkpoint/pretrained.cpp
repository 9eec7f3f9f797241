// load_pretrained / save_pretrained for the Llama family.
#include "colossal/checkpoint/pretrained.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <utility>
#include <vector>

#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/safetensors.h"
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

namespace {

// load_pretrained with PretrainedOptions::quantize: the model is built on the meta device, its
// linear layers swapped for empty quantized ones, then every tensor of the (mapped) checkpoint
// is placed one at a time: a quantized layer's weight is quantized on the quantize device, any
// other tensor materializes its parameter; each tensor's mapped pages are released after it.
std::shared_ptr<models::CausalLM> load_quantized(const std::string& dir,
                                                 const models::ModelConfig& cfg,
                                                 const at::TensorOptions& topts,
                                                 const PretrainedOptions& opts) {
  const at::Device qdev = opts.quantize_device.value_or(topts.device());
  auto model = std::make_shared<models::CausalLM>(cfg, at::TensorOptions(topts).device(at::kMeta));
  const std::vector<std::string> qpaths = nn::quantize_linears(*model, *opts.quantize);
  std::map<std::string, std::pair<nn::Module*, std::string>> params;
  std::map<std::string, nn::QuantizedLinear*> qweights;
  for (const auto& item : model->named_modules("", true)) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    auto* m = dynamic_cast<nn::Module*>(item.value().get());
    for (const auto& p : item.value()->named_parameters(false)) {
      COLOSSAL_CHECK(m, "load_pretrained: ", prefix, p.key(), " is not in a colossal layer");
      params[prefix + p.key()] = {m, p.key()};
    }
    if (auto* q = dynamic_cast<nn::QuantizedLinear*>(item.value().get()))
      qweights[prefix + "weight"] = q;
  }
  TensorList tensors = load_state_dict(dir);
  if (cfg.tie_word_embeddings)
    std::erase_if(tensors, [](const auto& p) { return p.first == "lm_head.weight"; });
  if (opts.skip_lora_tensors)
    std::erase_if(tensors, [](const auto& p) { return nn::is_lora_parameter(p.first); });
  std::vector<std::string> unexpected, mismatched;
  int64_t qbytes = 0, placed = 0, last_percent = 0;
  at::NoGradGuard ng;
  for (const auto& [name, t] : tensors) {
    if (auto q = qweights.find(name); q != qweights.end()) {
      q->second->set_weight(t.to(qdev));
      qbytes += q->second->storage_bytes();
    } else if (auto p = params.find(name); p != params.end()) {
      auto& [m, local] = p->second;
      const at::Tensor& dst = m->param(local);
      if (dst.sizes() != t.sizes()) {
        mismatched.push_back(str(name, " (checkpoint ", t.sizes(), ", model ", dst.sizes(), ")"));
        continue;
      }
      m->replace_parameter(local, t.to(topts.device(), topts.dtype().toScalarType(),
                                       /*non_blocking=*/false, /*copy=*/true));
    } else {
      unexpected.push_back(name);
      continue;
    }
    release_mapped_pages(t);
    const int64_t percent = 100 * ++placed / static_cast<int64_t>(tensors.size());
    if (percent / 10 > last_percent / 10) {
      log_info("quantizing ", dir, ": ", percent, " % of ", tensors.size(), " tensors");
      last_percent = percent;
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, q] : qweights)
    if (!q->has_weight()) missing.push_back(name);
  for (const auto& [name, p] : params)
    if (p.first->param(p.second).is_meta()) missing.push_back(name);
  COLOSSAL_CHECK_INPUT(missing.empty() && unexpected.empty() && mismatched.empty(),
                       "model folder '", dir, "' does not fit its config.json",
                       missing.empty() ? "" : "; missing: ", name_list(missing, 8),
                       unexpected.empty() ? "" : "; unexpected: ", name_list(unexpected, 8),
                       mismatched.empty() ? "" : "; wrong shape: ", name_list(mismatched, 8));
  log_info("loaded ", cfg.model_type, " model from ", dir, " with ", qpaths.size(),
           " linear layers quantized to ", opts.quantize->kind, " on ", qdev, " (",
           static_cast<double>(qbytes) / (1 << 30), " GiB)");
  return model;
}

}  // namespace

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
  if (opts.quantize) return load_quantized(dir, cfg, topts, opts);
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
