// The plugin contract: what a parallel strategy tells the Booster about itself (precisions,
// devices, no_sync, checkpoint IO, pipelines) and how it wraps a model and an optimizer.
// An unsupported combination is rejected at boost() with a message naming plugin and option.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "colossal/amp/grad_scaler.h"
#include "colossal/dist/communicator.h"

namespace torch::nn {
class Module;
}
namespace colossal::optim {
class Optimizer;
}
namespace colossal::data {
class DataLoader;
class TokenDataset;
}  // namespace colossal::data

namespace colossal::booster {

enum class Precision { FP32, FP16, BF16 };
Precision precision_from_string(
    const std::string& s);  // "fp32" | "fp16" | "bf16"; InputError otherwise
const char* to_string(Precision p);
at::ScalarType working_dtype(Precision p);

// ColossalAI's dynamic loss-scale arguments (LowLevelZero/Gemini/Hybrid names and defaults):
// the scaler's own options, so nothing is copied field by field.
using LossScaleOptions = amp::DynamicGradScalerOptions;

class CheckpointIO;
class ModelWrapper;

// What one rank feeds the model out of a global micro-batch (Plugin::local_batch): the token ids,
// the targets of the positions whose logits this rank computes, and where `inputs` sit in the
// step's sequence (for sequence shards: the model's ForwardOptions::seq_offset / global_seq_len).
struct LocalBatch {
  at::Tensor inputs;
  at::Tensor targets;
  int64_t seq_offset = 0;
  int64_t global_seq_len = 0;  // 0: `inputs` hold the whole sequence
  // What the mean loss over `targets` is multiplied by before backward: this rank's share of the
  // loss of all the ranks holding parts of the same sequences (1 / tp under split_gather / ring;
  // 1 when the rank holds whole sequences). Report the unweighted mean.
  double loss_weight = 1.0;
  // The global position of each local token (int64 [S_local]; ForwardOptions::positions) when
  // they are not one contiguous run (ring_attn's zigzag shards); undefined otherwise.
  at::Tensor positions = {};
};
class OptimizerWrapper;

// What a loss is computed by: (model outputs, targets) -> scalar loss.
using Criterion = std::function<at::Tensor(const at::Tensor& outputs, const at::Tensor& targets)>;

// ColossalAI's data_iter of execute_pipeline: each call gives this data-parallel rank's next
// batch (token ids and next-token targets [B, S]), which the pipeline splits into micro-batches.
using BatchIterator = std::function<std::pair<at::Tensor, at::Tensor>()>;

// What a pipeline step also needs that ColossalAI's signature lacks.
struct PipelineStep {
  // Each micro-batch's loss is multiplied by this before backward (1 / accumulation when steps
  // are accumulated under no_sync); the reported loss is multiplied too.
  double loss_weight = 1.0;
  // The fused cross-entropy's chunk (tokens) when no criterion is given (0: one chunk).
  int64_t ce_chunk_tokens = 4096;
  // Masked targets (-100, a loss mask): counted_targets >= 0 is how many targets count in the
  // global batch of global_targets (G * S). Each micro-batch's loss is then its summed
  // cross-entropy divided by n_micro * counted / global, so that after the layout's averaging the
  // step's gradient and loss are the mean over the counted targets of the global batch, as the
  // trainer's non-pipeline path computes it. Takes no criterion. -1: each micro-batch's mean.
  int64_t counted_targets = -1;
  int64_t global_targets = 0;
};

// What execute_pipeline returns on every rank (ColossalAI returns it on the last stage only).
struct PipelineOutput {
  at::Tensor loss;                  // the step's loss (sum over micro-batches of mean / M)
  std::vector<at::Tensor> outputs;  // return_outputs: the last stage's logits per micro-batch
};

class Plugin {
 public:
  virtual ~Plugin() = default;
  virtual std::string name() const = 0;
  virtual std::vector<Precision> supported_precisions() const = 0;
  virtual std::vector<std::string> supported_devices() const = 0;  // "cpu", "cuda"
  virtual bool support_no_sync() const = 0;
  // Read by Booster::execute_pipeline (refused unless true).
  virtual bool support_pipeline() const { return false; }
  // ColossalAI's support_lora: Booster::enable_lora is refused unless true (none, ddp,
  // low_level_zero, gemini and hybrid say true; ColossalAI's Gemini does not support LoRA).
  virtual bool support_lora() const { return false; }
  // One training step through the pipeline (forward, backward, gradient synchronisation unless
  // inside no_sync); the optimizer step stays the caller's. Only plugins that support_pipeline().
  virtual PipelineOutput execute_pipeline(const BatchIterator& data_iter, ModelWrapper& model,
                                          const Criterion& criterion, OptimizerWrapper* optimizer,
                                          bool return_loss, bool return_outputs,
                                          const PipelineStep& step);
  // true: the Booster saves and loads through checkpoint_io() (ColossalAI's
  // control_checkpoint_io / get_checkpoint_io); false: through DataParallelCheckpointIO.
  virtual bool control_checkpoint_io() const { return false; }
  virtual std::shared_ptr<CheckpointIO> checkpoint_io() { return nullptr; }
  // The precision and device this plugin was configured with.
  virtual Precision precision() const = 0;
  virtual std::string device() const = 0;

  // Data-parallel coordinates for the dataloader and sample order.
  virtual int dp_rank() const = 0;
  virtual int dp_size() const = 0;

  // This rank's part of a data-parallel micro-batch (inputs and next-token targets [B, S], the
  // same on every rank of a tensor / sequence group). Identity for data-parallel plugins; the
  // sequence-parallel modes of the hybrid plugin split the sequence here. A rank backpropagates
  // the mean over its own targets times loss_weight.
  virtual LocalBatch local_batch(const at::Tensor& inputs, const at::Tensor& targets) const {
    return {inputs, targets, 0, 0, 1.0};
  }

  // Moves/casts the model in place (the module object stays the same), registers what the
  // strategy needs and returns the wrappers. `optimizer` may be null (inference).
  virtual std::shared_ptr<ModelWrapper> configure_model(
      std::shared_ptr<torch::nn::Module> model) = 0;
  virtual std::shared_ptr<OptimizerWrapper> configure_optimizer(
      std::shared_ptr<optim::Optimizer> optimizer, ModelWrapper& model) = 0;

  // Checks the combination of options against the capabilities above; throws InputError naming
  // the plugin and the option.
  void validate() const;

  // This rank's loader over `dataset` (ColossalAI's prepare_dataloader): micro-batches of
  // `batch_size` rows per rank, sample order by global position (see data/sampler.h), so the
  // samples of a step are the same for any number of data-parallel ranks. There is no
  // drop_last: epochs roll over seamlessly.
  std::shared_ptr<data::DataLoader> prepare_dataloader(std::shared_ptr<data::TokenDataset> dataset,
                                                       int64_t batch_size, bool shuffle = false,
                                                       uint64_t seed = 1024,
                                                       int64_t accumulation = 1) const;
};

}  // namespace colossal::booster
