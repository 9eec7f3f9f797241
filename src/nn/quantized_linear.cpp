// Quantized frozen linear layers (colossal/nn/quantized_linear.h).
#include "colossal/nn/quantized_linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <set>
#include <typeinfo>
#include <utility>

#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/kernels/quant.h"
#include "colossal/nn/lora.h"

namespace colossal::nn {

namespace {

constexpr double kFp8Max = 448.0;  // the largest finite float8_e4m3fn

LinearOptions meta_options(LinearOptions o) {
  o.tensor_options(at::TensorOptions().device(at::kMeta));
  return o;
}

// y = x W^T (+ b) with W dequantized from `storage` in the forward and again in the backward: the
// autograd graph keeps the quantized tensors (which the layer holds anyway), never W.
// storage: nf4 {codes, absmax, absmax2 (empty without double quantisation), dmap}, fp8 {codes,
// scale}; meta: {kind (0 nf4, 1 fp8), out, in, blocksize, blocksize2} and the nf4 offset.
struct DequantLinear : torch::autograd::Function<DequantLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias,
                            const std::vector<at::Tensor>& storage,
                            const std::vector<int64_t>& meta, double offset) {
    ctx->save_for_backward(storage);
    ctx->saved_data["meta"] = meta;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["bias_grad"] = bias && bias->requires_grad();
    const at::Tensor w = weight(storage, meta, offset, x.scalar_type());
    return bias ? at::linear(x, w, *bias) : at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const at::Tensor& dy = grad[0];
    at::Tensor dx, db;
    if (dy.defined()) {
      const auto meta = ctx->saved_data["meta"].toIntVector();
      const double offset = ctx->saved_data["offset"].toDouble();
      dx = at::matmul(dy, weight(ctx->get_saved_variables(), meta, offset, dy.scalar_type()));
      if (ctx->saved_data["bias_grad"].toBool()) db = dy.reshape({-1, dy.size(-1)}).sum(0);
    }
    return {dx, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
  static at::Tensor weight(const std::vector<at::Tensor>& s, const std::vector<int64_t>& meta,
                           double offset, at::ScalarType dtype) {
    if (meta[0] == 1) return kernels::dequantize_fp8_rows(s[0], s[1], dtype);
    kernels::NF4View v;
    v.codes = s[0];
    v.absmax = s[1];
    if (s[2].defined() && s[2].numel() > 0) {
      v.absmax2 = s[2];
      v.dmap = s[3];
    }
    v.offset = static_cast<float>(offset);
    v.numel = meta[1] * meta[2];
    v.blocksize = meta[3];
    v.blocksize2 = meta[4];
    return kernels::dequantize_nf4(v, dtype).view({meta[1], meta[2]});
  }
};

}  // namespace

void QuantizeConfig::validate() const {
  COLOSSAL_CHECK_INPUT(kind == "nf4" || kind == "fp8", "quantize: kind '", kind,
                       "' is not supported (nf4 | fp8)");
  COLOSSAL_CHECK_INPUT(blocksize > 0 && blocksize % 2 == 0,
                       "quantize: blocksize must be positive and even, got ", blocksize);
}

QuantizedLinear::QuantizedLinear(const LinearOptions& options, const QuantizeConfig& cfg)
    : Linear(meta_options(options)), cfg_(cfg) {
  cfg_.validate();
  parameters_.erase("weight");
  if (has_bias()) {
    replace_parameter("bias", at::empty({out_features()}, options.tensor_options()));
    param("bias").set_requires_grad(false);
  }
}

std::shared_ptr<QuantizedLinear> QuantizedLinear::from(const Linear& base,
                                                       const QuantizeConfig& cfg) {
  COLOSSAL_CHECK_INPUT(!base.shard_spec(), "quantize: ", base.name(),
                       " is sharded; quantize the model before the plugin shards it");
  LinearOptions o = base.options();
  o.tensor_options(at::TensorOptions().device(at::kMeta));
  auto q = std::make_shared<QuantizedLinear>(o, cfg);
  if (base.has_bias()) q->replace_parameter("bias", base.param("bias"));
  if (!base.weight().is_meta()) q->set_weight(base.weight());
  return q;
}

void QuantizedLinear::set_weight(const at::Tensor& w) {
  COLOSSAL_CHECK_INPUT(w.dim() == 2 && w.size(0) == out_features() && w.size(1) == in_features(),
                       "quantize: weight of ", name(), " has shape ", w.sizes(), "; expected [",
                       out_features(), ", ", in_features(), "]");
  at::NoGradGuard ng;
  if (cfg_.kind == "nf4") {
    nf4_ = quantize_nf4(w, cfg_.blocksize, cfg_.double_quant);
    return;
  }
  at::Tensor x = w.detach().to(at::kFloat);
  at::Tensor amax = x.abs().amax(1);
  // A tensor divisor: ATen's CUDA division by a host scalar multiplies by its rounded reciprocal,
  // which can land one ulp away from the CPU's quotient; the same storage on every device.
  at::Tensor scale = at::where(amax > 0, amax / at::full_like(amax, kFp8Max), at::ones_like(amax));
  fp8_codes_ = (x / scale.unsqueeze(1)).clamp(-kFp8Max, kFp8Max).to(at::kFloat8_e4m3fn);
  fp8_scale_ = scale.contiguous();
  fp8_dtype_ = w.scalar_type();
}

bool QuantizedLinear::has_weight() const {
  return cfg_.kind == "nf4" ? nf4_.codes.defined() : fp8_codes_.defined();
}

at::Device QuantizedLinear::storage_device() const {
  COLOSSAL_CHECK(has_weight(), "QuantizedLinear ", name(), " holds no weight yet");
  return cfg_.kind == "nf4" ? nf4_.codes.device() : fp8_codes_.device();
}

int64_t QuantizedLinear::storage_bytes() const {
  if (!has_weight()) return 0;
  return cfg_.kind == "nf4" ? nf4_.bytes() : fp8_codes_.numel() + fp8_scale_.numel() * 4;
}

at::Tensor QuantizedLinear::dequantized_weight(at::ScalarType dtype) const {
  COLOSSAL_CHECK(has_weight(), "QuantizedLinear ", name(), " holds no weight yet");
  if (cfg_.kind == "fp8") return kernels::dequantize_fp8_rows(fp8_codes_, fp8_scale_, dtype);
  return dequantize_nf4(nf4_, dtype);
}

at::TensorOptions QuantizedLinear::weight_options() const {
  return at::TensorOptions()
      .device(storage_device())
      .dtype(cfg_.kind == "nf4" ? nf4_.dtype : fp8_dtype_);
}

at::Tensor QuantizedLinear::matmul_weight(const at::Tensor& x, const at::Tensor& bias) const {
  COLOSSAL_CHECK_INPUT(has_weight(), "QuantizedLinear ", name(),
                       " holds no weight: load or initialize the model first");
  COLOSSAL_CHECK_INPUT(x.device() == storage_device(), "QuantizedLinear ", name(),
                       ": the input is on ", x.device(), " but the quantized weight is on ",
                       storage_device(), " (build the quantized model on the training device)");
  std::vector<at::Tensor> storage;
  std::vector<int64_t> meta{cfg_.kind == "fp8" ? 1 : 0, out_features(), in_features(),
                            cfg_.blocksize, nf4_.blocksize2};
  if (cfg_.kind == "fp8") {
    storage = {fp8_codes_, fp8_scale_};
  } else {
    storage = {nf4_.codes, nf4_.absmax,
               nf4_.double_quant ? nf4_.absmax2 : at::empty({0}, nf4_.codes.options()),
               nf4_.double_quant ? dynamic_map_on(nf4_.codes.device())
                                 : at::empty({0}, nf4_.codes.options())};
  }
  return DequantLinear::apply(x, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                              storage, meta, static_cast<double>(nf4_.offset));
}

at::Tensor QuantizedLinear::forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  return matmul_weight(x, has_bias() ? param("bias") : at::Tensor());
}

