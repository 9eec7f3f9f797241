// PEFT adapter folders (colossal/checkpoint/lora.h).
#include "colossal/checkpoint/lora.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"

namespace fs = std::filesystem;

namespace colossal::checkpoint {
namespace {

constexpr const char* kPrefix = "base_model.model.";
constexpr const char* kConfig = "adapter_config.json";
constexpr const char* kWeights = "adapter_model.safetensors";

// Our parameter name of every adapter tensor of root -> the tensor.
std::map<std::string, at::Tensor> adapter_tensors(torch::nn::Module& root) {
  std::map<std::string, at::Tensor> out;
  for (const auto& m : root.named_modules("", false)) {
    auto lora = std::dynamic_pointer_cast<nn::LoraLinear>(m.value());
    if (!lora) continue;
    out[m.key() + ".lora_A.weight"] = lora->lora_A->weight();
    out[m.key() + ".lora_B.weight"] = lora->lora_B->weight();
  }
  return out;
}

}  // namespace

void save_lora_adapter(torch::nn::Module& root, const nn::LoraConfig& cfg, const std::string& dir,
                       const std::string& base_model) {
  TensorList named;
  for (const auto& [name, t] : adapter_tensors(root)) named.emplace_back(name, t);
  COLOSSAL_CHECK_INPUT(!named.empty(), "save_lora_adapter: the model has no LoRA layers");
  save_lora_adapter(named, cfg, dir, base_model);
}

void save_lora_adapter(const TensorList& named, const nn::LoraConfig& cfg, const std::string& dir,
                       const std::string& base_model) {
  cfg.validate();
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, t] : named) {
    if (nn::is_lora_parameter(name)) tensors[name] = t;
  }
  COLOSSAL_CHECK_INPUT(!tensors.empty(), "save_lora_adapter: no LoRA tensors to save");
  std::error_code ec;
  fs::create_directories(dir, ec);
  COLOSSAL_CHECK_INPUT(!ec, "cannot create adapter folder ", dir, ": ", ec.message());
  TensorList list;
  for (const auto& [name, t] : tensors) list.emplace_back(kPrefix + name, t.detach());
  save_safetensors((fs::path(dir) / kWeights).string(), list, {{"format", "pt"}});
  json::Value c = json::Value::object();
  c.set("peft_type", "LORA");
  c.set("task_type", "CAUSAL_LM");
  c.set("base_model_name_or_path", base_model.empty() ? json::Value() : json::Value(base_model));
  c.set("r", cfg.r);
  c.set("lora_alpha", cfg.lora_alpha);
  c.set("lora_dropout", cfg.lora_dropout);
  json::Value targets = json::Value::array();
  for (const auto& t : cfg.target_modules) targets.push_back(t);
  c.set("target_modules", targets);
  c.set("bias", cfg.bias);
  c.set("use_rslora", cfg.use_rslora);
  c.set("use_dora", false);
  c.set("fan_in_fan_out", false);
  c.set("init_lora_weights", cfg.init == "gaussian" ? json::Value("gaussian") : json::Value(true));
  c.set("inference_mode", true);
  c.set("modules_to_save", json::Value());
  c.set("layers_to_transform", json::Value());
  c.set("rank_pattern", json::Value::object());
  c.set("alpha_pattern", json::Value::object());
  const std::string text = c.dump(2) + "\n";
  const std::string path = (fs::path(dir) / kConfig).string();
  write_file_atomic(path, [&](int fd) {
    COLOSSAL_CHECK_INPUT(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()),
                         "cannot write ", path, ": ", std::strerror(errno));
  });
}

