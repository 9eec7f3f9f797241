// config.json parsing and writing for llama / mistral / qwen2, and the benchmark presets.
#include "colossal/models/llama/config.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"

namespace colossal::models {
namespace {

int64_t get_int(const json::Value& j, const char* key, int64_t def) {
  const json::Value* v = j.find(key);
  if (!v || v->is_null()) return def;
  return v->as_int(str("config.json: ", key));
}

double get_double(const json::Value& j, const char* key, double def) {
  const json::Value* v = j.find(key);
  if (!v || v->is_null()) return def;
  return v->as_double(str("config.json: ", key));
}

bool get_bool(const json::Value& j, const char* key, bool def) {
  const json::Value* v = j.find(key);
  if (!v || v->is_null()) return def;
  return v->as_bool(str("config.json: ", key));
}

void parse_rope(const json::Value& j, ModelConfig& c) {
  // transformers 5 writes `rope_parameters` {rope_type, rope_theta, factor...}; older configs
  // have `rope_theta` at the top and an optional `rope_scaling` {type|rope_type, factor...}.
  const json::Value* rp = j.find("rope_parameters");
  if (!rp || rp->is_null()) rp = j.find("rope_scaling");
  if (rp && rp->is_null()) rp = nullptr;
  c.rope = RopeConfig{};
  c.rope.theta = get_double(j, "rope_theta", c.model_type == "llama" ? 10000.0 : 10000.0);
  if (const json::Value* pf = j.find("partial_rotary_factor"); pf && !pf->is_null()) {
    COLOSSAL_CHECK_INPUT(pf->as_double("partial_rotary_factor") == 1.0,
                         "config.json: partial_rotary_factor=", pf->dump(),
                         " is not supported (only 1.0, as llama/mistral/qwen2 use)");
  }
  if (!rp) return;
  COLOSSAL_CHECK_INPUT(rp->is_object(),
                       "config.json: rope_parameters/rope_scaling must be an object, got ",
                       rp->dump());
  static const std::set<std::string> kLayerTypes = {"full_attention", "sliding_attention"};
  for (const auto& [k, v] : rp->as_object()) {
    COLOSSAL_CHECK_INPUT(!kLayerTypes.count(k),
                         "config.json: per-layer-type rope_parameters (key '", k,
                         "') are not supported; use one rope_parameters object");
  }
  std::string type = "default";
  if (const json::Value* t = rp->find("rope_type"); t && !t->is_null()) {
    type = t->as_string("rope_parameters.rope_type");
  } else if (const json::Value* t2 = rp->find("type"); t2 && !t2->is_null()) {
    type = t2->as_string("rope_scaling.type");
  }
  c.rope.type = type;
  c.rope.theta = get_double(*rp, "rope_theta", c.rope.theta);
  if (const json::Value* pf = rp->find("partial_rotary_factor"); pf && !pf->is_null()) {
    COLOSSAL_CHECK_INPUT(pf->as_double("partial_rotary_factor") == 1.0,
                         "config.json: rope_parameters.partial_rotary_factor=", pf->dump(),
                         " is not supported (only 1.0)");
  }
  if (type == "default") return;
  if (type != "linear" && type != "dynamic" && type != "llama3") {
    throw InputError(str("config.json: rope type '", type,
                         "' is not supported (supported: default, linear, dynamic, llama3)"));
  }
  const json::Value* f = rp->find("factor");
  COLOSSAL_CHECK_INPUT(f && !f->is_null(), "config.json: rope type '", type, "' needs a 'factor'");
  c.rope.factor = f->as_double("rope_parameters.factor");
  if (type == "llama3") {
    for (const char* k : {"low_freq_factor", "high_freq_factor"}) {
      const json::Value* v = rp->find(k);
      COLOSSAL_CHECK_INPUT(v && !v->is_null(), "config.json: rope type 'llama3' needs '", k, "'");
    }
    c.rope.low_freq_factor = rp->at("low_freq_factor").as_double("low_freq_factor");
    c.rope.high_freq_factor = rp->at("high_freq_factor").as_double("high_freq_factor");
    c.rope.original_max_position_embeddings =
        get_int(*rp, "original_max_position_embeddings",
                get_int(j, "original_max_position_embeddings", c.max_position_embeddings));
  }
}

}  // namespace

bool ModelConfig::uses_sliding(int64_t layer) const {
  return sliding_window && layer >= 0 && layer < static_cast<int64_t>(layer_sliding.size()) &&
         layer_sliding[layer];
}

void ModelConfig::validate() const {
  COLOSSAL_CHECK_INPUT(model_type == "llama" || model_type == "mistral" || model_type == "qwen2",
                       "model_type '", model_type,
                       "' is not supported (supported: llama, mistral, qwen2)");
  auto pos = [](const char* name, int64_t v) {
    COLOSSAL_CHECK_INPUT(v > 0, "config: ", name, " must be positive, got ", v);
  };
  pos("vocab_size", vocab_size);
  pos("hidden_size", hidden_size);
  pos("intermediate_size", intermediate_size);
  pos("num_hidden_layers", num_hidden_layers);
  pos("num_attention_heads", num_attention_heads);
  pos("num_key_value_heads", num_key_value_heads);
  pos("head_dim", head_dim);
  pos("max_position_embeddings", max_position_embeddings);
  COLOSSAL_CHECK_INPUT(head_dim % 2 == 0,
                       "config: head_dim must be even for rotary embeddings, got ", head_dim);
  COLOSSAL_CHECK_INPUT(num_attention_heads % num_key_value_heads == 0,
                       "config: num_attention_heads (", num_attention_heads,
                       ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  COLOSSAL_CHECK_INPUT(!sliding_window || *sliding_window > 0,
                       "config: sliding_window must be positive, got ", sliding_window.value_or(0));
  COLOSSAL_CHECK_INPUT(static_cast<int64_t>(layer_sliding.size()) == num_hidden_layers,
                       "config: layer_types has ", layer_sliding.size(),
                       " entries but num_hidden_layers is ", num_hidden_layers);
  // A zero or non-finite epsilon divides by zero in every RMSNorm, a zero theta makes every
  // rotary frequency 0 or NaN: both train NaN from step 1 instead of failing here.
  auto pos_finite = [](const char* name, double v) {
    COLOSSAL_CHECK_INPUT(std::isfinite(v) && v > 0, "config: ", name,
                         " must be a positive finite number, got ", v);
  };
  pos_finite("rms_norm_eps", rms_norm_eps);
  pos_finite("rope_theta", rope.theta);
  COLOSSAL_CHECK_INPUT(std::isfinite(initializer_range) && initializer_range >= 0,
                       "config: initializer_range must be a finite number >= 0, got ",
                       initializer_range);
  if (rope.type != "default") pos_finite("rope factor", rope.factor);
  if (rope.type == "llama3") {
    pos_finite("rope low_freq_factor", rope.low_freq_factor);
    pos_finite("rope high_freq_factor", rope.high_freq_factor);
    COLOSSAL_CHECK_INPUT(rope.high_freq_factor != rope.low_freq_factor,
                         "config: llama3 rope needs high_freq_factor != low_freq_factor");
  }
  // Sizes whose parameter count does not fit an int64 (no machine holds them anyway).
  COLOSSAL_CHECK_INPUT(parameter_count(*this) > 0,
                       "config: the model's parameter count overflows "
                       "(hidden_size ",
                       hidden_size, ", intermediate_size ", intermediate_size,
                       ", num_hidden_layers ", num_hidden_layers, ", vocab_size ", vocab_size, ")");
}

int64_t parameter_count(const ModelConfig& c) {
  // Counted in long double: absurd sizes overflow int64 and are reported as -1.
  using F = long double;
  const F h = c.hidden_size, q = F(c.num_attention_heads) * c.head_dim, kv = c.kv_dim(),
          f = c.intermediate_size, v = c.vocab_size;
  const F attn = h * q + 2 * h * kv + q * h + (c.qkv_bias ? q + 2 * kv : 0) + (c.o_bias ? h : 0);
  const F mlp = 3 * h * f + (c.mlp_bias ? 2 * f + h : 0);
  const F layer = attn + mlp + 2 * h;
  const F total = F(c.num_hidden_layers) * layer + v * h * (c.tie_word_embeddings ? 1 : 2) + h;
  if (!(total < F(INT64_MAX))) return -1;
  return static_cast<int64_t>(total);
}

namespace {
// Memory a model of `bytes` can use on `device`: the device's total for cuda (what else runs
// there is unknown here), MemAvailable (/proc/meminfo) for the host; 0 when unknown.
int64_t memory_for(const at::Device& device, std::string* what) {
  if (device.is_cuda()) {
    auto devices = cuda_devices();
    const size_t i = device.has_index() ? static_cast<size_t>(device.index()) : 0;
    if (i >= devices.size()) return 0;
    *what = str("the memory of CUDA device ", i, " (", devices[i].name, ")");
    return devices[i].total_memory;
  }
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      *what = "the host's available memory (MemAvailable)";
      return kib * 1024;
    }
  }
  return 0;
}
// "2400046280000000 bytes (2.18e+03 TiB)": the exact count and a readable size.
std::string bytes_text(long double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(0) << bytes << " bytes (" << std::defaultfloat
     << std::setprecision(3);
  if (bytes >= 1024.0L * 1024 * 1024 * 1024)
    os << static_cast<double>(bytes / (1024.0L * 1024 * 1024 * 1024)) << " TiB)";
  else
    os << static_cast<double>(bytes / (1024.0L * 1024 * 1024)) << " GiB)";
  return os.str();
}
}  // namespace

