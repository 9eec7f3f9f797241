// Parallel plans as data (torchtitan's parallelize + ColossalAI's policy files): a list of rules
// "module path pattern -> layer kind and/or shard kind", applied to a built model from outside,
// so the model's code never changes for a parallel layout, an adapter or a cast.
//
//   nn::ParallelPlan plan = models::tensor_parallel_plan(cfg);
//   nn::apply_plan(*model, plan, {.tp = dims.tp()});
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "colossal/dist/communicator.h"
#include "colossal/nn/module.h"

namespace colossal::nn {

// Builds the replacement of the module at `path` from the module that is there now (a LoRA
// linear wrapping it, an FP8 linear taking its weight, an expert FFN, ...).
using LayerFactory = std::function<std::shared_ptr<torch::nn::Module>(
    const std::string& path, const std::shared_ptr<torch::nn::Module>& current)>;

struct PlanRule {
  // A dotted module path where '*' stands for exactly one component:
  // "model.layers.*.self_attn.q_proj".
  std::string pattern;
  LayerFactory replace;                  // optional: swap the layer kind first
  std::optional<ShardSpec::Kind> shard;  // optional: then shard it over the plan's group
  // Copied into the shard spec (module.h): the vocabulary padding multiple of a Vocab or
  // Column head, and whether a Column head gathers its output.
  int64_t pad_multiple = 1;
  bool gather_output = false;
};
using ParallelPlan = std::vector<PlanRule>;

struct PlanOptions {
  dist::Communicator tp;  // what shard rules shard over; invalid or of size 1: they are skipped
  SequenceParallelMode sequence_parallel = SequenceParallelMode::Off;
  // Every rule must match a module. A pipeline stage, which holds only some blocks, turns it off
  // or, keeping the check for everything else, names what it dropped in absent_modules.
  bool every_rule_matches = true;
  // Module paths root lacks on purpose (a pipeline stage's dropped blocks:
  // models::CausalLM::dropped_blocks()): a rule that matches no module is accepted when it would
  // match one of these or a module under one, and no module of root sits at that place (a rule
  // "model.layers.*.x" on a stage holding some layers must match in them).
  std::vector<std::string> absent_modules;
};

// Whether `path` matches `pattern` ('*' = one whole component).
bool plan_matches(const std::string& pattern, const std::string& path);

// Applies every rule to every module of `root` whose path matches it, in the plan's order.
// A rule that matches no module (unless options.every_rule_matches is off or it falls under
// options.absent_modules), or a module that two
// rules would shard, is an InputError naming the pattern (a plan written for another model must not
// half-apply silently); a layer that cannot take its spec (sizes not divisible by the group) is an
// InputError naming its path. Returns the number of modules changed.
int64_t apply_plan(torch::nn::Module& root, const ParallelPlan& plan, const PlanOptions& options);

}  // namespace colossal::nn
