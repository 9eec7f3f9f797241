// NF4 quantisation (colossal/nn/nf4.h).
#include "colossal/nn/nf4.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>

#include "colossal/core/error.h"
#include "colossal/kernels/quant.h"

namespace colossal::nn {
namespace {

// Blockwise absmax scaling of flat fp32 x: {absmax [blocks], x / absmax clamped to [-1, 1]}.
std::pair<at::Tensor, at::Tensor> scale_blocks(const at::Tensor& x, int64_t blocksize) {
  const int64_t n = x.numel(), rem = n % blocksize, full = n - rem;
  at::Tensor absmax, scaled;
  if (full > 0) {
    at::Tensor blocks = x.narrow(0, 0, full).view({full / blocksize, blocksize});
    absmax = blocks.abs().amax(1);
    scaled = (blocks * absmax.clamp_min(1e-38).reciprocal().unsqueeze(1)).clamp(-1, 1).reshape(-1);
  }
  if (rem > 0) {
    at::Tensor tail = x.narrow(0, full, rem);
    at::Tensor am = tail.abs().amax().clamp_min(1e-38);
    at::Tensor ts = (tail / am).clamp(-1, 1);
    absmax = absmax.defined() ? at::cat({absmax, am.unsqueeze(0)}) : am.unsqueeze(0);
    scaled = scaled.defined() ? at::cat({scaled, ts}) : ts;
  }
  return {absmax, scaled};
}

// Index of the nearest level: the count of midpoints below the value (ties to the lower level).
at::Tensor nearest(const at::Tensor& scaled, const at::Tensor& levels) {
  at::Tensor bounds =
      (levels.narrow(0, 0, levels.size(0) - 1) + levels.narrow(0, 1, levels.size(0) - 1)) / 2;
  return at::bucketize(scaled, bounds, /*out_int32=*/true).to(at::kByte);
}

at::Tensor levels_on(const at::Device& d) {
  const auto& l = nf4_levels();
  return at::tensor(std::vector<float>(l.begin(), l.end()), at::kFloat).to(d);
}

at::Tensor build_dynamic_map() {
  // Dynamic tree quantisation, signed, 7 exponent bits in 8: for exponent i = 0..6, 2^i + 1
  // fraction boundaries linear in [0.1, 1], their midpoints times +-10^(i - 6), all in fp32 (a
  // double scalar times an fp32 tensor, as bitsandbytes builds it); then 0 and 1, ascending.
  std::vector<at::Tensor> parts;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = (int64_t{1} << i) + 1;
    at::Tensor b = at::linspace(0.1, 1.0, items, at::kFloat);
    at::Tensor means = (b.narrow(0, 0, items - 1) + b.narrow(0, 1, items - 1)) / 2;
    const double scale = std::pow(10.0, static_cast<double>(i - 6));
    parts.push_back(means * scale);
    parts.push_back(means * -scale);
  }
  parts.push_back(at::tensor(std::vector<float>{0.0f, 1.0f}, at::kFloat));
  at::Tensor map = std::get<0>(at::sort(at::cat(parts)));
  COLOSSAL_CHECK(map.numel() == 256, "dynamic map: ", map.numel(), " values");
  return map;
}

}  // namespace

int64_t NF4Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t NF4Tensor::bytes() const {
  int64_t b = codes.numel() + absmax.numel() * static_cast<int64_t>(absmax.element_size());
  if (absmax2.defined()) b += absmax2.numel() * 4 + 4;
  return b;
}

const std::array<float, 16>& nf4_levels() {
  return kernels::nf4_levels();
}

at::Tensor dynamic_map() {
  // Built once: every quantisation and dequantisation reads it.
  static const at::Tensor map = build_dynamic_map();
  return map;
}

at::Tensor dynamic_map_on(const at::Device& device) {
  if (device.is_cpu()) return dynamic_map();
  // One copy per device, made on first use (a QLoRA model dequantizes every layer each step).
  static std::mutex mu;
  static std::map<std::string, at::Tensor> copies;
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& t = copies[device.str()];
  if (!t.defined()) t = dynamic_map().to(device);
  return t;
}

NF4Tensor quantize_nf4(const at::Tensor& w, int64_t blocksize, bool double_quant) {
  COLOSSAL_CHECK_INPUT(w.defined() && w.numel() > 0, "quantize_nf4: empty tensor");
  COLOSSAL_CHECK_INPUT(at::isFloatingType(w.scalar_type()), "quantize_nf4: ", w.scalar_type(),
                       " is not a floating dtype");
  COLOSSAL_CHECK_INPUT(blocksize > 0 && blocksize % 2 == 0,
                       "quantize_nf4: blocksize must be positive and even, got ", blocksize);
  NF4Tensor q;
  q.blocksize = blocksize;
  q.shape = w.sizes().vec();
  q.dtype = w.scalar_type();
  q.double_quant = double_quant;
  at::Tensor x = w.detach().reshape(-1).to(at::kFloat);
  auto [absmax, scaled] = scale_blocks(x, blocksize);
  // An odd count: the last byte's low nibble holds the code of 0.
  if (scaled.numel() % 2) scaled = at::constant_pad_nd(scaled, {0, 1}, 0);
  at::Tensor codes = nearest(scaled, levels_on(x.device()));
  q.codes = at::bitwise_or(at::bitwise_left_shift(codes.slice(0, 0, codes.numel(), 2), 4),
                           codes.slice(0, 1, codes.numel(), 2))
                .contiguous();
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  at::Tensor mean = absmax.mean();
  q.offset = mean.item<float>();
  auto [absmax2, scaled2] = scale_blocks(absmax - mean, q.blocksize2);
  q.absmax = nearest(scaled2, dynamic_map_on(x.device()));
  q.absmax2 = absmax2;
  return q;
}

kernels::NF4View nf4_view(const NF4Tensor& q) {
  kernels::NF4View v;
  v.codes = q.codes;
  v.absmax = q.absmax;
  v.numel = q.numel();
  v.blocksize = q.blocksize;
  v.blocksize2 = q.blocksize2;
  if (q.double_quant) {
    v.absmax2 = q.absmax2;
    v.offset = q.offset;
    v.dmap = dynamic_map_on(q.codes.device());
  }
  return v;
}

at::Tensor dequantize_nf4(const NF4Tensor& q) {
  return dequantize_nf4(q, q.dtype);
}

at::Tensor dequantize_nf4(const NF4Tensor& q, at::ScalarType dtype) {
  return kernels::dequantize_nf4(nf4_view(q), dtype).view(q.shape);
}

at::Tensor dequantize_nf4_reference(const NF4Tensor& q, at::ScalarType dtype) {
  return kernels::dequantize_nf4_reference(nf4_view(q), dtype).view(q.shape);
}

}  // namespace colossal::nn
