// LoRA layers (colossal/nn/lora.h).
#include "colossal/nn/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "colossal/core/error.h"
#include "colossal/nn/parallel_ops.h"
#include "colossal/nn/quantized_linear.h"
#include "colossal/nn/ring_ops.h"

namespace colossal::nn {

bool is_lora_parameter(std::string_view name) {
  return name.find(".lora_A.") != std::string_view::npos ||
         name.find(".lora_B.") != std::string_view::npos;
}

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r))
                    : lora_alpha / static_cast<double>(r);
}

void LoraConfig::validate() const {
  COLOSSAL_CHECK_INPUT(r > 0, "LoRA: r must be > 0, got ", r);
  COLOSSAL_CHECK_INPUT(std::isfinite(lora_alpha) && lora_alpha > 0,
                       "LoRA: lora_alpha must be a finite number > 0, got ", lora_alpha);
  COLOSSAL_CHECK_INPUT(lora_dropout >= 0 && lora_dropout < 1,
                       "LoRA: lora_dropout must be in [0, 1), got ", lora_dropout);
  COLOSSAL_CHECK_INPUT(!target_modules.empty(),
                       "LoRA: target_modules is empty (name the linear layers to adapt, e.g. "
                       "q_proj,k_proj,v_proj,o_proj)");
  COLOSSAL_CHECK_INPUT(bias == "none", "LoRA: bias '", bias,
                       "' is not supported (only 'none': biases stay frozen)");
  COLOSSAL_CHECK_INPUT(init == "default" || init == "gaussian", "LoRA: init '", init,
                       "' is not supported (default | gaussian)");
}

namespace {

// The base's options with meta storage: the constructor re-points weight and bias at the base's
// own tensors, so nothing is allocated for them.
LinearOptions on_meta(LinearOptions o) {
  o.tensor_options(at::TensorOptions().device(at::kMeta));
  return o;
}

}  // namespace

LoraLinear::LoraLinear(const Linear& base, const LoraConfig& cfg, uint64_t seed)
    : Linear(on_meta(base.options())),
      r_(cfg.r),
      scaling_(cfg.scaling()),
      dropout_(cfg.lora_dropout) {
  cfg.validate();
  COLOSSAL_CHECK_INPUT(
      !base.shard_spec(),
      "LoRA: the layer is sharded already; apply LoRA to the whole model before the plugin "
      "shards it (the plugin shards each adapter with its base)");
  at::TensorOptions wopts;
  if (auto* qb = dynamic_cast<const QuantizedLinear*>(&base)) {
    quantized_base_ = std::dynamic_pointer_cast<QuantizedLinear>(
        std::const_pointer_cast<torch::nn::Module>(qb->shared_from_this()));
    COLOSSAL_CHECK(quantized_base_, "LoRA: the quantized base must be held by a shared_ptr");
    COLOSSAL_CHECK_INPUT(qb->has_weight(), "LoRA: the quantized base ", base.name(),
                         " holds no weight yet (load the model before applying LoRA)");
    parameters_.erase("weight");
    wopts = qb->weight_options();
  } else {
    replace_parameter("weight", base.weight());
    wopts = base.weight().options();
  }
  if (has_bias()) replace_parameter("bias", base.param("bias"));
  const at::TensorOptions opts = wopts.requires_grad(false);
  lora_A = register_module(
      "lora_A",
      std::make_shared<Linear>(LinearOptions(in_features(), r_).bias(false).tensor_options(opts)));
  lora_B = register_module(
      "lora_B",
      std::make_shared<Linear>(LinearOptions(r_, out_features()).bias(false).tensor_options(opts)));
  // On a meta base the adapters stay meta (shapes only); otherwise A is drawn on a CPU generator
  // in fp32 (the same values on any device), then cast, and B is zero.
  if (!wopts.device().is_meta()) {
    at::NoGradGuard ng;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    at::Tensor a = at::empty({r_, in_features()}, at::kFloat);
    if (cfg.init == "gaussian") {
      a.normal_(0.0, 1.0 / static_cast<double>(r_), gen);
    } else {
      // kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in).
      const double bound = 1.0 / std::sqrt(static_cast<double>(in_features()));
      a.uniform_(-bound, bound, gen);
    }
    lora_A->weight().set_data(a.to(wopts));
    lora_B->weight().set_data(at::zeros({out_features(), r_}, wopts));
  }
  for (auto& p : parameters(true)) p.set_requires_grad(false);
  lora_A->weight().set_requires_grad(true);
  lora_B->weight().set_requires_grad(true);
}

