// Which samples each data-parallel rank reads, as a pure function of the global position, so
// the data order never depends on world size or layout and resumes exactly from a step.
//
// Position of row i (of B) of dp rank r (of D) in micro-step a (of `accum`) of optimizer
// step s:  p = s*G + a*(D*B) + r*B + i, with G = B*D*accum.
// The sample read there: epoch e = p / N, j = p % N (N = number of samples); without shuffle
// it is j, with shuffle perm_e[j] where perm_e is a permutation of [0, N) seeded by
// (seed, e) only. So the union of samples over ranks in one step is the same for any D with
// the same global batch, and epochs roll over seamlessly.
#pragma once

#include <colossal/core/json.h>

#include <cstdint>
#include <vector>

namespace colossal::data {

struct SamplerOptions {
  int64_t num_samples = 0;
  int64_t micro_batch = 1;  // B, per rank
  int64_t dp_size = 1;      // D
  int64_t dp_rank = 0;      // r
  int64_t accum = 1;        // micro-steps per optimizer step
  bool shuffle = false;
  uint64_t seed = 1024;
};

class DistributedSampler {
 public:
  explicit DistributedSampler(SamplerOptions options);

  const SamplerOptions& options() const { return o_; }
  int64_t global_batch() const { return o_.micro_batch * o_.dp_size * o_.accum; }

  // The sample at global position p.
  int64_t sample_at(int64_t position) const;
  // This rank's B sample indices for micro-step a of optimizer step s.
  std::vector<int64_t> indices(int64_t step, int64_t micro_step) const;
  // The same for the sampler's own position, then advances by one micro-step (the optimizer
  // step advances after `accum` of them).
  std::vector<int64_t> next();

  int64_t step() const { return step_; }
  int64_t micro_step() const { return micro_; }
  int64_t epoch() const;  // epoch of the next position to read

  // {"step", "micro_step"} (+ seed and shuffle for a consistency check on load).
  json::Value state_dict() const;
  void load_state_dict(const json::Value& s);

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;
  SamplerOptions o_;
  int64_t step_ = 0, micro_ = 0;
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

// Deterministic permutation of [0, n) from (seed, epoch): Fisher-Yates driven by splitmix64
// with unbiased bounded draws (the same on every platform and compiler).
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace colossal::data
