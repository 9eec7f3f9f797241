// DataParallelCheckpointIO (see checkpoint_io.h): HF safetensors for the model, full-shape
// optimizer states, written by global rank 0.
#include "colossal/booster/checkpoint_io.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <filesystem>

#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/optim/lr_scheduler.h"
#include "colossal/optim/optimizer.h"

namespace colossal::booster {
namespace {

bool is_writer() {
  return !dist::is_initialized() || dist::rank() == 0;
}

void barrier() {
  if (dist::is_initialized() && dist::world_size() > 1) dist::world_cpu().barrier();
}

void write_text_atomic(const std::string& path, const std::string& text) {
  checkpoint::write_file_atomic(
      path, [&](int fd) { checkpoint::write_all(fd, text.data(), text.size(), path); });
}

}  // namespace

void DataParallelCheckpointIO::save_model(ModelWrapper& model, const std::string& dir, bool shard,
                                          int64_t size_per_shard_mb) {
  checkpoint::SaveOptions so;
  so.shard = shard;
  so.size_per_shard_mb = size_per_shard_mb;
  if (model.streams_weights()) {
    save_model_streamed(model, dir, so);
    return;
  }
  model.wait_weights();
  if (is_writer()) {
    if (auto lm = std::dynamic_pointer_cast<models::CausalLM>(model.module_ptr())) {
      checkpoint::save_pretrained(*lm, dir, so);
    } else {
      checkpoint::save_state_dict(dir, checkpoint::module_state(model.module()), so);
    }
  }
  barrier();
}

// Sharded weights (Gemini): one chunk gathered at a time, in the writer's order on every rank;
// the writer copies each tensor out before the next gather may release its chunk.
void DataParallelCheckpointIO::save_model_streamed(ModelWrapper& model, const std::string& dir,
                                                   const checkpoint::SaveOptions& so) {
  const checkpoint::TensorList state = checkpoint::module_state(model.module());
  std::vector<checkpoint::TensorDecl> decls;
  for (const auto& [n, t] : state) decls.push_back({n, t.scalar_type(), t.sizes().vec()});
  const checkpoint::StatePlan plan = checkpoint::plan_state_dict(decls, so);
  auto produce = [&](size_t i) {
    model.read_weight(state[i].second);
    // Valid until the next read_weight: the writer copies it at once (to the host, or to a
    // device snapshot under an asynchronous save).
    return state[i].second.detach();
  };
  try {
    if (is_writer()) {
      if (auto lm = std::dynamic_pointer_cast<models::CausalLM>(model.module_ptr())) {
        checkpoint::save_pretrained_streamed(*lm, dir, produce, so);
      } else {
        checkpoint::save_state_dict_streamed(dir, decls, produce, so);
      }
    } else {
      for (const auto& file : plan.order)
        for (size_t i : file) model.read_weight(state[i].second);
    }
  } catch (...) {
    model.end_weight_reads();
    throw;
  }
  model.end_weight_reads();
  barrier();
}

void DataParallelCheckpointIO::load_model(ModelWrapper& model, const std::string& path, bool strict,
                                          OptimizerWrapper* optimizer) {
  if (model.streams_weights()) {  // one chunk gathered at a time, written back on release
    try {
      checkpoint::load_into_module(
          model.module(), checkpoint::load_state_dict(path), strict,
          [&](const at::Tensor& dst) { model.read_weight(dst, /*write=*/true); });
    } catch (...) {
      model.end_weight_reads();
      throw;
    }
    model.end_weight_reads();
  } else {
    model.wait_weights();  // a late all-gather must not overwrite the loaded weights
    checkpoint::load_into_module(model.module(), checkpoint::load_state_dict(path), strict);
  }
  // fp32 masters follow the loaded weights (ColossalAI's update_master_params).
  if (optimizer) optimizer->sync_masters_from_params();
}

checkpoint::TensorList CheckpointIO::gather_model_tensors(
    ModelWrapper& model, const std::function<bool(const std::string&)>& select) {
  (void)model;
  (void)select;
  throw InputError(
      "this plugin's checkpoint IO cannot gather parts of the model (gather_model_tensors)");
}

checkpoint::TensorList DataParallelCheckpointIO::gather_model_tensors(
    ModelWrapper& model, const std::function<bool(const std::string&)>& select) {
  checkpoint::TensorList out;
  const bool writer = is_writer();
  const checkpoint::TensorList state = checkpoint::module_state(model.module());
  auto take = [&](const std::string& name, const at::Tensor& t) {
    if (writer)
      out.emplace_back(name, t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
  };
  if (!model.streams_weights()) {  // full on every rank once in-flight gathers landed
    model.wait_weights();
    for (const auto& [name, t] : state)
      if (select(name)) take(name, t);
    return out;
  }
  // Gemini: only the chunks holding selected tensors are gathered, one at a time, in the same
  // order on every rank; each tensor is copied before the next read may release its chunk.
  try {
    for (const auto& [name, t] : state) {
      if (!select(name)) continue;
      model.read_weight(t);
      take(name, t);
    }
  } catch (...) {
    model.end_weight_reads();
    throw;
  }
  model.end_weight_reads();
  return out;
}

bool FileStateSource::find(const std::string& name, std::vector<int64_t>* shape) const {
  const checkpoint::TensorInfo* info = reader_.find(name);
  if (!info) return false;
  if (shape) *shape = info->shape;
  return true;
}

void FileStateSource::read(const std::string& name, int64_t begin, const at::Tensor& out) const {
  reader_.read_slice(name, begin, out);
}

void DataParallelCheckpointIO::save_optimizer(OptimizerWrapper& optimizer, const std::string& dir) {
  OptimizerWrapper::FullStatePlan plan = optimizer.full_state_plan();
  // Checked on every rank before the first gather, so a bad dtype fails everywhere at once
  // instead of leaving the other ranks waiting in a gather.
  for (const auto& d : plan.tensors) checkpoint::dtype_to_safetensors(d.dtype);
  if (is_writer()) {
    std::filesystem::create_directories(dir);
    checkpoint::SafetensorsStreamWriter w(dir + "/optimizer.safetensors", plan.tensors,
                                          {{"format", "colossal-optimizer"}});
    while (!w.done()) w.write_next(optimizer.full_state_tensor(plan, w.next_index()));
    w.finish();
    json::Value scalars = plan.scalars;
    scalars.set("wrapper", optimizer.state());
    write_text_atomic(dir + "/optimizer.json", scalars.dump(2));
  } else {
    // The writer's order (file order), one collective per tensor.
    for (size_t i : checkpoint::safetensors_file_order(plan.tensors))
      optimizer.full_state_tensor(plan, i);
  }
  barrier();
}

void DataParallelCheckpointIO::load_optimizer(OptimizerWrapper& optimizer, const std::string& dir) {
  FileStateSource source(dir + "/optimizer.safetensors", json::parse_file(dir + "/optimizer.json"));
  optimizer.load_full_state(source);
  if (const json::Value* w = source.scalars().find("wrapper")) optimizer.load_state(*w);
}

void DataParallelCheckpointIO::save_lr_scheduler(optim::LRScheduler& scheduler,
                                                 const std::string& file) {
  if (is_writer()) write_text_atomic(file, scheduler.state_dict().dump(2));
  barrier();
}

void DataParallelCheckpointIO::load_lr_scheduler(optim::LRScheduler& scheduler,
                                                 const std::string& file) {
  scheduler.load_state_dict(json::parse_file(file));
}

}  // namespace colossal::booster
