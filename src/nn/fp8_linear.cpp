// FP8 linear layers (colossal/nn/fp8_linear.h).
#include "colossal/nn/fp8_linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <typeinfo>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/weights_epoch.h"
#include "colossal/dist/communicator.h"

namespace colossal::nn {

namespace {

LinearOptions on_meta(LinearOptions o) {
  o.tensor_options(at::TensorOptions().device(at::kMeta));
  return o;
}

// a @ b^T for fp8 a [M, K] and b [N, K] (row-major) whose values are data * inv_scale (inv
// scales: [1], or [M, 1] / [N, 1] per row), as `out` dtype. CUDA: at::_scaled_mm (b.t() is the
// column-major operand it wants); elsewhere the emulation: dequantize both to fp32, multiply.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& a_inv, const at::Tensor& b,
                     const at::Tensor& b_inv, at::ScalarType out, bool fast_accum) {
  if (a.is_cuda()) {
    const at::Tensor sb = b_inv.numel() == 1 ? b_inv : b_inv.reshape({1, -1});
    return at::_scaled_mm(a, b.t(), a_inv, sb, std::nullopt, std::nullopt, out, fast_accum);
  }
  return at::mm(a.to(at::kFloat) * a_inv, (b.to(at::kFloat) * b_inv).t()).to(out);
}

// The last activation cast of this thread, for the next layer that reads the same input (q, k
// and v read one normed hidden state, gate and up another): the same storage at the same offset,
// shape, strides and version, cast the same way. The input's storage is held weakly (a freed
// input whose memory is reused never matches); the fp8 data and scale are held until the next
// cast replaces them (at most one activation's fp8 copy, M x K bytes, outlives its layers), the
// transpose weakly: it lives as long as a layer saved it for the weight gradient.
struct ActivationCast {
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  int64_t offset = 0, version = -1;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat, fp8 = at::kFloat;
  bool rowwise = false;
  at::Tensor data, inv_scale;
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::optional<WeakImpl> data_t;
};
thread_local ActivationCast last_cast;
thread_local int64_t activation_casts_made = 0;

kernels::Fp8Tensor cast_activation(const at::Tensor& x2, at::ScalarType fp8, bool rowwise,
                                   bool transpose) {
  ActivationCast& c = last_cast;
  if (c.storage && c.version == static_cast<int64_t>(x2._version()) &&
      c.offset == x2.storage_offset() && c.sizes == x2.sizes().vec() &&
      c.strides == x2.strides().vec() && c.dtype == x2.scalar_type() && c.fp8 == fp8 &&
      c.rowwise == rowwise) {
    c10::intrusive_ptr<c10::StorageImpl> st = c.storage->lock();
    if (st && st.get() == x2.storage().unsafeGetStorageImpl()) {
      kernels::Fp8Tensor hit;
      hit.data = c.data;
      hit.inv_scale = c.inv_scale;
      if (transpose && c.data_t) hit.data_t = at::Tensor(c.data_t->lock());
      if (!transpose || hit.data_t.defined()) return hit;
    }
  }
  c = ActivationCast{};  // nothing of a stale entry outlives this call
  kernels::Fp8Tensor q = kernels::cast_to_fp8(x2, fp8, rowwise, transpose);
  ++activation_casts_made;
  c.storage = x2.storage().getWeakStorageImpl();
  c.version = static_cast<int64_t>(x2._version());
  c.offset = x2.storage_offset();
  c.sizes = x2.sizes().vec();
  c.strides = x2.strides().vec();
  c.dtype = x2.scalar_type();
  c.fp8 = fp8;
  c.rowwise = rowwise;
  c.data = q.data;
  c.inv_scale = q.inv_scale;
  if (q.data_t.defined()) c.data_t = ActivationCast::WeakImpl(q.data_t.getIntrusivePtr());
  return q;
}

}  // namespace