void check_fits_memory(const ModelConfig& c, const at::Device& device, int64_t bytes_per_param,
                       const std::string& what) {
  const int64_t n = parameter_count(c);
  COLOSSAL_CHECK_INPUT(n > 0, what, ": the parameter count overflows int64 (hidden_size ",
                       c.hidden_size, ", num_hidden_layers ", c.num_hidden_layers, ")");
  std::string where;
  const int64_t avail = memory_for(device, &where);
  if (avail <= 0) return;  // unknown: the allocator will say
  const long double bytes = static_cast<long double>(n) * bytes_per_param;
  COLOSSAL_CHECK_INPUT(bytes <= static_cast<long double>(avail), what, ": ", n, " parameters need ",
                       bytes_text(bytes), " at ", bytes_per_param, " bytes each, but ", where,
                       " is ", bytes_text(avail), "; choose smaller sizes in the model config");
}

ModelConfig ModelConfig::from_json(const json::Value& j) {
  COLOSSAL_CHECK_INPUT(j.is_object(), "config.json must be a JSON object");
  ModelConfig c;
  const json::Value* mt = j.find("model_type");
  COLOSSAL_CHECK_INPUT(mt && mt->is_string(),
                       "config.json has no model_type (expected llama, mistral or qwen2)");
  c.model_type = mt->as_string();
  COLOSSAL_CHECK_INPUT(
      c.model_type == "llama" || c.model_type == "mistral" || c.model_type == "qwen2",
      "config.json: model_type '", c.model_type,
      "' is not supported (supported: llama, mistral, qwen2)");
  const bool llama = c.model_type == "llama", mistral = c.model_type == "mistral",
             qwen2 = c.model_type == "qwen2";
  // Defaults are those of transformers' config classes, for configs that leave a field out.
  c.vocab_size = get_int(j, "vocab_size", qwen2 ? 151936 : 32000);
  c.hidden_size = get_int(j, "hidden_size", 4096);
  c.intermediate_size = get_int(j, "intermediate_size", mistral ? 14336 : qwen2 ? 22016 : 11008);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", 32);
  c.num_attention_heads = get_int(j, "num_attention_heads", 32);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", mistral ? 8 : c.num_attention_heads);
  c.max_position_embeddings = get_int(j, "max_position_embeddings",
                                      mistral ? 4096 * 32
                                      : qwen2 ? 32768
                                              : 2048);
  // Sizes are checked before anything is derived from them: a negative num_hidden_layers would
  // otherwise first reach std::vector (layer_sliding) as a raw length error.
  for (auto [key, v] : {std::pair{"vocab_size", c.vocab_size},
                        {"hidden_size", c.hidden_size},
                        {"intermediate_size", c.intermediate_size},
                        {"num_hidden_layers", c.num_hidden_layers},
                        {"num_attention_heads", c.num_attention_heads},
                        {"num_key_value_heads", c.num_key_value_heads},
                        {"max_position_embeddings", c.max_position_embeddings}}) {
    COLOSSAL_CHECK_INPUT(v > 0, "config.json: ", key, " must be positive, got ", v);
  }
  const json::Value* hd = j.find("head_dim");
  if (!hd || hd->is_null()) {
    COLOSSAL_CHECK_INPUT(c.hidden_size % c.num_attention_heads == 0, "config.json: hidden_size (",
                         c.hidden_size, ") must be a multiple of num_attention_heads (",
                         c.num_attention_heads, ") when head_dim is not given");
  }
  c.head_dim = get_int(j, "head_dim", c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", 1e-6);
  c.initializer_range = get_double(j, "initializer_range", 0.02);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", false);
  std::string act = "silu";
  if (const json::Value* a = j.find("hidden_act"); a && !a->is_null())
    act = a->as_string("config.json: hidden_act");
  COLOSSAL_CHECK_INPUT(act == "silu", "config.json: hidden_act '", act,
                       "' is not supported (only silu)");
  double dropout = get_double(j, "attention_dropout", 0.0);
  COLOSSAL_CHECK_INPUT(dropout == 0.0, "config.json: attention_dropout=", dropout,
                       " is not supported (only 0)");
  if (llama) {
    bool ab = get_bool(j, "attention_bias", false);
    c.qkv_bias = ab;
    c.o_bias = ab;
    c.mlp_bias = get_bool(j, "mlp_bias", false);
  } else if (qwen2) {
    c.qkv_bias = true;
  }
  parse_rope(j, c);
  // Sliding windows.
  c.layer_sliding.assign(c.num_hidden_layers, false);
  if (mistral) {
    int64_t w = get_int(j, "sliding_window", 0);
    if (w > 0) {
      c.sliding_window = w;
      c.layer_sliding.assign(c.num_hidden_layers, true);
    }
    COLOSSAL_CHECK_INPUT(
        !j.find("layer_types") || j.at("layer_types").is_null(),
        "config.json: mistral with layer_types (alternating attention) is not supported");
  } else if (qwen2) {
    bool use = get_bool(j, "use_sliding_window", false);
    int64_t w = get_int(j, "sliding_window", 0);
    if (use && w > 0) c.sliding_window = w;
    const json::Value* lt = j.find("layer_types");
    if (lt && !lt->is_null()) {
      const auto& arr = lt->as_array("config.json: layer_types");
      COLOSSAL_CHECK_INPUT(static_cast<int64_t>(arr.size()) == c.num_hidden_layers,
                           "config.json: layer_types has ", arr.size(),
                           " entries, num_hidden_layers is ", c.num_hidden_layers);
      for (size_t i = 0; i < arr.size(); ++i) {
        const std::string& t = arr[i].as_string("config.json: layer_types[i]");
        COLOSSAL_CHECK_INPUT(t == "full_attention" || t == "sliding_attention",
                             "config.json: layer_types[", i, "] = '", t,
                             "' is not supported (full_attention, sliding_attention)");
        c.layer_sliding[i] = t == "sliding_attention" && c.sliding_window.has_value();
      }
    } else if (c.sliding_window) {
      int64_t mwl = get_int(j, "max_window_layers", 28);
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.layer_sliding[i] = i >= mwl;
    }
  }
  if (const json::Value* p = j.find("pad_token_id"); p && !p->is_null())
    c.pad_token_id = p->as_int("pad_token_id");
  if (const json::Value* b = j.find("bos_token_id")) c.bos_token_id = *b;
  if (const json::Value* e = j.find("eos_token_id")) c.eos_token_id = *e;
  if (const json::Value* d = j.find("dtype"); d && d->is_string()) {
    c.dtype = d->as_string();
  } else if (const json::Value* d2 = j.find("torch_dtype"); d2 && d2->is_string()) {
    c.dtype = d2->as_string();
  }
  c.validate();
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::error_code ec;
  COLOSSAL_CHECK_INPUT(!std::filesystem::is_directory(path, ec), "model config ", path,
                       " is a folder, not a config.json (an HF model folder is --init)");
  try {
    return from_json(json::parse_file(path));
  } catch (const InputError& e) {
    // The messages say "config.json: <field>"; name the file the user gave instead.
    std::string msg = e.what();
    for (const char* prefix : {"config.json: ", "config: "}) {
      if (msg.rfind(prefix, 0) == 0) {
        msg = msg.substr(std::strlen(prefix));
        break;
      }
    }
    throw InputError(str(path, ": ", msg));
  }
}

json::Value ModelConfig::to_json() const {
  validate();
  json::Value j = json::Value::object();
  const char* arch = model_type == "llama"     ? "LlamaForCausalLM"
                     : model_type == "mistral" ? "MistralForCausalLM"
                                               : "Qwen2ForCausalLM";
  j.set("architectures", json::Value(json::Value::Array{json::Value(arch)}));
  j.set("model_type", model_type);
  j.set("vocab_size", vocab_size);
  j.set("hidden_size", hidden_size);
  j.set("intermediate_size", intermediate_size);
  j.set("num_hidden_layers", num_hidden_layers);
  j.set("num_attention_heads", num_attention_heads);
  j.set("num_key_value_heads", num_key_value_heads);
  j.set("head_dim", head_dim);
  j.set("hidden_act", "silu");
  j.set("max_position_embeddings", max_position_embeddings);
  j.set("initializer_range", initializer_range);
  j.set("rms_norm_eps", rms_norm_eps);
  j.set("tie_word_embeddings", tie_word_embeddings);
  j.set("attention_dropout", 0.0);
  if (model_type == "llama") {
    COLOSSAL_CHECK(qkv_bias == o_bias, "llama config: attention_bias covers q/k/v/o together");
    j.set("attention_bias", qkv_bias);
    j.set("mlp_bias", mlp_bias);
  }
  json::Value rp = json::Value::object();
  rp.set("rope_type", rope.type);
  rp.set("rope_theta", rope.theta);
  if (rope.type != "default") rp.set("factor", rope.factor);
  if (rope.type == "llama3") {
    rp.set("low_freq_factor", rope.low_freq_factor);
    rp.set("high_freq_factor", rope.high_freq_factor);
    rp.set("original_max_position_embeddings", rope.original_max_position_embeddings);
  }
  j.set("rope_parameters", rp);
  if (model_type == "mistral") {
    j.set("sliding_window", sliding_window ? json::Value(*sliding_window) : json::Value());
  } else if (model_type == "qwen2") {
    j.set("use_sliding_window", sliding_window.has_value());
    j.set("sliding_window", sliding_window ? json::Value(*sliding_window) : json::Value());
    json::Value lt = json::Value::array();
    for (bool s : layer_sliding) lt.push_back(s ? "sliding_attention" : "full_attention");
    j.set("layer_types", lt);
    int64_t mwl = num_hidden_layers;
    for (int64_t i = 0; i < num_hidden_layers; ++i) {
      if (layer_sliding[i]) {
        mwl = i;
        break;
      }
    }
    j.set("max_window_layers", mwl);
  }
  j.set("pad_token_id", pad_token_id ? json::Value(*pad_token_id) : json::Value());
  j.set("bos_token_id", bos_token_id);
  j.set("eos_token_id", eos_token_id);
  j.set("dtype", dtype);
  j.set("use_cache", true);
  return j;
}

std::vector<std::string> ModelConfig::preset_names() {
  return {"tiny", "100m", "1b", "7b", "13b", "70b"};
}

ModelConfig ModelConfig::preset(const std::string& name) {
  ModelConfig c;  // LlamaConfig defaults: the 7b shape
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.max_position_embeddings = 4096;
  if (name == "tiny") {
    c.hidden_size = 256;
    c.intermediate_size = 688;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 4;
    c.max_position_embeddings = 2048;
  } else if (name == "100m") {
    c.hidden_size = 1024;
    c.intermediate_size = 2048;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 32;
  } else if (name == "1b") {  // TinyLlama-1.1B
    c.hidden_size = 2048;
    c.intermediate_size = 5632;
    c.num_hidden_layers = 22;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.max_position_embeddings = 2048;
    c.rms_norm_eps = 1e-5;
  } else if (name == "7b") {
  } else if (name == "13b") {
    c.hidden_size = 5120;
    c.intermediate_size = 13824;
    c.num_hidden_layers = 40;
    c.num_attention_heads = 40;
    c.num_key_value_heads = 40;
  } else if (name == "70b") {
    c.hidden_size = 8192;
    c.intermediate_size = 28672;
    c.num_hidden_layers = 80;
    c.num_attention_heads = 64;
    c.num_key_value_heads = 8;
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw InputError(str("unknown model preset '", name, "' (presets: ", names, ")"));
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.layer_sliding.assign(c.num_hidden_layers, false);
  c.validate();
  return c;
}

at::Tensor rope_inv_freq(const ModelConfig& cfg, std::optional<int64_t> seq_len) {
  return nn::rope_inv_freq(cfg.rotary(), seq_len);
}

}  // namespace colossal::models
