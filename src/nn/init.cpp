// Name-keyed initialization and meta materialization.
#include "colossal/nn/init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <exception>
#include <optional>
#include <thread>

#include "colossal/core/error.h"
#include "colossal/nn/layers.h"

namespace colossal::nn {

uint64_t param_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  // splitmix64 of the combination, so nearby seeds give unrelated streams.
  uint64_t z = h + 0x9e3779b97f4a7c15ull * (seed + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

namespace {
bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}
}  // namespace

at::Tensor init_value(const std::string& name, at::IntArrayRef shape, const InitOptions& opts,
                      std::optional<int64_t> padding_idx) {
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (ends_with(name, ".bias") || name == "bias") return at::zeros(shape, f32);
  if (ends_with(name, "norm.weight") || ends_with(name, "layernorm.weight"))
    return at::ones(shape, f32);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(param_seed(opts.seed, name));
  at::Tensor t = at::empty(shape, f32);
  t.normal_(0.0, opts.std, gen);
  if (padding_idx) t.select(0, *padding_idx).zero_();
  return t;
}

void init_parameters(torch::nn::Module& root, const InitOptions& opts) {
  at::NoGradGuard ng;
  // The root by reference (it need not live in a shared_ptr), then every descendant.
  std::vector<std::pair<std::string, torch::nn::Module*>> all{{"", &root}};
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    all.emplace_back(item.key(), item.value().get());
  struct Job {
    Module* mod;
    std::string key, full_name;
    std::vector<int64_t> full_shape;
    std::optional<int64_t> pad;
  };
  std::vector<Job> jobs;
  for (const auto& [prefix, raw] : all) {
    auto* mod = dynamic_cast<Module*>(raw);
    auto own = raw->named_parameters(/*recurse=*/false);
    if (own.is_empty()) continue;
    COLOSSAL_CHECK(mod, "init_parameters: module '", prefix,
                   "' is not a colossal::nn layer; initialize it yourself");
    std::optional<int64_t> pad;
    if (auto* e = dynamic_cast<Embedding*>(mod)) pad = e->padding_idx();
    for (const auto& p : own)
      jobs.push_back({mod, p.key(), prefix.empty() ? p.key() : prefix + "." + p.key(),
                      mod->full_shape(p.key()), pad});
  }
  // Values depend only on (seed, name), so make_init_values makes them on several threads at
  // once (a 13b model is 13 G normal samples and 52 GB of fresh pages).
  std::vector<InitValueJob> values;
  values.reserve(jobs.size());
  for (const Job& job : jobs) values.push_back({job.full_name, job.full_shape, job.pad});
  make_init_values(values, opts, [&](size_t j, at::Tensor value) {
    Job& job = jobs[j];
    const at::Tensor cur = job.mod->named_parameters(/*recurse=*/false)[job.key];
    at::Tensor v = job.mod->shard_slice(job.key, value);
    value = at::Tensor();
    COLOSSAL_CHECK(v.sizes() == cur.sizes(), "init_parameters: ", job.full_name, " has shape ",
                   cur.sizes(), " but its initial value has ", v.sizes());
    at::ScalarType dt = opts.dtype.value_or(cur.scalar_type());
    at::Device dev = opts.device.value_or(cur.is_meta() ? at::Device(at::kCPU) : cur.device());
    v = v.to(dev, dt).contiguous();
    if (cur.is_meta() || cur.device() != dev) {
      job.mod->replace_parameter(job.key, v);
    } else if (cur.scalar_type() != dt) {
      const_cast<at::Tensor&>(cur).set_data(v);
    } else {
      const_cast<at::Tensor&>(cur).copy_(v);
    }
  });
}

void make_init_values(const std::vector<InitValueJob>& jobs, const InitOptions& opts,
                      const std::function<void(size_t, at::Tensor)>& install) {
  at::NoGradGuard ng;
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
  for (size_t first = 0; first < jobs.size(); first += threads) {
    const size_t last = std::min(jobs.size(), first + threads);
    std::vector<at::Tensor> values(last - first);
    std::vector<std::exception_ptr> errors(last - first);
    std::vector<std::thread> pool;
    for (size_t j = first; j < last; ++j)
      pool.emplace_back([&, j] {
        try {
          at::NoGradGuard worker_ng;
          values[j - first] = init_value(jobs[j].name, jobs[j].shape, opts, jobs[j].padding_idx);
        } catch (...) {
          errors[j - first] = std::current_exception();
        }
      });
    for (auto& t : pool) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    for (size_t j = first; j < last; ++j) install(j, std::move(values[j - first]));
  }
}

bool has_meta_parameters(const torch::nn::Module& root) {
  for (const auto& p : root.parameters()) {
    if (p.is_meta()) return true;
  }
  return false;
}

}  // namespace colossal::nn
