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

}  // namespace colossal::data