at::Tensor LoraLinear::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (shard_spec_ && shard_spec_->communicates()) return sharded_forward(x);
  at::Tensor y;
  if (quantized_base_) {
    y = quantized_base_->matmul_weight(x, has_bias() ? param("bias") : at::Tensor());
  } else {
    y = local_linear(x, true);
  }
  at::Tensor h = lora_A->forward(dropout_ > 0 ? at::dropout(x, dropout_, is_training()) : x);
  // PEFT's order of operations, except where the fused kernels run (CUDA): there a plain B
  // computes y + scaling * h B^T as one GEMM accumulating into y (addmm, beta 1, alpha
  // scaling) instead of a GEMM, a scale and an add over the [tokens, out] output (two
  // memory-bound passes per adapter). B's hooks fire as if its forward ran.
  if (!use_fused_kernels(y) || !lora_B->fusable() || y.scalar_type() != h.scalar_type())
    return y + lora_B->forward(h) * scaling_;
  ForwardScope b_scope(*lora_B);
  const int64_t out = y.size(-1);
  at::Tensor y2 = at::addmm(y.reshape({-1, out}), h.reshape({-1, h.size(-1)}), lora_B->weight().t(),
                            1.0, scaling_);
  return y2.view(y.sizes());
}

std::optional<Linear::LowRankAddition> LoraLinear::low_rank_addition() {
  // Each adapter draws its own dropout mask; a quantized base has no weight for the fused GEMM;
  // a tensor-parallel layer runs its own region operations.
  if (dropout_ > 0 || quantized_base_ || shard_spec_) return std::nullopt;
  return LowRankAddition{lora_A.get(), lora_B.get(), scaling_};
}

void LoraLinear::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  Linear::to(device, dtype, non_blocking);
  if (quantized_base_) quantized_base_->to(device, non_blocking);
}

void LoraLinear::to(torch::Dtype dtype, bool non_blocking) {
  Linear::to(dtype, non_blocking);
}

void LoraLinear::to(torch::Device device, bool non_blocking) {
  Linear::to(device, non_blocking);
  if (quantized_base_) quantized_base_->to(device, non_blocking);
}

