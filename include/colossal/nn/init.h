// Deterministic, name-keyed initialization and materialization of meta-built models.
// Every parameter draws from its own generator seeded by (seed, HF name), so the values do not
// depend on construction order, world size or layout: a shard gets exactly its slice of what
// the unsharded model would get.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace torch::nn {
class Module;
}

namespace colossal::nn {

struct InitOptions {
  uint64_t seed = 42;
  double std = 0.02;  // transformers' initializer_range
  // Where materialized (or re-initialized) parameters live; unset: where each one already is
  // (meta parameters then go to the CPU).
  std::optional<at::Device> device;
  std::optional<at::ScalarType> dtype;
};

// The generator seed of parameter `name` (FNV-1a of the name mixed with the seed).
uint64_t param_seed(uint64_t seed, const std::string& name);

// The full-shape initial value of one parameter, by HF's rule: Linear/Embedding weights
// normal(0, std) (the padding row of an embedding zero), norm weights one, biases zero. fp32, CPU.
at::Tensor init_value(const std::string& name, at::IntArrayRef full_shape, const InitOptions& opts,
                      std::optional<int64_t> padding_idx = std::nullopt);

// The initial values of many tensors, each init_value(name, shape, opts, padding_idx): made on
// the host by up to 8 threads at once in waves of one value per thread (values depend only on
// seed and name), and handed to install(i, value) on the calling thread in order, a wave at a
// time, so at most one value per thread is alive beyond what install keeps. A worker's error is
// rethrown on the calling thread.
struct InitValueJob {
  std::string name;
  std::vector<int64_t> shape;
  std::optional<int64_t> padding_idx;
};
void make_init_values(const std::vector<InitValueJob>& jobs, const InitOptions& opts,
                      const std::function<void(size_t, at::Tensor)>& install);

// Initializes every parameter of our layers under `root` (names relative to root, e.g.
// "model.layers.0.mlp.up_proj.weight"). Meta parameters are replaced by real storage (the model
// is "materialized"); real ones are filled in place (identity kept). Parameters of modules that
// are not colossal::nn layers are an Error (we do not know their init rule).
void init_parameters(torch::nn::Module& root, const InitOptions& opts = {});

// True if any parameter is still on the meta device.
bool has_meta_parameters(const torch::nn::Module& root);

}  // namespace colossal::nn
