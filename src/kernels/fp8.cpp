// FP8 casts with current scaling (kernels/fp8.h): argument checks, the ATen reference and the
// device dispatch (CUDA kernels in fp8.cu).
#include "colossal/kernels/fp8.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <atomic>
#include <deque>
#include <iterator>
#include <mutex>

#include "colossal/core/accelerator.h"
#include "colossal/core/weights_epoch.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_CUDA
COLOSSAL_REGISTER_CUDA_KERNEL("fp8_cast");
#endif

using namespace detail;

double fp8_max(at::ScalarType fp8) {
  if (fp8 == at::kFloat8_e4m3fn) return 448.0;
  if (fp8 == at::kFloat8_e5m2) return 57344.0;
  throw InputError(str("fp8: ", fp8, " is not an FP8 format (float8_e4m3fn, float8_e5m2)"));
}

namespace {

void check_cast(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool transpose) {
  check_dtype("cast_to_fp8", "x", x);
  COLOSSAL_CHECK_INPUT(x.dim() == 2, "cast_to_fp8: x must be 2-D, got ", x.sizes());
  fp8_max(fp8);
  COLOSSAL_CHECK_INPUT(!(rowwise && transpose),
                       "cast_to_fp8: a rowwise cast has no transpose (its scales run along the "
                       "other dimension); cast the transposed tensor instead");
}

}  // namespace

// ---- Known amaxes ----
namespace {

struct KnownAmax {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset = 0, numel = 0, version = -1;
  uint64_t epoch = 0;  // weights_epoch() at the record: an optimizer step or load voids it
  at::Tensor amax;
};
std::mutex& known_mu() {
  static std::mutex m;
  return m;
}
// Most recent last; bounded (the optimizer records every working weight of a step, the SwiGLU
// kernels a few tensors per layer, each used within the step).
std::deque<KnownAmax>& known() {
  static std::deque<KnownAmax> d;
  return d;
}
std::atomic<bool> g_capture{false};
std::atomic<int64_t> g_known_uses{0};
constexpr size_t kKnownMax = 4096;

bool same_bytes(const KnownAmax& e, const at::Tensor& t) {
  if (e.offset != t.storage_offset() || e.numel != t.numel() ||
      e.version != static_cast<int64_t>(t._version()) || e.epoch != weights_epoch())
    return false;
  c10::intrusive_ptr<c10::StorageImpl> st = e.storage.lock();
  return st && st.get() == t.storage().unsafeGetStorageImpl();
}

}  // namespace

void set_fp8_amax_capture(bool on) {
  g_capture.store(on);
}
bool fp8_amax_capture() {
  return g_capture.load();
}
int64_t fp8_known_amax_uses() {
  return g_known_uses.load();
}

void record_fp8_amax(const at::Tensor& t, const at::Tensor& amax) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  COLOSSAL_CHECK(amax.defined() && amax.scalar_type() == at::kFloat && amax.numel() == 1 &&
                     amax.device() == t.device(),
                 "record_fp8_amax: the amax must be float32 [1] on ", t.device());
  std::lock_guard<std::mutex> lock(known_mu());
  auto& d = known();
  // An earlier entry for the same place is superseded (integers compared first: a storage lock
  // only for a candidate); entries of freed storage go when the bound is reached.
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  for (auto it = d.begin(); it != d.end();) {
    if (it->offset == t.storage_offset() && it->numel == t.numel()) {
      c10::intrusive_ptr<c10::StorageImpl> st = it->storage.lock();
      if (!st || st.get() == impl) {
        it = d.erase(it);
        continue;
      }
    }
    ++it;
  }
  if (d.size() >= kKnownMax) {
    for (auto it = d.begin(); it != d.end();)
      it = it->storage.expired() ? d.erase(it) : std::next(it);
    while (d.size() >= kKnownMax) d.pop_front();
  }
  d.push_back(KnownAmax{t.storage().getWeakStorageImpl(), t.storage_offset(), t.numel(),
                        static_cast<int64_t>(t._version()), weights_epoch(), amax.reshape({1})});
}

at::Tensor known_fp8_amax(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return {};
  std::lock_guard<std::mutex> lock(known_mu());
  auto& d = known();
  for (auto it = d.rbegin(); it != d.rend(); ++it)
    if (same_bytes(*it, t)) return it->amax;
  return {};
}