void QuantizedLinear::shard(const ShardSpec& spec) {
  (void)spec;
  throw InputError(str("quantized linear ", name(),
                       " cannot be sharded: tensor-parallel QLoRA is not supported (tp_size 1)"));
}

std::vector<int64_t> QuantizedLinear::full_shape(const std::string& name) const {
  if (name == "weight") return {out_features(), in_features()};
  return Linear::full_shape(name);
}

void QuantizedLinear::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  Linear::to(device, dtype, non_blocking);
  to(device, non_blocking);
}

void QuantizedLinear::to(torch::Dtype dtype, bool non_blocking) {
  Linear::to(dtype, non_blocking);
}

void QuantizedLinear::to(torch::Device device, bool non_blocking) {
  Linear::to(device, non_blocking);
  auto move = [&](at::Tensor& t) {
    if (t.defined()) t = t.to(device, non_blocking);
  };
  move(nf4_.codes);
  move(nf4_.absmax);
  move(nf4_.absmax2);
  move(fp8_codes_);
  move(fp8_scale_);
}

std::vector<std::string> quantize_linears(torch::nn::Module& root, const QuantizeConfig& cfg) {
  cfg.validate();
  std::set<std::string> skip(cfg.skip_modules.begin(), cfg.skip_modules.end());
  skip.insert("lm_head");
  std::vector<std::string> paths;
  for (const auto& item : root.named_modules("", false)) {
    auto lin = std::dynamic_pointer_cast<Linear>(item.value());
    // Plain Linear only: a LoRA, an already quantized or a parallel kind is left as it is.
    if (!lin || typeid(*lin) != typeid(Linear)) continue;
    const std::string& path = item.key();
    const std::string last =
        path.substr(path.rfind('.') == std::string::npos ? 0 : path.rfind('.') + 1);
    if (skip.count(last)) continue;
    paths.push_back(path);
  }
  for (const auto& path : paths) {
    auto lin = std::dynamic_pointer_cast<Linear>(find_module(root, path));
    auto q = QuantizedLinear::from(*lin, cfg);
    replace_module(root, path, q);
    at::NoGradGuard ng;
    if (!lin->weight().is_meta()) lin->weight().set_data(at::empty({0}, lin->weight().options()));
  }
  return paths;
}

