// Global-position sampler (formula in the header) and its seeded permutation.
#include "colossal/data/sampler.h"

#include "colossal/core/error.h"

namespace colossal::data {
namespace {
uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
// Uniform in [0, bound) without modulo bias (rejection on the 64-bit range).
uint64_t bounded(uint64_t& s, uint64_t bound) {
  uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  while (true) {
    uint64_t r = splitmix64(s);
    if (r < limit) return r % bound;
  }
}
}  // namespace

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  uint64_t s = seed;
  uint64_t mix = static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ULL;
  s ^= splitmix64(mix);
  for (int64_t i = n - 1; i > 0; --i) {
    int64_t j = static_cast<int64_t>(bounded(s, static_cast<uint64_t>(i + 1)));
    std::swap(p[i], p[j]);
  }
  return p;
}

DistributedSampler::DistributedSampler(SamplerOptions o) : o_(o) {
  COLOSSAL_CHECK_INPUT(o.num_samples >= 1, "sampler: the dataset has no samples (num_samples ",
                       o.num_samples, ")");
  COLOSSAL_CHECK_INPUT(o.micro_batch >= 1, "sampler: micro batch must be >= 1, got ",
                       o.micro_batch);
  COLOSSAL_CHECK_INPUT(o.dp_size >= 1, "sampler: dp size must be >= 1, got ", o.dp_size);
  COLOSSAL_CHECK_INPUT(o.dp_rank >= 0 && o.dp_rank < o.dp_size, "sampler: dp rank ", o.dp_rank,
                       " out of range [0, ", o.dp_size, ")");
  COLOSSAL_CHECK_INPUT(o.accum >= 1, "sampler: gradient accumulation must be >= 1, got ", o.accum);
}

const std::vector<int64_t>& DistributedSampler::permutation(int64_t epoch) const {
  if (perm_epoch_ != epoch) {
    perm_ = seeded_permutation(o_.num_samples, o_.seed, epoch);
    perm_epoch_ = epoch;
  }
  return perm_;
}

int64_t DistributedSampler::sample_at(int64_t p) const {
  COLOSSAL_CHECK(p >= 0, "sampler: negative position ", p);
  int64_t e = p / o_.num_samples, j = p % o_.num_samples;
  return o_.shuffle ? permutation(e)[j] : j;
}

std::vector<int64_t> DistributedSampler::indices(int64_t s, int64_t a) const {
  COLOSSAL_CHECK(s >= 0 && a >= 0 && a < o_.accum, "sampler: bad (step ", s, ", micro step ", a,
                 ")");
  std::vector<int64_t> out;
  int64_t base = s * global_batch() + a * o_.dp_size * o_.micro_batch + o_.dp_rank * o_.micro_batch;
  for (int64_t i = 0; i < o_.micro_batch; ++i) out.push_back(sample_at(base + i));
  return out;
}

std::vector<int64_t> DistributedSampler::next() {
  auto out = indices(step_, micro_);
  if (++micro_ == o_.accum) {
    micro_ = 0;
    ++step_;
  }
  return out;
}

int64_t DistributedSampler::epoch() const {
  int64_t p = step_ * global_batch() + micro_ * o_.dp_size * o_.micro_batch;
  return p / o_.num_samples;
}

json::Value DistributedSampler::state_dict() const {
  json::Value s = json::Value::object();
  s.set("step", step_);
  s.set("micro_step", micro_);
  s.set("shuffle", o_.shuffle);
  s.set("seed", static_cast<int64_t>(o_.seed));
  return s;
}

void DistributedSampler::load_state_dict(const json::Value& s) {
  int64_t st = s.at("step").as_int("sampler 'step'");
  int64_t mi = s.at("micro_step").as_int("sampler 'micro_step'");
  COLOSSAL_CHECK_INPUT(st >= 0 && mi >= 0 && mi < o_.accum, "sampler state: bad position (step ",
                       st, ", micro_step ", mi, ") for accumulation ", o_.accum);
  if (const auto* sh = s.find("shuffle"))
    COLOSSAL_CHECK_INPUT(sh->as_bool("sampler 'shuffle'") == o_.shuffle,
                         "sampler state was saved with shuffle=", sh->as_bool(),
                         " but this run has shuffle=", o_.shuffle);
  if (const auto* sd = s.find("seed"))
    COLOSSAL_CHECK_INPUT(static_cast<uint64_t>(sd->as_int("sampler 'seed'")) == o_.seed,
                         "sampler state was saved with seed ", sd->as_int(),
                         " but this run has seed ", o_.seed);
  step_ = st;
  micro_ = mi;
}

}  // namespace colossal::data