// A tensor-parallel FP8 GEMM's operands that are split over the group: their amax is
// all-reduced (max), so each shard's scale is the whole tensor's and every element quantizes as
// it would unsplit (the curve of one process). Column: the weight's rows and the output
// gradient's columns; row: the input's columns and the weight's. The other operand is whole on
// every rank already (column: the input, entered into the region; row: the output gradient).
struct Fp8TpScales : torch::CustomClassHolder {
  Fp8TpScales(dist::Communicator g, bool x, bool dy)
      : group(std::move(g)), x_split(x), dy_split(dy) {}
  dist::Communicator group;
  bool x_split, dy_split;
};

namespace {

// t's amax, all-reduced over the group (the cast then takes it).
at::Tensor group_amax(const at::Tensor& t, const dist::Communicator& g) {
  at::Tensor a = kernels::fp8_amax(t).clone();
  const_cast<dist::Communicator&>(g).all_reduce(a, dist::ReduceOp::Max);
  return a;
}

// y = x W^T (+ b) with the recipe's FP8 GEMMs. Non-variable arguments: the weight's casts
// (tensorwise {w data, w data_t, w inv}; rowwise {w data, w inv, w_t data, w_t inv}); tp (or
// null): which operands are split over a tensor-parallel group (tensorwise only).
struct Fp8LinearFn : torch::autograd::Function<Fp8LinearFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const std::optional<at::Tensor>& bias,
                            const std::vector<at::Tensor>& wc, bool rowwise, bool need_dw,
                            const c10::intrusive_ptr<Fp8TpScales>& tp) {
    const int64_t k = x.size(-1), n = w.size(0);
    const at::Tensor x2 = x.reshape({-1, k});
    std::vector<int64_t> out_shape = x.sizes().vec();
    out_shape.back() = n;
    ctx->saved_data["rowwise"] = rowwise;
    ctx->saved_data["x_shape"] = x.sizes().vec();
    ctx->saved_data["bias_grad"] = bias && bias->requires_grad();
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    at::Tensor y;
    if (tp) ctx->saved_data["tp"] = c10::IValue::make_capsule(tp);
    if (!rowwise) {
      // A split input (row parallel) is cast with the group's scale and never shared: the
      // activation cache holds casts with a tensor's own scale.
      kernels::Fp8Tensor xq = tp && tp->x_split
                                  ? kernels::cast_to_fp8_with_amax(x2, at::kFloat8_e4m3fn, need_dw,
                                                                   group_amax(x2, tp->group))
                                  : cast_activation(x2, at::kFloat8_e4m3fn, false, need_dw);
      y = scaled_mm(xq.data, xq.inv_scale, wc[0], wc[2], x.scalar_type(), true);
      ctx->save_for_backward({need_dw ? xq.data_t : at::Tensor(), xq.inv_scale, wc[1], wc[2]});
    } else {
      kernels::Fp8Tensor xq = cast_activation(x2, at::kFloat8_e4m3fn, true, false);
      y = scaled_mm(xq.data, xq.inv_scale, wc[0], wc[1], x.scalar_type(), true);
      ctx->save_for_backward({need_dw ? x2 : at::Tensor(), wc[2], wc[3]});
    }
    if (bias) y = y + *bias;
    return y.view(out_shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    if (!grad[0].defined())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), {}, {}, {}};
    const auto x_shape = ctx->saved_data["x_shape"].toIntVector();
    const bool rowwise = ctx->saved_data["rowwise"].toBool();
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    auto saved = ctx->get_saved_variables();
    const int64_t k = x_shape.back();
    const at::Tensor dy = grad[0].reshape({-1, grad[0].size(-1)}).contiguous();
    const bool need_dw = saved[0].defined();
    at::Tensor dx, dw;
    if (!rowwise) {
      // dy in e5m2 (gradients need range more than precision), with its transpose for dW; a
      // split dy (column parallel) with the group's scale.
      c10::intrusive_ptr<Fp8TpScales> tp;
      if (ctx->saved_data.count("tp") > 0)
        tp = c10::static_intrusive_pointer_cast<Fp8TpScales>(ctx->saved_data["tp"].toCapsule());
      kernels::Fp8Tensor dq = tp && tp->dy_split
                                  ? kernels::cast_to_fp8_with_amax(dy, at::kFloat8_e5m2, need_dw,
                                                                   group_amax(dy, tp->group))
                                  : kernels::cast_to_fp8(dy, at::kFloat8_e5m2, false, need_dw);
      dx = scaled_mm(dq.data, dq.inv_scale, saved[2], saved[3], dy.scalar_type(), false);
      if (need_dw) dw = scaled_mm(dq.data_t, dq.inv_scale, saved[0], saved[1], w_dtype, false);
    } else {
      kernels::Fp8Tensor dq = kernels::cast_to_fp8(dy, at::kFloat8_e4m3fn, true, false);
      dx = scaled_mm(dq.data, dq.inv_scale, saved[1], saved[2], dy.scalar_type(), false);
      if (need_dw) dw = at::mm(dy.t(), saved[0].to(dy.scalar_type())).to(w_dtype);
    }
    at::Tensor db;
    if (ctx->saved_data["bias_grad"].toBool()) db = dy.sum(0);
    (void)k;
    return {dx.view(x_shape), dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The fused group's GEMMs (fp8_fused_projections): y = x W^T for the concatenated W, whose
// casts `wc` ({data, data_t, inv_scale}) are made outside; the gradients of each weight are the
// rows of the concatenated dW, the biases' the columns of dy's sum.
struct Fp8ConcatFn : torch::autograd::Function<Fp8ConcatFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList ws, at::TensorList biases,
                            const std::vector<at::Tensor>& wc, bool need_dw) {
    const int64_t k = x.size(-1);
    const at::Tensor x2 = x.reshape({-1, k});
    kernels::Fp8Tensor xq = cast_activation(x2, at::kFloat8_e4m3fn, false, need_dw);
    at::Tensor y = scaled_mm(xq.data, xq.inv_scale, wc[0], wc[2], x.scalar_type(), true);
    std::vector<int64_t> rows;
    for (const auto& w : ws) rows.push_back(w.size(0));
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["x_shape"] = x.sizes().vec();
    ctx->saved_data["biases"] = static_cast<int64_t>(biases.size());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(ws[0].scalar_type());
    ctx->save_for_backward({need_dw ? xq.data_t : at::Tensor(), xq.inv_scale, wc[1], wc[2]});
    if (!biases.empty()) y = y + at::cat(biases, 0);
    std::vector<int64_t> out_shape = x.sizes().vec();
    out_shape.back() = y.size(-1);
    return y.view(out_shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const auto rows = ctx->saved_data["rows"].toIntVector();
    const auto x_shape = ctx->saved_data["x_shape"].toIntVector();
    const int64_t nb = ctx->saved_data["biases"].toInt();
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    const size_t n = rows.size();
    torch::autograd::variable_list out(1 + n + size_t(nb) + 2);  // x, ws, biases, wc, need_dw
    if (!grad[0].defined()) return out;
    auto saved = ctx->get_saved_variables();
    const at::Tensor dy = grad[0].reshape({-1, grad[0].size(-1)}).contiguous();
    const bool need_dw = saved[0].defined();
    kernels::Fp8Tensor dq = kernels::cast_to_fp8(dy, at::kFloat8_e5m2, false, need_dw);
    out[0] =
        scaled_mm(dq.data, dq.inv_scale, saved[2], saved[3], dy.scalar_type(), false).view(x_shape);
    at::Tensor dw;
    if (need_dw) dw = scaled_mm(dq.data_t, dq.inv_scale, saved[0], saved[1], w_dtype, false);
    at::Tensor db = nb > 0 ? dy.sum(0) : at::Tensor();
    int64_t r0 = 0;
    for (size_t i = 0; i < n; ++i) {
      if (dw.defined()) out[1 + i] = dw.narrow(0, r0, rows[i]);
      if (db.defined()) out[1 + n + i] = db.narrow(0, r0, rows[i]);
      r0 += rows[i];
    }
    return out;
  }
};

}  // namespace