nn::LoraConfig read_lora_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / kConfig).string();
  COLOSSAL_CHECK_INPUT(fs::exists(path), "adapter folder ", dir, " has no ", kConfig);
  const json::Value c = json::parse_file(path);
  COLOSSAL_CHECK_INPUT(c.is_object(), path, " is not a JSON object");
  auto field = [&](const char* k) { return str(path, ": ", k); };
  const json::Value* type = c.find("peft_type");
  COLOSSAL_CHECK_INPUT(type && type->is_string() && type->as_string() == "LORA", path,
                       ": peft_type is ", type ? type->dump() : std::string("missing"),
                       "; only LORA adapters are supported");
  nn::LoraConfig cfg;
  cfg.r = c.at("r").as_int(field("r"));
  cfg.lora_alpha = c.contains("lora_alpha") ? c.at("lora_alpha").as_double(field("lora_alpha")) : 8;
  if (const json::Value* d = c.find("lora_dropout"); d && !d->is_null())
    cfg.lora_dropout = d->as_double(field("lora_dropout"));
  const json::Value& t = c.at("target_modules");
  COLOSSAL_CHECK_INPUT(t.is_array(), path,
                       ": target_modules must be a list of module names (a regular expression "
                       "is not supported), got ",
                       t.dump());
  for (const auto& v : t.as_array())
    cfg.target_modules.push_back(v.as_string(field("target_modules")));
  if (const json::Value* b = c.find("bias")) cfg.bias = b->as_string(field("bias"));
  if (const json::Value* r = c.find("use_rslora")) cfg.use_rslora = r->as_bool(field("use_rslora"));
  if (const json::Value* i = c.find("init_lora_weights"))
    cfg.init = i->is_string() && i->as_string() == "gaussian" ? "gaussian" : "default";
  auto refuse_true = [&](const char* k, const char* what) {
    const json::Value* v = c.find(k);
    COLOSSAL_CHECK_INPUT(!v || v->is_null() || (v->is_bool() && !v->as_bool()), path, ": ", k,
                         " = ", v ? v->dump() : "", ": ", what, " is not supported");
  };
  refuse_true("use_dora", "DoRA");
  refuse_true("fan_in_fan_out", "fan_in_fan_out (Conv1D-style weights)");
  auto refuse_set = [&](const char* k, const char* what) {
    const json::Value* v = c.find(k);
    const bool empty = !v || v->is_null() || ((v->is_array() || v->is_object()) && v->size() == 0);
    COLOSSAL_CHECK_INPUT(empty, path, ": ", k, " = ", v ? v->dump() : "", ": ", what,
                         " is not supported");
  };
  refuse_set("rank_pattern", "a per-layer rank");
  refuse_set("alpha_pattern", "a per-layer alpha");
  refuse_set("layers_to_transform", "adapting only some layers");
  refuse_set("modules_to_save", "training whole extra modules");
  try {
    cfg.validate();
  } catch (const InputError& e) {
    throw InputError(str(path, ": ", e.what()));
  }
  return cfg;
}

nn::LoraConfig load_lora_adapter(torch::nn::Module& root, const std::string& dir) {
  nn::LoraConfig cfg = read_lora_config(dir);
  const std::string wpath = (fs::path(dir) / kWeights).string();
  COLOSSAL_CHECK_INPUT(fs::exists(wpath), "adapter folder ", dir, " has no ", kWeights);
  TensorList file = load_safetensors_copy(wpath);
  nn::apply_lora(root, cfg);
  auto ours = adapter_tensors(root);
  std::map<std::string, bool> seen;
  const std::string prefix = kPrefix;
  at::NoGradGuard ng;
  for (auto& [key, t] : file) {
    COLOSSAL_CHECK_INPUT(key.rfind(prefix, 0) == 0, wpath, ": tensor ", key, " is not under ",
                         prefix, " (not a PEFT adapter of a causal LM)");
    std::string name = key.substr(prefix.size());
    // PEFT keeps the adapter name in memory ("lora_A.default.weight") but not in files; accept
    // either.
    for (const char* ab : {".lora_A.default.weight", ".lora_B.default.weight"}) {
      const size_t at = name.find(ab);
      if (at != std::string::npos && at + std::strlen(ab) == name.size())
        name = name.substr(0, at) + (ab[6] == 'A' ? ".lora_A.weight" : ".lora_B.weight");
    }
    auto it = ours.find(name);
    COLOSSAL_CHECK_INPUT(it != ours.end(), wpath, ": tensor ", key,
                         " has no LoRA parameter in the model (the adapter does not fit it)");
    COLOSSAL_CHECK_INPUT(t.sizes() == it->second.sizes(), wpath, ": tensor ", key, " has shape ",
                         t.sizes(), " but the model's ", name, " is ", it->second.sizes(),
                         " (the adapter does not fit the model)");
    it->second.copy_(t);
    seen[name] = true;
  }
  for (const auto& [name, t] : ours) {
    COLOSSAL_CHECK_INPUT(seen.count(name), wpath, ": no tensor for ", prefix, name);
  }
  return cfg;
}

}  // namespace colossal::checkpoint
