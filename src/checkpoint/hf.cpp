// The Hugging Face checkpoint layout: single file or shards + index, and module load/save.
#include "colossal/checkpoint/hf.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>

#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/core/logging.h"
#include "colossal/nn/lora.h"

namespace fs = std::filesystem;

namespace colossal::checkpoint {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// `wanted` (may be empty: every tensor) selects the tensors returned; a shard holding none of
// them is not opened. `names` (may be null) receives every tensor the index lists.
TensorList load_index(const std::string& index_path, const NameFilter& wanted,
                      std::vector<std::string>* names_out) {
  json::Value root = json::parse_file(index_path);
  COLOSSAL_CHECK_INPUT(root.is_object(), index_path, ": an index must be a JSON object");
  const json::Value* wm = root.find("weight_map");
  COLOSSAL_CHECK_INPUT(wm && wm->is_object(), index_path,
                       ": no \"weight_map\" object (is this a checkpoint index?)");
  fs::path dir = fs::path(index_path).parent_path();
  // Shards in order of first mention; per shard, the tensors the index assigns to it.
  std::vector<std::string> shards;
  std::map<std::string, std::set<std::string>> by_shard;
  for (const auto& [name, file] : wm->as_object()) {
    COLOSSAL_CHECK_INPUT(file.is_string(), index_path, ": weight_map entry of \"", name,
                         "\" must be a file name");
    const std::string& f = file.as_string();
    fs::path fp(f);
    bool safe = !f.empty() && fp.is_relative();
    for (const auto& part : fp) safe = safe && part != "..";
    COLOSSAL_CHECK_INPUT(safe, index_path, ": weight_map entry of \"", name, "\" names file \"", f,
                         "\", which is not a plain relative path inside the checkpoint folder");
    if (!by_shard.count(f)) shards.push_back(f);
    by_shard[f].insert(name);
    if (names_out) names_out->push_back(name);
  }
  TensorList out;
  for (const auto& shard : shards) {
    std::string path = (dir / shard).string();
    COLOSSAL_CHECK_INPUT(fs::exists(path), index_path, " lists shard ", shard, ", but ", path,
                         " does not exist (incomplete download or copy?)");
    auto& names = by_shard[shard];
    if (wanted) {
      std::erase_if(names, [&](const std::string& n) { return !wanted(n); });
      if (names.empty()) continue;
    }
    SafetensorsReader r(path);
    for (const auto& info : r.tensors()) {
      if (names.count(info.name)) out.emplace_back(info.name, r.get(info.name));
    }
    for (const auto& n : names) {
      COLOSSAL_CHECK_INPUT(r.find(n), index_path, " maps tensor \"", n, "\" to ", shard,
                           ", but that file has no such tensor");
    }
  }
  return out;
}

// <prefix>.safetensors, <prefix>.safetensors.index.json or <prefix>-NNNNN-of-NNNNN.safetensors.
bool is_checkpoint_file(const std::string& name, const std::string& prefix) {
  if (name == prefix + ".safetensors" || name == prefix + ".safetensors.index.json") return true;
  const std::string tail = "-00000-of-00000.safetensors";
  if (name.size() != prefix.size() + tail.size() || name.compare(0, prefix.size(), prefix) != 0)
    return false;
  for (size_t i = 0; i < tail.size(); ++i) {
    char c = name[prefix.size() + i];
    if (tail[i] == '0' ? !(c >= '0' && c <= '9') : c != tail[i]) return false;
  }
  return true;
}

std::string shard_name(const std::string& prefix, size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", k, n);
  return prefix + buf;
}

// Walks a module tree like PyTorch's state_dict: each module's own parameters, then its
// buffers, then its children in registration order.
void collect_state(const torch::nn::Module& m, const std::string& prefix, TensorList& out) {
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    out.emplace_back(prefix + p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/false))
    out.emplace_back(prefix + b.key(), b.value());
  for (const auto& c : m.named_children()) collect_state(*c.value(), prefix + c.key() + ".", out);
}

}  // namespace

