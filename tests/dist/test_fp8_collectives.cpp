// FP8-compressed collectives (dist/fp8_collectives.h) against a reference computed locally from
// every rank's (deterministic) input: each rank's values quantized here with plain ATen ops
// (scale = fp8_max / amax in fp32, round to nearest even, saturate), dequantized (fp8 value *
// 1/scale in fp32) and added in rank order in fp32. The collectives must match bit for bit.
// Run at world sizes 2, 1 and 3 (sizes not divisible by the world, zeros, bf16 and fp32).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "colossal/core/error.h"
#include "colossal/dist/fp8_collectives.h"
#include "dist_test_env.h"

namespace colossal::dist {
namespace {

const std::vector<at::ScalarType> kFormats = {at::kFloat8_e4m3fn, at::kFloat8_e5m2};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16};

// Rank r's input: normal values at a magnitude that differs per rank (so the scales differ).
at::Tensor input_of(int rank, int salt, int64_t n, at::ScalarType dtype) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(7919 * salt + rank + 1));
  at::Tensor x = at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat));
  return (x * std::pow(10.0, rank % 3 - 1)).to(dtype);
}

// One quantize-dequantize with its own scale per row of x [rows, n] (fp32 result).
at::Tensor round_trip(const at::Tensor& x, at::ScalarType fp8) {
  const double m = fp8 == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor amax = xf.abs().amax(1, /*keepdim=*/true).clamp_min(1e-12);
  at::Tensor scale = at::full_like(amax, m) / amax;
  at::Tensor q = (xf * scale).clamp(-m, m).to(fp8);
  return q.to(at::kFloat) * scale.reciprocal();
}

// Rows of xs added in rank order (fp32), divided by their count for Avg.
at::Tensor add_in_order(const std::vector<at::Tensor>& xs, ReduceOp op) {
  at::Tensor acc = xs[0].clone();
  for (size_t i = 1; i < xs.size(); ++i) acc = acc + xs[i];
  if (op == ReduceOp::Avg) acc = acc / static_cast<double>(xs.size());
  return acc;
}

void expect_bitwise(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want))
      << what << "\nmax |diff| " << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max();
}

std::string name_of(at::ScalarType fp8, at::ScalarType dt, int64_t n, ReduceOp op) {
  return str(fp8, " ", dt, " n=", n, " ", to_string(op));
}

// Reference reduce-scatter: slice `dst` of the reduction of every rank's [world, m] input.
at::Tensor rs_reference(const std::vector<at::Tensor>& xs, int world, int64_t m, int dst,
                        at::ScalarType fp8, ReduceOp op) {
  std::vector<at::Tensor> parts;
  for (const auto& x : xs) parts.push_back(round_trip(x.reshape({world, m}), fp8)[dst]);
  return add_in_order(parts, op);
}

TEST(Fp8Collectives, ReduceScatterMatchesReference) {
  auto& w = world();
  const int n = w.size(), me = w.rank();
  for (auto fp8 : kFormats)
    for (auto dt : kDtypes)
      for (int64_t m : {1, 7, 33})
        for (auto op : {ReduceOp::Sum, ReduceOp::Avg}) {
          std::vector<at::Tensor> xs;
          for (int r = 0; r < n; ++r) xs.push_back(input_of(r, 1, n * m, dt));
          at::Tensor out = at::empty({m}, at::TensorOptions().dtype(dt));
          reduce_scatter_fp8(w, out, xs[me], fp8, op);
          expect_bitwise(out, rs_reference(xs, n, m, me, fp8, op).to(dt),
                         "reduce_scatter_fp8 " + name_of(fp8, dt, m, op));
        }
}

TEST(Fp8Collectives, AllGatherMatchesReference) {
  auto& w = world();
  const int n = w.size(), me = w.rank();
  for (auto fp8 : kFormats)
    for (auto dt : kDtypes)
      for (int64_t k : {1, 5, 33}) {
        std::vector<at::Tensor> parts;
        for (int r = 0; r < n; ++r)
          parts.push_back(round_trip(input_of(r, 2, k, dt).reshape({1, k}), fp8).reshape({k}));
        at::Tensor want = at::cat(parts);
        at::Tensor out = at::empty({n * k}, at::TensorOptions().dtype(dt));
        all_gather_fp8(w, out, input_of(me, 2, k, dt), fp8);
        expect_bitwise(out, want.to(dt), "all_gather_fp8 " + name_of(fp8, dt, k, ReduceOp::Sum));
        // Another output dtype: the same dequantized values, converted once.
        at::Tensor out32 = at::empty({n * k}, at::TensorOptions().dtype(at::kFloat));
        all_gather_fp8(w, out32, input_of(me, 2, k, dt), fp8);
        expect_bitwise(out32, want, "all_gather_fp8 to fp32 " + name_of(fp8, dt, k, ReduceOp::Sum));
      }
}