at::Tensor LoraLinear::sharded_forward(const at::Tensor& x) {
  const ShardSpec& s = *shard_spec_;
  const auto mode = s.sequence_parallel;
  // The adapter's own hooks fire around the reads of A and B, as if their forwards ran.
  ForwardScope scope_a(*lora_A), scope_b(*lora_B);
  auto drop = [&](const at::Tensor& t) {
    return dropout_ > 0 ? at::dropout(t, dropout_, is_training()) : t;
  };
  const at::Tensor w = region_param("weight");
  const at::Tensor b = has_bias() ? region_param("bias") : at::Tensor();
  if (s.kind == ShardSpec::Kind::Column) {
    // A whole, its gradient summed over the group (copy_to_region); B this rank's rows.
    const at::Tensor a = lora_A->region_param("weight"), bl = lora_B->region_param("weight");
    if (mode == SequenceParallelMode::Ring) {
      // The base's gather runs chunk by chunk inside its GEMM; the adapter gathers its [.., r]
      // activation of this rank's tokens instead.
      at::Tensor y = ring_gather_linear(x, w, s.group, 1);
      if (b.defined()) y = y + b;
      const at::Tensor h = gather_from_sequence(at::linear(drop(x), a), s.group, 1);
      return y + at::linear(h, bl) * scaling_;
    }
    // The input the base's GEMM reads: it enters the region once, and its gradient (the base's
    // and the adapter's partial ones) is summed over the group once.
    const at::Tensor in = mode == SequenceParallelMode::SplitGather
                              ? gather_from_sequence(x, s.group, 1)
                              : copy_to_region(x, s.group);
    const at::Tensor y = b.defined() ? at::linear(in, w, b) : at::linear(in, w);
    return y + at::linear(at::linear(drop(in), a), bl) * scaling_;
  }
  // Row: A this rank's columns, B whole with its gradient summed over the group.
  const at::Tensor a = lora_A->region_param("weight"), bw = lora_B->region_param("weight");
  const at::Tensor h = at::linear(drop(x), a);  // this rank's partial sum of x A^T
  at::Tensor y;
  if (mode == SequenceParallelMode::Ring) {
    // The base's reduce-scatter runs inside its chunked GEMM; the adapter reduce-scatters its
    // [.., r] partial sums and applies B to this rank's tokens.
    y = ring_linear_reduce_scatter(x, w, s.group, 1) +
        at::linear(reduce_scatter_sequence(h, s.group, 1), bw) * scaling_;
  } else {
    // The adapter's partial products join the base's before the one reduction.
    y = at::linear(x, w) + at::linear(h, bw) * scaling_;
    y = mode == SequenceParallelMode::SplitGather ? reduce_scatter_sequence(y, s.group, 1)
                                                  : reduce_from_region(y, s.group);
  }
  return b.defined() ? y + b : y;
}

void LoraLinear::shard(const ShardSpec& spec) {
  COLOSSAL_CHECK_INPUT(spec.pad_multiple == 1 && !spec.gather_output, "LoRA: ", name(),
                       " cannot be sharded with a vocabulary head's options (pad_multiple ",
                       spec.pad_multiple, ", gather_output ", spec.gather_output ? "true" : "false",
                       "): tensor-parallel LoRA adapts column and row projections, not a "
                       "padded or gathered head");
  COLOSSAL_CHECK_INPUT(!quantized_base_, "LoRA: ", name(),
                       " has a quantized base (QLoRA); tensor-parallel QLoRA is not supported "
                       "(train it with tp_size 1)");
  Linear::shard(spec);
  ShardSpec child = spec;
  child.kind = ShardSpec::Kind::Column;
  // Column base: B's rows follow the base's output heads, A is one replicated head. Row base:
  // A's columns follow the base's input, B is one replicated head.
  const bool column = spec.kind == ShardSpec::Kind::Column;
  lora_A->set_heads(1);
  lora_B->set_heads(column ? options().heads() : 1);
  ShardSpec a = child;
  if (!column) a.kind = ShardSpec::Kind::Row;
  lora_A->shard(a);
  lora_B->shard(child);
}

namespace {

// "lora_A.weight" -> (child, "weight"); nullptr for the base's own names.
std::pair<const Linear*, std::string> adapter_param(const LoraLinear& l, const std::string& name) {
  for (const auto& [prefix, child] :
       {std::pair<std::string, const Linear*>{"lora_A.", l.lora_A.get()},
        std::pair<std::string, const Linear*>{"lora_B.", l.lora_B.get()}})
    if (name.rfind(prefix, 0) == 0) return {child, name.substr(prefix.size())};
  return {nullptr, name};
}

}  // namespace

at::Tensor LoraLinear::shard_slice(const std::string& name, const at::Tensor& full) const {
  auto [child, key] = adapter_param(*this, name);
  return child ? child->shard_slice(key, full) : Linear::shard_slice(name, full);
}