int64_t init_quantized_weights(torch::nn::Module& root, const InitOptions& opts,
                               const at::Device& device) {
  std::vector<std::pair<std::string, QuantizedLinear*>> todo;
  for (const auto& item : root.named_modules("", false))
    if (auto* q = dynamic_cast<QuantizedLinear*>(item.value().get()); q && !q->has_weight())
      todo.emplace_back(item.key() + ".weight", q);
  std::vector<InitValueJob> jobs;
  for (const auto& [name, q] : todo)
    jobs.push_back({name, {q->out_features(), q->in_features()}, {}});
  int64_t bytes = 0;
  size_t last_tenth = 0;
  make_init_values(jobs, opts, [&](size_t j, at::Tensor value) {
    QuantizedLinear* q = todo[j].second;
    at::Tensor v = value.to(device, opts.dtype.value_or(at::kFloat));
    value = at::Tensor();
    q->set_weight(v);
    bytes += q->storage_bytes();
    // Minutes at 70b: say how far it is every tenth.
    if (const size_t tenth = 10 * (j + 1) / todo.size(); tenth > last_tenth && todo.size() >= 20) {
      log_info("initialising quantized weights: ", j + 1, " of ", todo.size(), " (",
               static_cast<double>(bytes) / (1 << 30), " GiB so far)");
      last_tenth = tenth;
    }
  });
  return bytes;
}

int64_t quantized_weight_count(torch::nn::Module& root) {
  int64_t n = 0;
  for (const auto& m : root.modules()) {
    std::shared_ptr<QuantizedLinear> q = std::dynamic_pointer_cast<QuantizedLinear>(m);
    if (auto l = std::dynamic_pointer_cast<LoraLinear>(m)) q = l->quantized_base();
    if (q) n += q->in_features() * q->out_features();
  }
  return n;
}

}  // namespace colossal::nn