// Reference all-reduce: the padded reduce-scatter of every slice, each slice requantized with
// its own scale (phase 2), concatenated and cut to n.
at::Tensor ar_reference(const std::vector<at::Tensor>& xs, int world, int64_t count,
                        at::ScalarType fp8, ReduceOp op) {
  const int64_t m = (count + world - 1) / world;
  std::vector<at::Tensor> padded;
  for (const auto& x : xs) {
    at::Tensor p = at::zeros({world * m}, x.options());
    p.narrow(0, 0, count).copy_(x.reshape({-1}));
    padded.push_back(p);
  }
  std::vector<at::Tensor> slices;
  for (int j = 0; j < world; ++j) {
    at::Tensor acc = rs_reference(padded, world, m, j, fp8, op);
    slices.push_back(round_trip(acc.reshape({1, m}), fp8).reshape({m}));
  }
  return at::cat(slices).narrow(0, 0, count);
}

TEST(Fp8Collectives, AllReduceMatchesReference) {
  auto& w = world();
  const int n = w.size(), me = w.rank();
  for (auto fp8 : kFormats)
    for (auto dt : kDtypes)
      for (int64_t count : {1, 7, 100, 257})
        for (auto op : {ReduceOp::Sum, ReduceOp::Avg}) {
          std::vector<at::Tensor> xs;
          for (int r = 0; r < n; ++r) xs.push_back(input_of(r, 3, count, dt));
          at::Tensor x = xs[me].clone();
          all_reduce_fp8(w, x, fp8, op);
          at::Tensor want = ar_reference(xs, n, count, fp8, op).to(dt);
          expect_bitwise(x, want, "all_reduce_fp8 " + name_of(fp8, dt, count, op));
          // A 2-D tensor reduces as its flattened elements and keeps its shape.
          if (count == 100) {
            at::Tensor x2 = xs[me].clone().view({10, 10});
            all_reduce_fp8(w, x2, fp8, op);
            expect_bitwise(x2, want.view({10, 10}), "all_reduce_fp8 2-D");
          }
        }
}

TEST(Fp8Collectives, CompressionIsReal) {
  // FP8 really travels: the result is not the exact sum (random values need more than 3 bits),
  // and is within FP8's relative error of it.
  auto& w = world();
  const int n = w.size(), me = w.rank();
  std::vector<at::Tensor> xs;
  for (int r = 0; r < n; ++r) xs.push_back(input_of(r, 4, 64, at::kFloat));
  at::Tensor exact = add_in_order(xs, ReduceOp::Sum);
  at::Tensor x = xs[me].clone();
  all_reduce_fp8(w, x, at::kFloat8_e4m3fn);
  EXPECT_FALSE(at::equal(x, exact));
  const double scale = exact.abs().max().item<double>();
  EXPECT_LT((x - exact).abs().max().item<double>(), 0.25 * scale);
}

TEST(Fp8Collectives, Zeros) {
  auto& w = world();
  const int n = w.size(), me = w.rank();
  for (auto fp8 : kFormats) {
    at::Tensor z = at::zeros({9}, at::kFloat);
    all_reduce_fp8(w, z, fp8, ReduceOp::Avg);
    EXPECT_TRUE(at::equal(z, at::zeros({9}, at::kFloat))) << z;
    // Zeros on some ranks, values on others: zero parts stay zero, the rest as the reference.
    std::vector<at::Tensor> xs;
    for (int r = 0; r < n; ++r)
      xs.push_back(r % 2 == 0 ? at::zeros({n * 5}, at::kBFloat16)
                              : input_of(r, 5, n * 5, at::kBFloat16));
    at::Tensor out = at::empty({5}, at::kBFloat16);
    reduce_scatter_fp8(w, out, xs[me], fp8, ReduceOp::Sum);
    expect_bitwise(out, rs_reference(xs, n, 5, me, fp8, ReduceOp::Sum).to(at::kBFloat16),
                   "reduce_scatter_fp8 with zero ranks");
    at::Tensor g = at::empty({n * 3}, at::kFloat);
    all_gather_fp8(w, g, at::zeros({3}, at::kFloat), fp8);
    EXPECT_TRUE(at::equal(g, at::zeros({n * 3}, at::kFloat))) << g;
  }
  // Nothing to move: no collective, no error.
  at::Tensor empty = at::empty({0}, at::kFloat);
  all_reduce_fp8(w, empty, at::kFloat8_e4m3fn);
  at::Tensor empty_out = at::empty({0}, at::kFloat);
  reduce_scatter_fp8(w, empty_out, empty, at::kFloat8_e4m3fn);
  all_gather_fp8(w, empty_out, empty, at::kFloat8_e4m3fn);
}