namespace {
// A single .safetensors file, its tensors filtered.
TensorList load_file(const std::string& path, const NameFilter& wanted,
                     std::vector<std::string>* names) {
  TensorList all = load_safetensors(path);
  if (names)
    for (const auto& [n, t] : all) names->push_back(n);
  if (wanted) std::erase_if(all, [&](const auto& nt) { return !wanted(nt.first); });
  return all;
}
}  // namespace

TensorList load_state_dict(const std::string& file_or_dir) {
  return load_state_dict(file_or_dir, {}, nullptr);
}

TensorList load_state_dict(const std::string& file_or_dir, const NameFilter& wanted,
                           std::vector<std::string>* names) {
  std::error_code ec;
  COLOSSAL_CHECK_INPUT(fs::exists(file_or_dir, ec), "checkpoint ", file_or_dir, " does not exist");
  if (fs::is_directory(file_or_dir, ec)) {
    fs::path dir(file_or_dir);
    std::string index = (dir / "model.safetensors.index.json").string();
    if (fs::exists(index, ec)) return load_index(index, wanted, names);
    std::string single = (dir / "model.safetensors").string();
    if (fs::exists(single, ec)) return load_file(single, wanted, names);
    // Another prefix: exactly one *.safetensors.index.json or one *.safetensors file.
    std::vector<std::string> indexes, files;
    for (const auto& e : fs::directory_iterator(dir)) {
      std::string name = e.path().filename().string();
      if (ends_with(name, ".safetensors.index.json")) indexes.push_back(e.path().string());
      if (ends_with(name, ".safetensors")) files.push_back(e.path().string());
    }
    if (indexes.size() == 1) return load_index(indexes[0], wanted, names);
    if (indexes.empty() && files.size() == 1) return load_file(files[0], wanted, names);
    throw InputError(str(
        "checkpoint folder ", file_or_dir,
        " holds neither model.safetensors.index.json nor model.safetensors",
        indexes.size() + files.size() ? " and more than one candidate; pass the file itself" : "",
        " (found ", indexes.size(), " index files and ", files.size(), " .safetensors files)"));
  }
  if (ends_with(file_or_dir, ".json")) return load_index(file_or_dir, wanted, names);
  return load_file(file_or_dir, wanted, names);
}

namespace {
void check_save_options(const SaveOptions& opts) {
  COLOSSAL_CHECK_INPUT(!opts.prefix.empty() && opts.prefix.find('/') == std::string::npos,
                       "save_state_dict: prefix \"", opts.prefix,
                       "\" must be a non-empty file name without '/'");
  COLOSSAL_CHECK_INPUT(opts.size_per_shard_mb > 0,
                       "save_state_dict: size_per_shard_mb must be positive, got ",
                       opts.size_per_shard_mb);
}
}  // namespace

StatePlan plan_state_dict(const std::vector<TensorDecl>& tensors, const SaveOptions& opts) {
  check_save_options(opts);
  // Cut a shard before a tensor would overflow it; a tensor larger than the limit gets a shard
  // of its own, so shards are never empty.
  const uint64_t limit = static_cast<uint64_t>(opts.size_per_shard_mb) * 1024 * 1024;
  std::vector<std::vector<size_t>> shards(1);
  uint64_t current = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t nbytes = tensors[i].nbytes();
    if (opts.shard && !shards.back().empty() && current + nbytes > limit) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += nbytes;
  }
  StatePlan plan;
  for (size_t k = 0; k < shards.size(); ++k) {
    plan.files.push_back(shards.size() == 1 ? opts.prefix + ".safetensors"
                                            : shard_name(opts.prefix, k + 1, shards.size()));
    std::vector<TensorDecl> decls;
    for (size_t i : shards[k]) decls.push_back(tensors[i]);
    std::vector<size_t> order;
    for (size_t j : safetensors_file_order(decls)) order.push_back(shards[k][j]);
    plan.order.push_back(std::move(order));
  }
  return plan;
}

