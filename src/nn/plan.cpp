// Matching plan rules against module paths and applying them (replace, then shard).
#include "colossal/nn/plan.h"

#include <map>
#include <set>

#include "colossal/core/error.h"

namespace colossal::nn {

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (true) {
    size_t end = s.find('.', begin);
    out.push_back(s.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) return out;
    begin = end + 1;
  }
}

// Whether the first n components of `pattern` match those of `path` ('*' = any one).
bool prefix_matches(const std::vector<std::string>& pattern, const std::vector<std::string>& path,
                    size_t n) {
  if (pattern.size() < n || path.size() < n) return false;
  for (size_t i = 0; i < n; ++i)
    if (pattern[i] != "*" && pattern[i] != path[i]) return false;
  return true;
}

// Whether a rule that matched nothing may be meant for an absent module: its leading components
// match an absent path, and no present module of that place exists (one that did, e.g. an
// owned layer where "model.layers.*" also names dropped ones, would have shown the rule's rest
// wrong).
bool matches_absent(const std::string& pattern, const std::vector<std::string>& absent,
                    const std::vector<std::string>& present) {
  const std::vector<std::string> p = split(pattern);
  for (const std::string& a : absent) {
    const std::vector<std::string> q = split(a);
    if (!prefix_matches(p, q, q.size())) continue;
    bool testable = false;
    for (const std::string& path : present)
      if (prefix_matches(p, split(path), q.size())) testable = true;
    if (!testable) return true;
  }
  return false;
}

}  // namespace

bool plan_matches(const std::string& pattern, const std::string& path) {
  const std::vector<std::string> p = split(pattern), q = split(path);
  if (p.size() != q.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != "*" && p[i] != q[i]) return false;
  return true;
}

int64_t apply_plan(torch::nn::Module& root, const ParallelPlan& plan, const PlanOptions& options) {
  const bool shard = options.tp.valid() && options.tp.size() > 1;
  // Paths first (replacing a module changes the tree under it, not the paths of its siblings).
  std::vector<std::string> paths;
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    paths.push_back(item.key());
  std::map<std::string, std::string> sharded_by;  // path -> pattern
  int64_t changed = 0;
  for (const PlanRule& rule : plan) {
    COLOSSAL_CHECK_INPUT(rule.replace || rule.shard, "parallel plan rule '", rule.pattern,
                         "' neither replaces nor shards anything");
    int64_t hits = 0;
    for (const std::string& path : paths) {
      if (!plan_matches(rule.pattern, path)) continue;
      ++hits;
      if (rule.replace) {
        auto current = find_module(root, path);
        auto next = rule.replace(path, current);
        COLOSSAL_CHECK_INPUT(next != nullptr, "parallel plan rule '", rule.pattern,
                             "' built no module for ", path);
        replace_module(root, path, next);
        ++changed;
      }
      if (rule.shard && shard) {
        auto [it, fresh] = sharded_by.emplace(path, rule.pattern);
        COLOSSAL_CHECK_INPUT(fresh, "parallel plan: ", path, " is sharded by two rules, '",
                             it->second, "' and '", rule.pattern, "'");
        auto* layer = dynamic_cast<Module*>(find_module(root, path).get());
        COLOSSAL_CHECK_INPUT(layer != nullptr, "parallel plan rule '", rule.pattern, "': ", path,
                             " is not a colossal::nn layer and cannot be sharded");
        try {
          ShardSpec spec = ShardSpec::over(*rule.shard, options.tp, options.sequence_parallel);
          spec.pad_multiple = rule.pad_multiple;
          spec.gather_output = rule.gather_output;
          layer->shard(spec);
        } catch (const Error& e) {
          throw InputError(str("parallel plan rule '", rule.pattern, "' on ", path, " (",
                               to_string(*rule.shard), " over ", options.tp.size(),
                               " ranks): ", e.what()));
        }
        ++changed;
      }
    }
    COLOSSAL_CHECK_INPUT(hits > 0 || !options.every_rule_matches ||
                             matches_absent(rule.pattern, options.absent_modules, paths),
                         "parallel plan rule '", rule.pattern, "' matches no module of this model");
  }
  return changed;
}

}  // namespace colossal::nn