kernels::Fp8Tensor Fp8Linear::group_weight_cast(const std::vector<Fp8Linear*>& group) {
  std::vector<std::tuple<const void*, const void*, int64_t>> key;
  for (Fp8Linear* f : group) {
    const at::Tensor& w = f->weight();
    key.emplace_back(w.unsafeGetTensorImpl(), w.const_data_ptr(),
                     static_cast<int64_t>(w._version()));
  }
  const auto epoch = static_cast<int64_t>(weights_epoch());
  if (cfg_.keep_weight_casts && group_cache_.data.defined() && key == group_key_ &&
      epoch == group_epoch_)
    return group_cache_;
  at::NoGradGuard ng;
  std::vector<at::Tensor> ws;
  for (Fp8Linear* f : group) {
    ws.push_back(f->weight().detach());
    ++f->weight_casts_;
  }
  kernels::Fp8Tensor cast = kernels::cast_to_fp8_concat(ws, at::kFloat8_e4m3fn, true);
  // Nothing kept without keep_weight_casts: the step's graph holds the cast as long as backward
  // needs it. (Kept in the layer, every layer's fused q/k/v and gate/up casts stayed on the
  // device for the whole run: 2 bytes per weight of those projections, 17.6 GB at 13b by count,
  // which made Gemini's placement send more chunks to the host than it holds.)
  if (!cfg_.keep_weight_casts) return cast;
  group_cache_ = cast;
  group_key_ = std::move(key);
  group_epoch_ = epoch;
  return group_cache_;
}