void save_state_dict_streamed(const std::string& dir, const std::vector<TensorDecl>& tensors,
                              const std::function<at::Tensor(size_t)>& produce,
                              const SaveOptions& opts) {
  check_save_options(opts);
  std::error_code ec;
  fs::create_directories(dir, ec);
  COLOSSAL_CHECK_INPUT(!ec && fs::is_directory(dir), "cannot create checkpoint folder ", dir, ": ",
                       ec ? ec.message() : std::string("a file of that name exists"));
  // Check names and dtypes up front, so a bad list fails before any file is replaced.
  std::set<std::string> seen;
  uint64_t total_size = 0, total_params = 0;
  for (const auto& t : tensors) {
    COLOSSAL_CHECK_INPUT(seen.insert(t.name).second, "save_state_dict: tensor name \"", t.name,
                         "\" appears twice");
    try {
      dtype_to_safetensors(t.dtype);
    } catch (const Error& e) {
      throw Error(str("save_state_dict into ", dir, ": tensor \"", t.name, "\": ", e.what()));
    }
    total_size += t.nbytes();
    total_params += t.nbytes() / c10::elementSize(t.dtype);
  }
  const StatePlan plan = plan_state_dict(tensors, opts);
  const Metadata md{{"format", "pt"}};  // transformers refuses files without it
  fs::path d(dir);
  std::set<std::string> written;
  for (size_t k = 0; k < plan.files.size(); ++k) {
    std::vector<TensorDecl> decls;
    std::vector<size_t> index;  // declaration index in the file -> index in `tensors`
    // The file's declarations in shard order (the writer sorts them as plan_state_dict did).
    std::vector<size_t> members = plan.order[k];
    std::sort(members.begin(), members.end());
    for (size_t i : members) {
      decls.push_back(tensors[i]);
      index.push_back(i);
    }
    SafetensorsStreamWriter w((d / plan.files[k]).string(), std::move(decls), md);
    for (size_t pos = 0; !w.done(); ++pos) {
      const size_t i = index[w.next_index()];
      COLOSSAL_CHECK(i == plan.order[k][pos], "save_state_dict: write order differs from the plan");
      w.write_next(produce(i));
    }
    w.finish();
    written.insert(plan.files[k]);
  }
  if (plan.files.size() > 1) {
    json::Value weight_map = json::Value::object();
    std::map<std::string, std::string> sorted;  // HF writes the index with sorted keys
    for (size_t k = 0; k < plan.files.size(); ++k)
      for (size_t i : plan.order[k]) sorted[tensors[i].name] = plan.files[k];
    for (const auto& [n, f] : sorted) weight_map.set(n, f);
    json::Value meta = json::Value::object();
    meta.set("total_parameters", total_params);
    meta.set("total_size", total_size);
    json::Value index = json::Value::object();
    index.set("metadata", std::move(meta));
    index.set("weight_map", std::move(weight_map));
    std::string text = index.dump(2) + "\n";
    std::string index_name = opts.prefix + ".safetensors.index.json";
    write_file_atomic((d / index_name).string(), [&](int fd) {
      write_all(fd, text.data(), text.size(), (d / index_name).string());
    });
    written.insert(index_name);
  }
  // Only now remove what an earlier save with this prefix left behind.
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(d)) {
    std::string name = e.path().filename().string();
    if (!written.count(name) && is_checkpoint_file(name, opts.prefix)) stale.push_back(e.path());
  }
  for (const auto& p : stale) {
    fs::remove(p, ec);
    if (ec) log_warn("could not remove stale checkpoint file ", p.string(), ": ", ec.message());
  }
  fsync_path(dir);
}

void save_state_dict(const std::string& dir, const TensorList& tensors, const SaveOptions& opts) {
  check_save_options(opts);
  std::vector<TensorDecl> decls;
  decls.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    COLOSSAL_CHECK_INPUT(t.defined(), "save_state_dict: tensor \"", name, "\" is undefined");
    decls.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  save_state_dict_streamed(
      dir, decls, [&](size_t i) { return tensors[i].second; }, opts);
}