TEST(Fp8Collectives, NonFiniteReachesEveryRank) {
  // An fp16 loss-scale overflow on one rank must still be seen by all (GradScaler skips).
  auto& w = world();
  at::Tensor x = input_of(w.rank(), 6, 10, at::kFloat);
  if (w.rank() == 0) x[3] = std::numeric_limits<float>::infinity();
  all_reduce_fp8(w, x, at::kFloat8_e5m2, ReduceOp::Avg);
  EXPECT_FALSE(at::isfinite(x).all().item<bool>()) << x;
}

TEST(Fp8Collectives, AsyncMatchesSync) {
  auto& w = world();
  const int me = w.rank();
  at::Tensor a = input_of(me, 7, 11, at::kFloat), b = input_of(me, 8, 6, at::kBFloat16);
  at::Tensor a_sync = a.clone(), b_sync = b.clone();
  all_reduce_fp8(w, a_sync, at::kFloat8_e5m2, ReduceOp::Avg);
  all_reduce_fp8(w, b_sync, at::kFloat8_e4m3fn, ReduceOp::Sum);
  Work wa = all_reduce_fp8(w, a, at::kFloat8_e5m2, ReduceOp::Avg, /*async_op=*/true);
  Work wb = all_reduce_fp8(w, b, at::kFloat8_e4m3fn, ReduceOp::Sum, /*async_op=*/true);
  wa.wait();
  wb.wait();
  wa.wait();  // idempotent
  expect_bitwise(a, a_sync, "async all_reduce_fp8 (fp32)");
  expect_bitwise(b, b_sync, "async all_reduce_fp8 (bf16)");
  at::Tensor in = input_of(me, 9, w.size() * 4, at::kFloat);
  at::Tensor rs_sync = at::empty({4}, at::kFloat), rs = at::empty({4}, at::kFloat);
  reduce_scatter_fp8(w, rs_sync, in, at::kFloat8_e5m2, ReduceOp::Avg);
  Work wr = reduce_scatter_fp8(w, rs, in, at::kFloat8_e5m2, ReduceOp::Avg, true);
  at::Tensor ag_sync = at::empty({w.size() * 4}, at::kFloat), ag = at::empty_like(ag_sync);
  all_gather_fp8(w, ag_sync, rs_sync, at::kFloat8_e4m3fn);
  wr.wait();
  Work wg = all_gather_fp8(w, ag, rs, at::kFloat8_e4m3fn, true);
  wg.wait();
  expect_bitwise(rs, rs_sync, "async reduce_scatter_fp8");
  expect_bitwise(ag, ag_sync, "async all_gather_fp8");
}

template <class F>
void expect_input_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "no error; expected one mentioning '" << needle << "'";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Fp8Collectives, Refusals) {
  auto& w = world();
  at::Tensor x = at::ones({4}, at::kFloat);
  expect_input_error([&] { all_reduce_fp8(w, x, at::kFloat8_e4m3fn, ReduceOp::Max); },
                     "not available in FP8");
  at::Tensor i = at::ones({4}, at::kLong);
  expect_input_error([&] { all_reduce_fp8(w, i, at::kFloat8_e4m3fn); }, "Long");
  expect_input_error([&] { all_reduce_fp8(w, x, at::kBFloat16); }, "not an FP8 format");
  at::Tensor out = at::empty({3}, at::kFloat);
  expect_input_error([&] { reduce_scatter_fp8(w, out, x, at::kFloat8_e5m2); }, "expected size");
  expect_input_error([&] { all_gather_fp8(w, out, x, at::kFloat8_e5m2); }, "expected size");
  expect_input_error([&] { fp8_format("e3m4"); }, "e3m4");
  EXPECT_EQ(fp8_format("e4m3"), at::kFloat8_e4m3fn);
  EXPECT_EQ(fp8_format("e5m2"), at::kFloat8_e5m2);
}

}  // namespace
}  // namespace colossal::dist