at::Tensor fp8_amax_slot(const at::Tensor& like, int64_t n) {
  return fp8_amax_capture() ? at::zeros({n}, like.options().dtype(at::kFloat)) : at::Tensor();
}

void record_computed_fp8_amax(const at::Tensor& t) {
  if (fp8_amax_capture() && t.numel() > 0)
    record_fp8_amax(t, t.abs().amax().to(at::kFloat).reshape({1}));
}

namespace {

// The recorded amax a tensorwise cast of x takes (counted as a use); undefined when none.
at::Tensor take_known_amax(const at::Tensor& x, bool rowwise) {
  at::Tensor k = rowwise ? at::Tensor() : known_fp8_amax(x);
  if (k.defined()) ++g_known_uses;
  return k;
}

// The max of the parts' recorded amaxes when every part has one (one use), else undefined.
at::Tensor take_known_group_amax(const std::vector<at::Tensor>& xs) {
  std::vector<at::Tensor> parts;
  for (const auto& x : xs) {
    at::Tensor k = known_fp8_amax(x);
    if (!k.defined()) return {};
    parts.push_back(k);
  }
  ++g_known_uses;
  return at::cat(parts).amax().reshape({1});
}

// The reference cast with the tensorwise amax given (undefined: computed).
Fp8Tensor reference_cast(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool transpose,
                         const at::Tensor& given) {
  const double m = fp8_max(fp8);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor amax = rowwise           ? xf.abs().amax(1, /*keepdim=*/true)
                    : given.defined() ? given.reshape({1})
                                      : xf.abs().amax().reshape({1});
  at::Tensor scale = at::full_like(amax, m) / amax.clamp_min(1e-12);
  Fp8Tensor out;
  out.data = (xf * scale).clamp(-m, m).to(fp8).contiguous();
  if (transpose) out.data_t = out.data.t().contiguous();
  out.inv_scale = scale.reciprocal();
  return out;
}

}  // namespace

Fp8Tensor cast_to_fp8_reference(const at::Tensor& x, at::ScalarType fp8, bool rowwise,
                                bool transpose) {
  check_cast(x, fp8, rowwise, transpose);
  return reference_cast(x, fp8, rowwise, transpose, take_known_amax(x, rowwise));
}

namespace {

// cast_to_fp8 with the tensorwise amax `given` (undefined: computed in the cast's first pass).
Fp8Tensor cast_with(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool transpose,
                    const at::Tensor& given) {
  if (path_for(x) != Path::Cuda) return reference_cast(x, fp8, rowwise, transpose, given);
  at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), cols = xc.size(1), count = rowwise ? rows : 1;
  auto f32 = xc.options().dtype(at::kFloat);
  at::Tensor amax = given.defined() ? given : at::empty({count}, f32);
  at::Tensor scale = at::empty({count}, f32);
  Fp8Tensor out;
  out.inv_scale = at::empty(rowwise ? std::vector<int64_t>{rows, 1} : std::vector<int64_t>{1}, f32);
  out.data = at::empty({rows, cols}, xc.options().dtype(fp8));
  if (transpose) out.data_t = at::empty({cols, rows}, xc.options().dtype(fp8));
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(xc.device());
  cuda::fp8_cast(xc.const_data_ptr(), rows, cols, rowwise, fp8 == at::kFloat8_e5m2,
                 static_cast<float>(fp8_max(fp8)), amax.mutable_data_ptr<float>(),
                 scale.mutable_data_ptr<float>(), out.inv_scale.mutable_data_ptr<float>(),
                 static_cast<uint8_t*>(out.data.mutable_data_ptr()),
                 transpose ? static_cast<uint8_t*>(out.data_t.mutable_data_ptr()) : nullptr,
                 cuda_dtype(xc.scalar_type()), stream_of(xc), /*amax_given=*/given.defined());
#endif
  return out;
}

}  // namespace

Fp8Tensor cast_to_fp8(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool transpose) {
  check_cast(x, fp8, rowwise, transpose);
  // A recorded amax of these bytes (kernels that wrote x) saves the amax pass.
  return cast_with(x, fp8, rowwise, transpose, take_known_amax(x, rowwise));
}