TensorList module_state(const torch::nn::Module& module) {
  TensorList out;
  collect_state(module, "", out);
  return out;
}

void load_into_module(torch::nn::Module& module, const TensorList& tensors, bool strict,
                      const std::function<void(const at::Tensor& dst)>& before_copy) {
  TensorList state = module_state(module);
  std::unordered_map<std::string, at::Tensor> targets;
  for (const auto& [n, t] : state) targets.emplace(n, t);
  std::unordered_map<std::string, const at::Tensor*> source;
  std::vector<std::string> unexpected, missing, mismatched;
  for (const auto& [n, t] : tensors) {
    auto it = targets.find(n);
    if (it == targets.end()) {
      unexpected.push_back(n);
      continue;
    }
    if (!source.emplace(n, &t).second)
      throw InputError(str("checkpoint holds tensor \"", n, "\" twice"));
    if (!t.sizes().equals(it->second.sizes())) {
      mismatched.push_back(str(n, " (checkpoint ", t.sizes(), ", model ", it->second.sizes(), ")"));
    }
  }
  for (const auto& [n, t] : state) {
    if (!source.count(n)) missing.push_back(n);
  }
  std::string problems;
  if (!mismatched.empty()) problems += str("; shape mismatch: ", name_list(mismatched));
  if (strict && !missing.empty())
    problems += str("; missing from the checkpoint: ", name_list(missing));
  if (strict && !unexpected.empty()) problems += str("; not in the model: ", name_list(unexpected));
  if (!problems.empty()) {
    // A LoRA run's checkpoint loaded as a plain model: say what it is and what to do.
    const bool lora = !unexpected.empty() && missing.empty() && mismatched.empty() &&
                      std::all_of(unexpected.begin(), unexpected.end(),
                                  [](const std::string& n) { return nn::is_lora_parameter(n); });
    // A QLoRA run's: the adapters are there, the quantized linear weights are not.
    const bool qlora = !unexpected.empty() && !missing.empty() && mismatched.empty() &&
                       std::all_of(unexpected.begin(), unexpected.end(),
                                   [](const std::string& n) { return nn::is_lora_parameter(n); }) &&
                       std::all_of(missing.begin(), missing.end(), [](const std::string& n) {
                         return n.ends_with("_proj.weight");
                       });
    if (qlora)
      throw InputError(
          str("the checkpoint holds LoRA adapter tensors (", name_list(unexpected, 2),
              ") and lacks the linear layers' weights (", name_list(missing, 2),
              "): it is from a QLoRA run (--quantize), whose quantized base is not saved; fold the "
              "run's adapter into the base it started from with `colossal lora merge --model "
              "BASE_FOLDER --adapter SAVE_DIR/adapter --out DIR`"));
    if (lora)
      throw InputError(
          str("the checkpoint holds LoRA adapter tensors besides the model's (",
              name_list(unexpected, 2),
              "): it is from a LoRA run; fold the adapter in first with `colossal lora "
              "merge --model THIS_FOLDER --adapter SAVE_DIR/adapter --out DIR`"));
    throw InputError(str("checkpoint does not match the model", problems,
                         strict ? " (is it the right checkpoint for this model and config?)" : ""));
  }
  if (!missing.empty())
    log_warn("checkpoint lacks ", missing.size(), " model tensors: ", name_list(missing, 10));
  if (!unexpected.empty())
    log_warn("checkpoint has ", unexpected.size(),
             " tensors the model does not: ", name_list(unexpected, 10));
  at::NoGradGuard no_grad;
  for (auto& [n, dst] : state) {
    auto it = source.find(n);
    if (it == source.end()) continue;
    if (before_copy) before_copy(dst);
    dst.copy_(*it->second);
    // A mapped file's pages go back once copied: a load holds one tensor, not the file.
    release_mapped_pages(*it->second);
  }
}

std::string name_list(const std::vector<std::string>& names, size_t limit) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += str(" and ", names.size() - limit, " more");
  return out;
}

}  // namespace colossal::checkpoint
