#include "colossal/booster/plugin.h"

#include <algorithm>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/data/dataloader.h"

namespace colossal::booster {

Precision precision_from_string(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "fp16") return Precision::FP16;
  if (s == "bf16") return Precision::BF16;
  throw InputError(str("unknown precision '", s, "' (expected fp32, fp16 or bf16)"));
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::FP32:
      return "fp32";
    case Precision::FP16:
      return "fp16";
    case Precision::BF16:
      return "bf16";
  }
  return "?";
}

at::ScalarType working_dtype(Precision p) {
  switch (p) {
    case Precision::FP16:
      return at::kHalf;
    case Precision::BF16:
      return at::kBFloat16;
    default:
      return at::kFloat;
  }
}

void Plugin::validate() const {
  auto precisions = supported_precisions();
  COLOSSAL_CHECK_INPUT(
      std::find(precisions.begin(), precisions.end(), precision()) != precisions.end(), "plugin '",
      name(), "' does not support precision '", to_string(precision()), "'");
  auto devices = supported_devices();
  COLOSSAL_CHECK_INPUT(std::find(devices.begin(), devices.end(), device()) != devices.end(),
                       "plugin '", name(), "' does not support device '", device(), "'");
  if (device() == "cuda")
    COLOSSAL_CHECK_INPUT(Accelerator::cuda().available(), "plugin '", name(),
                         "': device 'cuda' was requested but no CUDA device is visible");
}

PipelineOutput Plugin::execute_pipeline(const BatchIterator&, ModelWrapper&, const Criterion&,
                                        OptimizerWrapper*, bool, bool, const PipelineStep&) {
  throw InputError(str("plugin '", name(), "' has no pipeline stages (execute_pipeline)"));
}

std::shared_ptr<data::DataLoader> Plugin::prepare_dataloader(
    std::shared_ptr<data::TokenDataset> dataset, int64_t batch_size, bool shuffle, uint64_t seed,
    int64_t accumulation) const {
  COLOSSAL_CHECK_INPUT(batch_size >= 1, "prepare_dataloader: batch_size must be >= 1, got ",
                       batch_size);
  COLOSSAL_CHECK_INPUT(accumulation >= 1, "prepare_dataloader: accumulation must be >= 1, got ",
                       accumulation);
  data::SamplerOptions o;
  o.micro_batch = batch_size;
  o.dp_size = dp_size();
  o.dp_rank = dp_rank();
  o.accum = accumulation;
  o.shuffle = shuffle;
  o.seed = seed;
  return std::make_shared<data::DataLoader>(std::move(dataset), o);
}

}  // namespace colossal::booster
