// A rank's stream of micro-batches: a TokenDataset read in the order of a DistributedSampler
// (global positions, so the samples of a step never depend on the number of ranks). Made by
// Plugin::prepare_dataloader, which fills in the data-parallel rank and size.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>

#include "colossal/core/json.h"
#include "colossal/data/sampler.h"
#include "colossal/data/token_file.h"

namespace colossal::data {

class DataLoader {
 public:
  DataLoader(std::shared_ptr<TokenDataset> dataset, SamplerOptions options);

  // This rank's next micro-batch {inputs, targets}, each int64 [micro_batch, seq_len] on the CPU.
  std::pair<at::Tensor, at::Tensor> next();
  // The same with the dataset's document fields (Batch).
  Batch next_batch();
  // The targets that count (TokenDataset::counted_targets) in the whole global batch of the
  // step about to be read, over every data-parallel rank's samples (the sampler knows them all):
  // the same number on every rank, without communication. Call at a step boundary.
  int64_t counted_targets_of_step() const;

  const TokenDataset& dataset() const { return *dataset_; }
  DistributedSampler& sampler() { return sampler_; }
  const DistributedSampler& sampler() const { return sampler_; }
  int64_t micro_batch() const { return sampler_.options().micro_batch; }

  // The read position (for training checkpoints).
  json::Value state_dict() const { return sampler_.state_dict(); }
  void load_state_dict(const json::Value& s) { sampler_.load_state_dict(s); }

 private:
  std::shared_ptr<TokenDataset> dataset_;
  DistributedSampler sampler_;
};

}  // namespace colossal::data