std::optional<at::Tensor> fp8_fused_projections(const at::Tensor& x,
                                                const std::vector<Linear*>& projections) {
  if (projections.size() < 2) return std::nullopt;
  std::vector<Fp8Linear*> group;
  for (Linear* p : projections) {
    auto* f = dynamic_cast<Fp8Linear*>(p);
    // Sharded layers keep their region operations: never fused.
    if (!f || f->recipe() != "tensorwise" || !f->plain_storage()) return std::nullopt;
    group.push_back(f);
  }
  const Fp8Linear& first = *group.front();
  for (Fp8Linear* f : group)
    if (f->has_bias() != first.has_bias() || f->in_features() != first.in_features() ||
        f->weight().scalar_type() != first.weight().scalar_type() ||
        f->weight().device() != first.weight().device())
      return std::nullopt;
  COLOSSAL_CHECK_INPUT(!x.is_cuda() || (x.numel() / x.size(-1)) % 16 == 0, "fp8: ", first.name(),
                       " gets ", x.numel() / x.size(-1),
                       " tokens; the FP8 weight-gradient GEMM needs a multiple of 16 (choose "
                       "micro_batch * seq_len accordingly)");
  // The projections' hooks fire around the read of their weights (pre in order, post reversed).
  std::vector<std::unique_ptr<Module::ForwardScope>> scopes;
  for (Fp8Linear* f : group) scopes.push_back(std::make_unique<Module::ForwardScope>(*f));
  std::vector<at::Tensor> ws, biases;
  bool any_grad = false;
  for (Fp8Linear* f : group) {
    ws.push_back(f->weight());
    any_grad = any_grad || f->weight().requires_grad();
    if (f->has_bias()) biases.push_back(f->param("bias"));
  }
  // A copy of the cache entry: the autograd function keeps what it saves, the cache may move on.
  const kernels::Fp8Tensor wc = group.front()->group_weight_cast(group);
  at::Tensor y = Fp8ConcatFn::apply(x, at::TensorList(ws), at::TensorList(biases),
                                    std::vector<at::Tensor>{wc.data, wc.data_t, wc.inv_scale},
                                    at::GradMode::is_enabled() && any_grad);
  while (!scopes.empty()) scopes.pop_back();
  return y;
}

int64_t Fp8Linear::activation_casts() {
  return activation_casts_made;
}

void Fp8Config::validate() const {
  COLOSSAL_CHECK_INPUT(recipe == "tensorwise" || recipe == "rowwise", "fp8: recipe '", recipe,
                       "' is not supported (tensorwise | rowwise)");
}

