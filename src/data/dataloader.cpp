#include "colossal/data/dataloader.h"

#include "colossal/core/error.h"

namespace colossal::data {

DataLoader::DataLoader(std::shared_ptr<TokenDataset> dataset, SamplerOptions options)
    : dataset_(std::move(dataset)), sampler_([&] {
        COLOSSAL_CHECK(dataset_, "DataLoader: dataset is null");
        options.num_samples = dataset_->num_samples();
        return options;
      }()) {}

std::pair<at::Tensor, at::Tensor> DataLoader::next() {
  return dataset_->batch(sampler_.next());
}

Batch DataLoader::next_batch() {
  return dataset_->make_batch(sampler_.next());
}

int64_t DataLoader::counted_targets_of_step() const {
  COLOSSAL_CHECK(sampler_.micro_step() == 0, "counted_targets_of_step: the loader is ",
                 sampler_.micro_step(), " micro-steps into step ", sampler_.step());
  const int64_t G = sampler_.global_batch(), first = sampler_.step() * G;
  int64_t n = 0;
  for (int64_t p = first; p < first + G; ++p) n += dataset_->counted_targets(sampler_.sample_at(p));
  return n;
}

}  // namespace colossal::data
