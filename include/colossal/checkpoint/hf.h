// Hugging Face checkpoint layout: `model.safetensors`, or `model-0000k-of-0000N.safetensors`
// shards plus `model.safetensors.index.json` ({"metadata": {"total_size": bytes},
// "weight_map": {tensor: file}}), as transformers' save_pretrained writes and from_pretrained
// reads. Loading accepts a file, or a folder holding either layout.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "colossal/checkpoint/safetensors.h"

namespace torch::nn {
class Module;
}

namespace colossal::checkpoint {

// All tensors of a checkpoint: a .safetensors file, an index .json, or a folder.
TensorList load_state_dict(const std::string& file_or_dir);

// Selects tensors by name.
using NameFilter = std::function<bool(const std::string& name)>;

// The tensors of a checkpoint that `wanted` accepts (empty: all), for a rank that holds only
// some of them (a pipeline stage): with an index, a shard holding none of them is not opened
// (every listed shard must still exist). `names` (may be null) receives the name of every tensor
// of the checkpoint, in the index's or the file's order.
TensorList load_state_dict(const std::string& file_or_dir, const NameFilter& wanted,
                           std::vector<std::string>* names);

struct SaveOptions {
  bool shard = true;                 // false: always one model.safetensors
  int64_t size_per_shard_mb = 1024;  // ColossalAI's default; a shard is cut before it overflows
  std::string prefix = "model";      // file names: <prefix>.safetensors, <prefix>-0000k-of-0000N...
};

// Writes tensors in the HF layout into `dir` (created if needed). Every file is written
// atomically and the index last; stale shards of an earlier save with the same prefix are
// removed only after the new files are in place.
void save_state_dict(const std::string& dir, const TensorList& tensors,
                     const SaveOptions& opts = {});

// Where save_state_dict puts tensors known by name, dtype and shape: the file names, and per
// file the tensors (indices into the list) in the order their bytes are written. Every rank can
// compute it, so ranks that feed a writing rank (tensor-parallel gathers) follow its order.
struct StatePlan {
  std::vector<std::string> files;
  std::vector<std::vector<size_t>> order;
};
StatePlan plan_state_dict(const std::vector<TensorDecl>& tensors, const SaveOptions& opts = {});

// save_state_dict for tensors produced one at a time: `produce(i)` returns tensor i (of its
// declared dtype and shape); it is called once per tensor in plan_state_dict's order, and the
// tensor is written and released before the next call. save_state_dict is this with `produce`
// reading its list: both write identical files.
void save_state_dict_streamed(const std::string& dir, const std::vector<TensorDecl>& tensors,
                              const std::function<at::Tensor(size_t)>& produce,
                              const SaveOptions& opts = {});

// Copies checkpoint tensors into a module's parameters and buffers (named as
// module.named_parameters() / named_buffers() name them), converting dtype and device.
// strict: a missing or unexpected tensor or a shape mismatch is an InputError naming them all.
// `before_copy` (optional) is called with each destination tensor just before it is written, in
// module_state() order (sharded weights use it to gather one group at a time).
void load_into_module(torch::nn::Module& module, const TensorList& tensors, bool strict = true,
                      const std::function<void(const at::Tensor& dst)>& before_copy = {});

// Names for an error message: at most `limit` of them, then " and N more".
std::string name_list(const std::vector<std::string>& names, size_t limit = 50);

// The module's parameters and persistent buffers as a TensorList (no copies).
TensorList module_state(const torch::nn::Module& module);

}  // namespace colossal::checkpoint