Fp8Linear::Fp8Linear(const Linear& base, const Fp8Config& cfg)
    : Linear(on_meta(base.options())), cfg_(cfg) {
  cfg_.validate();
  COLOSSAL_CHECK_INPUT(!base.shard_spec(), "fp8: ", base.name(),
                       " is sharded already; convert to FP8 before the plugin shards the model "
                       "(the FP8 layer shards itself, keeping the group's scales)");
  COLOSSAL_CHECK_INPUT(base.in_features() % 16 == 0 && base.out_features() % 16 == 0,
                       "fp8: ", base.name(), " is [", base.out_features(), ", ", base.in_features(),
                       "]; FP8 GEMMs need both sizes divisible by 16 (exclude it: --fp8_exclude)");
  replace_parameter("weight", base.weight());
  if (has_bias()) replace_parameter("bias", base.param("bias"));
}

Fp8Linear::WeightCasts Fp8Linear::cast_weight(const at::Tensor& w) {
  ++weight_casts_;
  at::NoGradGuard ng;
  const at::Tensor wd = w.detach();
  WeightCasts c;
  if (cfg_.recipe == "tensorwise") {
    // A weight split over a tensor-parallel group: the whole weight's scale.
    const ShardSpec* s = shard_spec() ? &*shard_spec() : nullptr;
    c.w = s && s->communicates() ? kernels::cast_to_fp8_with_amax(wd, at::kFloat8_e4m3fn, true,
                                                                  group_amax(wd, s->group))
                                 : kernels::cast_to_fp8(wd, at::kFloat8_e4m3fn, false, true);
  } else {
    c.w = kernels::cast_to_fp8(wd, at::kFloat8_e4m3fn, true, false);
    c.w_t = kernels::cast_to_fp8(wd.t().contiguous(), at::kFloat8_e4m3fn, true, false);
  }
  return c;
}

const Fp8Linear::WeightCasts& Fp8Linear::weight_casts_for(const at::Tensor& w) {
  const uint64_t epoch = weights_epoch();
  if (cache_impl_ == w.unsafeGetTensorImpl() && cache_data_ == w.const_data_ptr() &&
      cache_version_ == static_cast<int64_t>(w._version()) &&
      cache_epoch_ == static_cast<int64_t>(epoch) && cache_dtype_ == w.scalar_type())
    return cache_;
  cache_ = cast_weight(w);
  cache_impl_ = w.unsafeGetTensorImpl();
  cache_data_ = w.const_data_ptr();
  cache_version_ = static_cast<int64_t>(w._version());
  cache_epoch_ = static_cast<int64_t>(epoch);
  cache_dtype_ = w.scalar_type();
  return cache_;
}

at::Tensor Fp8Linear::forward(const at::Tensor& x) {
  // Sharded over a group: Linear's region operations around local_gemm below.
  if (shard_spec() && shard_spec()->communicates()) return Linear::forward(x);
  ForwardScope scope(*this);
  return fp8_gemm(x, weight(), has_bias() ? param("bias") : at::Tensor(), {});
}

at::Tensor Fp8Linear::local_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const ShardSpec& s = *shard_spec();
  return fp8_gemm(x, w, b,
                  c10::make_intrusive<Fp8TpScales>(s.group, s.kind == ShardSpec::Kind::Row,
                                                   s.kind == ShardSpec::Kind::Column));
}

at::Tensor Fp8Linear::fp8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                               const c10::intrusive_ptr<Fp8TpScales>& tp) {
  COLOSSAL_CHECK_INPUT(
      !x.is_cuda() || cfg_.recipe == "tensorwise" || x.scalar_type() == at::kBFloat16,
      "fp8: the rowwise recipe on CUDA needs bf16 activations (", name(), " gets ", x.scalar_type(),
      "): train with precision bf16");
  COLOSSAL_CHECK_INPUT(!x.is_cuda() || (x.numel() / x.size(-1)) % 16 == 0, "fp8: ", name(),
                       " gets ", x.numel() / x.size(-1),
                       " tokens; the FP8 weight-gradient GEMM needs a multiple of 16 (choose "
                       "micro_batch * seq_len accordingly)");
  WeightCasts fresh;  // without keep_weight_casts: the step's graph holds them, nothing else
  const WeightCasts& c =
      cfg_.keep_weight_casts ? weight_casts_for(w) : (fresh = cast_weight(w), fresh);
  std::vector<at::Tensor> wc;
  if (cfg_.recipe == "tensorwise")
    wc = {c.w.data, c.w.data_t, c.w.inv_scale};
  else
    wc = {c.w.data, c.w.inv_scale, c.w_t.data, c.w_t.inv_scale};
  // The weight gradient (and so the input's transpose) only when a graph is recorded: inside
  // the autograd function grad mode is always off. The layer never defers it (a zero-bubble
  // schedule's W finds nothing of this layer's to run: its dW is computed in the backward).
  const bool need_dw = at::GradMode::is_enabled() && w.requires_grad();
  return Fp8LinearFn::apply(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, wc,
                            cfg_.recipe == "rowwise", need_dw, tp);
}