std::vector<int64_t> LoraLinear::full_shape(const std::string& name) const {
  auto [child, key] = adapter_param(*this, name);
  return child ? child->full_shape(key) : Linear::full_shape(name);
}

int64_t LoraLinear::replication(const std::string& name) const {
  auto [child, key] = adapter_param(*this, name);
  return child ? child->replication(key) : Linear::replication(name);
}

std::vector<std::string> apply_lora(torch::nn::Module& root, const LoraConfig& cfg, uint64_t seed) {
  cfg.validate();
  std::vector<std::string> paths, linears;
  std::set<std::string> matched;
  const std::set<std::string> targets(cfg.target_modules.begin(), cfg.target_modules.end());
  for (const auto& item : root.named_modules("", false)) {
    auto lin = std::dynamic_pointer_cast<Linear>(item.value());
    if (!lin) continue;
    const std::string& path = item.key();
    const std::string last =
        path.substr(path.rfind('.') == std::string::npos ? 0 : path.rfind('.') + 1);
    if (path.find(".lora_A") != std::string::npos || path.find(".lora_B") != std::string::npos)
      continue;
    linears.push_back(last);
    if (!targets.count(last)) continue;
    COLOSSAL_CHECK_INPUT(!std::dynamic_pointer_cast<LoraLinear>(lin), "LoRA: ", path,
                         " already has a LoRA adapter");
    COLOSSAL_CHECK_INPUT(!lin->shard_spec(), "LoRA: ", path,
                         " is sharded already; apply LoRA to the whole model before the "
                         "plugin shards it (the plugin shards each adapter with its base)");
    matched.insert(last);
    paths.push_back(path);
  }
  std::sort(linears.begin(), linears.end());
  linears.erase(std::unique(linears.begin(), linears.end()), linears.end());
  std::string known;
  for (const auto& l : linears) known += (known.empty() ? "" : ", ") + l;
  for (const auto& t : cfg.target_modules) {
    COLOSSAL_CHECK_INPUT(matched.count(t), "LoRA: target module '", t,
                         "' matches no linear layer of the model (its linear layers: ", known, ")");
  }
  for (auto& p : root.parameters(true)) p.set_requires_grad(false);
  uint64_t k = 0;
  for (const auto& path : paths) {
    auto lin = std::dynamic_pointer_cast<Linear>(find_module(root, path));
    replace_module(root, path, std::make_shared<LoraLinear>(*lin, cfg, seed + 1000003 * k++));
  }
  return paths;
}

std::vector<std::string> merge_lora(torch::nn::Module& root) {
  std::vector<std::string> paths;
  for (const auto& item : root.named_modules("", false))
    if (std::dynamic_pointer_cast<LoraLinear>(item.value())) paths.push_back(item.key());
  at::NoGradGuard ng;
  for (const auto& path : paths) {
    auto lora = std::dynamic_pointer_cast<LoraLinear>(find_module(root, path));
    COLOSSAL_CHECK_INPUT(!lora->shard_spec(), "LoRA: merge ", path,
                         ": the layer is sharded; merge the whole model (load its checkpoint "
                         "folder, which is saved whole)");
    const at::Tensor w = lora->quantized_base()
                             ? lora->quantized_base()->dequantized_weight(
                                   lora->quantized_base()->weight_options().dtype().toScalarType())
                             : lora->weight();
    at::Tensor delta =
        at::mm(lora->lora_B->weight().to(at::kFloat), lora->lora_A->weight().to(at::kFloat)) *
        lora->scaling();
    auto plain = std::make_shared<Linear>(on_meta(lora->options()));
    plain->replace_parameter("weight",
                             (w.to(at::kFloat) + delta.to(w.device())).to(w.scalar_type()));
    if (lora->has_bias()) plain->replace_parameter("bias", lora->param("bias"));
    replace_module(root, path, plain);
  }
  return paths;
}

}  // namespace colossal::nn