at::Tensor fp8_amax(const at::Tensor& x) {
  COLOSSAL_CHECK_INPUT(x.defined() && x.is_floating_point(), "fp8_amax: x must be a defined ",
                       "floating-point tensor");
  at::Tensor k = take_known_amax(x, false);
  if (k.defined()) return k;
  // max |x| without a temporary: the infinity norm, accumulated in fp32 (exact: a max).
  return at::linalg_vector_norm(x, INFINITY, std::nullopt, false, at::kFloat).reshape({1});
}

Fp8Tensor cast_to_fp8_with_amax(const at::Tensor& x, at::ScalarType fp8, bool transpose,
                                const at::Tensor& amax) {
  check_cast(x, fp8, false, transpose);
  COLOSSAL_CHECK_INPUT(amax.defined() && amax.scalar_type() == at::kFloat && amax.numel() == 1 &&
                           amax.device() == x.device(),
                       "cast_to_fp8_with_amax: the amax must be float32 [1] on ", x.device());
  return cast_with(x, fp8, false, transpose, amax.reshape({1}));
}

namespace {

void check_concat(const std::vector<at::Tensor>& xs) {
  COLOSSAL_CHECK_INPUT(!xs.empty(), "cast_to_fp8_concat: no tensors");
  for (const auto& x : xs) {
    check_cast(x, at::kFloat8_e4m3fn, false, false);
    COLOSSAL_CHECK_INPUT(x.size(1) == xs[0].size(1) && x.scalar_type() == xs[0].scalar_type() &&
                             x.device() == xs[0].device(),
                         "cast_to_fp8_concat: every tensor needs ", xs[0].size(1), " columns, ",
                         xs[0].scalar_type(), " on ", xs[0].device(), "; got ", x.sizes(), " ",
                         x.scalar_type(), " on ", x.device());
  }
}

}  // namespace

Fp8Tensor cast_to_fp8_concat_reference(const std::vector<at::Tensor>& xs, at::ScalarType fp8,
                                       bool transpose) {
  check_concat(xs);
  fp8_max(fp8);
  return reference_cast(at::cat(xs, 0), fp8, false, transpose, take_known_group_amax(xs));
}

Fp8Tensor cast_to_fp8_concat(const std::vector<at::Tensor>& xs, at::ScalarType fp8,
                             bool transpose) {
  check_concat(xs);
  if (path_for(xs[0]) != Path::Cuda) return cast_to_fp8_concat_reference(xs, fp8, transpose);
  fp8_max(fp8);
  std::vector<at::Tensor> parts;
  std::vector<const void*> ptrs;
  std::vector<int64_t> rows;
  int64_t total = 0;
  for (const auto& x : xs) {
    parts.push_back(x.contiguous());
    ptrs.push_back(parts.back().const_data_ptr());
    rows.push_back(x.size(0));
    total += x.size(0);
  }
  const int64_t cols = xs[0].size(1);
  auto f32 = parts[0].options().dtype(at::kFloat);
  // Every part's amax recorded (the optimizer's, for a fused group's weights): their max.
  const at::Tensor known_max = take_known_group_amax(xs);
  const bool given = known_max.defined();
  at::Tensor amax = given ? known_max : at::empty({1}, f32);
  at::Tensor scale = at::empty({1}, f32);
  Fp8Tensor out;
  out.inv_scale = at::empty({1}, f32);
  out.data = at::empty({total, cols}, parts[0].options().dtype(fp8));
  if (transpose) out.data_t = at::empty({cols, total}, parts[0].options().dtype(fp8));
#ifdef COLOSSAL_WITH_CUDA
  c10::DeviceGuard guard(parts[0].device());
  cuda::fp8_cast_rows_concat(
      ptrs, rows, cols, fp8 == at::kFloat8_e5m2, static_cast<float>(fp8_max(fp8)),
      amax.mutable_data_ptr<float>(), scale.mutable_data_ptr<float>(),
      out.inv_scale.mutable_data_ptr<float>(), static_cast<uint8_t*>(out.data.mutable_data_ptr()),
      transpose ? static_cast<uint8_t*>(out.data_t.mutable_data_ptr()) : nullptr,
      cuda_dtype(parts[0].scalar_type()), stream_of(parts[0]), given);
#endif
  return out;
}

}  // namespace colossal::kernels