void Fp8Linear::shard(const ShardSpec& spec) {
  if (spec.communicates()) {
    COLOSSAL_CHECK_INPUT(cfg_.recipe == "tensorwise", "fp8: ", name(),
                         ": the rowwise recipe is not supported under tensor parallelism (its "
                         "per-row scales would run along the split dimension); use tensorwise");
    COLOSSAL_CHECK_INPUT(spec.sequence_parallel != SequenceParallelMode::Ring, "fp8: ", name(),
                         ": sequence_parallelism_mode ring runs the linear layers' GEMMs chunk by "
                         "chunk inside the ring, not in FP8; use split_gather or all_to_all");
    // A vocabulary head sharded for the vocab-parallel loss (local logits): that loss reads a
    // plain head's weight, so an FP8 head could only hand the model a slice of the logits.
    COLOSSAL_CHECK_INPUT(
        spec.kind != ShardSpec::Kind::Column || spec.pad_multiple == 1 || spec.gather_output,
        "fp8: ", name(),
        " is sharded as a vocabulary head for the vocab-parallel loss, which "
        "reads a plain head; keep it out of FP8 (--fp8_exclude lm_head, the "
        "default) or gather its output (parallel_output false)");
  }
  Linear::shard(spec);
  COLOSSAL_CHECK_INPUT(in_features() % 16 == 0 && out_features() % 16 == 0, "fp8: ", name(),
                       " is [", out_features(), ", ", in_features(), "] on each of ", spec.world,
                       " ranks; FP8 GEMMs need both sizes divisible by 16 (exclude it: "
                       "--fp8_exclude, or a smaller tp)");
}

std::vector<std::string> convert_to_fp8(torch::nn::Module& root, const Fp8Config& cfg,
                                        const at::Device& device) {
  cfg.validate();
  // The SwiGLU kernels record the amax of what they write (the down projection's input, the
  // gate / up projections' output gradients): those casts skip their amax pass.
  if (cfg.recipe == "tensorwise") kernels::set_fp8_amax_capture(true);
  if (device.is_cuda()) {
    const auto devices = cuda_devices();
    const int idx = device.has_index() ? device.index() : 0;
    COLOSSAL_CHECK_INPUT(idx >= 0 && idx < static_cast<int>(devices.size()), "fp8: CUDA device ",
                         idx, " is not visible");
    const auto& d = devices[static_cast<size_t>(idx)];
    COLOSSAL_CHECK_INPUT(d.major * 10 + d.minor >= 89, "fp8: ", d.name, " (compute capability ",
                         d.major, ".", d.minor,
                         ") has no FP8 tensor cores; FP8 training needs 8.9 (Ada) or 9.0 (Hopper)");
  }
  std::vector<std::string> paths;
  for (const auto& item : root.named_modules("", false)) {
    auto lin = std::dynamic_pointer_cast<Linear>(item.value());
    if (!lin || typeid(*lin) != typeid(Linear)) continue;
    const std::string& path = item.key();
    bool excluded = false;
    for (const auto& e : cfg.exclude)
      if (!e.empty() && path.find(e) != std::string::npos) excluded = true;
    if (!excluded) paths.push_back(path);
  }
  for (const auto& path : paths) {
    auto lin = std::dynamic_pointer_cast<Linear>(find_module(root, path));
    replace_module(root, path, std::make_shared<Fp8Linear>(*lin, cfg));
  }
  return paths;
}

}  // namespace colossal::nn
