// Ring attention's blocks (nn/sequence_parallel.h: ring_block_forward, which merges into the
// rows' running result, and ring_block_backward, which adds into the gradient accumulators), the
// pieces each rank of ring_attn runs between its point-to-point hops. A causal attention over n
// tokens is cut the way a ring cuts it: rows and keys in two unequal parts A = [0, a) and B = [a,
// n), so the blocks are A x A (causal), B x A (every key; more queries than keys or fewer) and B x
// B (causal). Merged by log-sum-exp they must give the whole attention, and each block's backward,
// fed the merged output and log-sum-exp, must give the whole attention's gradients once summed:
// checked against autograd through the fp64 composite. The composite kernel is checked on the CPU
// (make test); ours and ATen's flash kernels (what ring_attn runs on a GPU in bf16) on the GPU,
// skipped without one (scripts/device_bench.sh ktests), plus ring_attention itself on one GPU (a
// ring of one rank: its diagonal block).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/kernels/attention.h"
#include "colossal/nn/sequence_parallel.h"

using namespace colossal;
using nn::RingBlockKernel;

namespace {

// softmax(q k^T * scale) v, causal from the top left, in fp64 with autograd; GQA by repeating.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t groups = q.size(1) / k.size(1);
  at::Tensor kk = k.repeat_interleave(groups, 1), vv = v.repeat_interleave(groups, 1);
  at::Tensor s = at::matmul(q, kk.transpose(-2, -1)) * scale;
  at::Tensor upper = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu_(1);
  s = s.masked_fill(upper, -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1), vv);
}

// ||got - want|| / ||want||, printed with `what` so the GPU log shows the measured errors.
double rel_err(const at::Tensor& got, const at::Tensor& want, const char* what) {
  at::Tensor g = got.to(at::kDouble).cpu(), w = want.to(at::kDouble).cpu();
  EXPECT_FALSE(g.isnan().any().item<bool>()) << "NaN in " << what;
  const double e = (g - w).norm().item<double>() / w.norm().item<double>();
  std::printf("  %-4s %.2e\n", what, e);
  return e;
}

struct Case {
  int64_t batch, heads, kv_heads, n, a, dim;
};

// The blocks of one causal attention over Case's n tokens, split at a, through `kernel` on
// tensors of `dtype` on `device`, against fp64 autograd. tol / grad_tol: the norm-relative
// error allowed for the output / each gradient.
void check_blocks(RingBlockKernel kernel, at::ScalarType dtype, const at::Device& device,
                  const Case& c, double tol, double grad_tol, uint64_t seed) {
  std::printf("%s %s B %lld H %lld/%lld n %lld a %lld D %lld\n", nn::to_string(kernel),
              device.str().c_str(), static_cast<long long>(c.batch),
              static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
              static_cast<long long>(c.n), static_cast<long long>(c.a),
              static_cast<long long>(c.dim));
  SCOPED_TRACE("B " + std::to_string(c.batch) + " H " + std::to_string(c.heads) + "/" +
               std::to_string(c.kv_heads) + " n " + std::to_string(c.n) + " a " +
               std::to_string(c.a) + " D " + std::to_string(c.dim));
  at::manual_seed(seed);
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  // Inputs rounded to the tested dtype first, so the reference sees exactly the kernel's inputs.
  auto input = [&](int64_t h) { return at::randn({c.batch, h, c.n, c.dim}, f64).to(dtype); };
  const at::Tensor q = input(c.heads), k = input(c.kv_heads), v = input(c.kv_heads);
  const at::Tensor dout = input(c.heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));

  at::Tensor q64 = q.to(at::kDouble).requires_grad_(), k64 = k.to(at::kDouble).requires_grad_(),
             v64 = v.to(at::kDouble).requires_grad_();
  const at::Tensor want = reference(q64, k64, v64, scale);
  want.backward(dout.to(at::kDouble));

  const at::Tensor qd = q.to(device), kd = k.to(device), vd = v.to(device), dd = dout.to(device);
  const int64_t a = c.a, b = c.n - c.a;
  auto rows = [](const at::Tensor& x, int64_t from, int64_t len) { return x.narrow(2, from, len); };
  struct Block {
    int64_t q0, qn, k0, kn;
    bool causal;
  };
  const std::vector<Block> blocks = {{0, a, 0, a, true}, {a, b, 0, a, false}, {a, b, a, b, true}};
  const at::TensorOptions f32 = qd.options().dtype(at::kFloat);
  at::Tensor out = at::zeros(qd.sizes(), f32);
  at::Tensor lse = at::full({c.batch, c.heads, c.n}, -std::numeric_limits<float>::infinity(), f32);
  for (const Block& blk : blocks)
    nn::ring_block_forward(kernel, rows(qd, blk.q0, blk.qn), rows(kd, blk.k0, blk.kn),
                           rows(vd, blk.k0, blk.kn), blk.causal, scale, rows(out, blk.q0, blk.qn),
                           lse.narrow(2, blk.q0, blk.qn));
  EXPECT_LE(rel_err(out, want.detach(), "out"), tol);

  // Each block's backward is given the merged rows, as ring_attn's backward gives them: fp32 for
  // the composite, else in the tested dtype (the output the forward returns).
  const at::Tensor merged = kernel == RingBlockKernel::composite ? out : out.to(dtype);
  at::Tensor dq = at::zeros(qd.sizes(), f32), dk = at::zeros(kd.sizes(), f32),
             dv = at::zeros(vd.sizes(), f32);
  for (const Block& blk : blocks)
    nn::ring_block_backward(
        kernel, rows(dd, blk.q0, blk.qn), rows(qd, blk.q0, blk.qn), rows(kd, blk.k0, blk.kn),
        rows(vd, blk.k0, blk.kn), rows(merged, blk.q0, blk.qn), lse.narrow(2, blk.q0, blk.qn),
        blk.causal, scale,
        {rows(dq, blk.q0, blk.qn), rows(dk, blk.k0, blk.kn), rows(dv, blk.k0, blk.kn)});
  EXPECT_LE(rel_err(dq, q64.grad(), "dq"), grad_tol);
  EXPECT_LE(rel_err(dk, k64.grad(), "dk"), grad_tol);
  EXPECT_LE(rel_err(dv, v64.grad(), "dv"), grad_tol);
}

const std::vector<Case>& cases() {
  // A third of the tokens in one part, as a ring's blocks are: B x A has twice as many queries
  // as keys (a = n / 3) or half as many (a = 2n / 3). Odd lengths, GQA 1 / 4, head dims 64 / 128.
  // The last: sides of no simple ratio (130 queries x 70 keys), which every kernel takes too.
  static const std::vector<Case> c = {{2, 4, 4, 96, 32, 64},
                                      {2, 4, 1, 96, 64, 64},
                                      {1, 8, 2, 189, 63, 128},
                                      {1, 8, 8, 189, 126, 128},
                                      {1, 4, 2, 200, 70, 64},
                                      // B x A of 1,024 x 512 at one kv head: 8 backward CTAs, so
                                      // ours cut its queries into 4 parts (kernels::
                                      // attention_backward_query_parts).
                                      {2, 4, 1, 1536, 512, 64}};
  return c;
}

// The error's text contains `needle`.
void expect_input_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no InputError (expected one naming '" << needle << "')";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

// The composite in fp32 on the CPU: fp32 rounding only (a few 1e-7 relative), 1e-5 allowed.
TEST(RingBlocks, CompositeMergesToTheWholeAttention) {
  uint64_t seed = 1;
  for (const Case& c : cases())
    check_blocks(RingBlockKernel::composite, at::kFloat, at::kCPU, c, 1e-5, 1e-5, seed++);
}

// The kernel choice: the composite off the GPU; COLOSSAL_RING_BLOCKS checked, and a forced
// kernel that cannot take the blocks refused with its reason.
TEST(RingBlocks, KernelChoice) {
  const at::Tensor cpu = at::zeros({1, 2, 4, 64}, at::kBFloat16);
  EXPECT_EQ(nn::ring_block_kernel(cpu), RingBlockKernel::composite);
  EXPECT_STREQ(nn::to_string(RingBlockKernel::flash), "flash");
  EXPECT_STREQ(nn::to_string(RingBlockKernel::own), "own");
  ::setenv("COLOSSAL_RING_BLOCKS", "flashy", 1);
  expect_input_error([&] { nn::ring_block_kernel(cpu); }, "flashy");
  ::setenv("COLOSSAL_RING_BLOCKS", "flash", 1);
  expect_input_error([&] { nn::ring_block_kernel(cpu); }, "not on a CUDA device");
  ::setenv("COLOSSAL_RING_BLOCKS", "own", 1);
  expect_input_error([&] { nn::ring_block_kernel(cpu); }, "COLOSSAL_RING_BLOCKS=own");
  ::setenv("COLOSSAL_RING_BLOCKS", "composite", 1);
  EXPECT_EQ(nn::ring_block_kernel(cpu), RingBlockKernel::composite);
  ::unsetenv("COLOSSAL_RING_BLOCKS");
  // flash has no deterministic backward: refused before any work.
  const at::Tensor x = at::zeros({1, 2, 4, 8}), l = at::zeros({1, 2, 4});
  expect_input_error(
      [&] {
        nn::ring_block_backward(RingBlockKernel::flash, x, x, x, x, x, l, true, 1.0, {x, x, x},
                                /*deterministic=*/true);
      },
      "no deterministic backward");
  // A causal block of unequal sides has no top-left alignment both kernels share: refused.
  EXPECT_THROW(nn::ring_block_forward(RingBlockKernel::composite, x, at::zeros({1, 2, 6, 8}),
                                      at::zeros({1, 2, 6, 8}), true, 1.0, x, l),
               InputError);
  // The running result and the accumulators: float32, shaped as the rows they hold.
  expect_input_error(
      [&] {
        nn::ring_block_forward(RingBlockKernel::composite, x, x, x, true, 1.0, x.to(at::kDouble),
                               l);
      },
      "out must be float32");
  expect_input_error(
      [&] {
        nn::ring_block_forward(RingBlockKernel::composite, x, x, x, true, 1.0, x,
                               at::zeros({1, 2, 3}));
      },
      "lse float32 [B, H, qn]");
  expect_input_error(
      [&] {
        nn::ring_block_backward(RingBlockKernel::composite, x, x, x, x, x, l, true, 1.0,
                                {x, x, at::zeros({1, 2, 4, 8}, at::kBFloat16)});
      },
      "accumulators dq, dk, dv must be float32");
}

// ATen's flash kernels and ours in bf16 on the GPU. bf16 keeps 8 significant bits (unit
// roundoff 2^-9, 2e-3): the inputs are exact in both, but the kernels round P to bf16 for the
// P V GEMM and return each block's output in bf16 before the merge (output: two roundings, 1e-2
// allowed); the backward also rounds dS, and reads the merged output and dout in bf16 for
// rowsum(dO * O), whose difference from dP cancels digits (gradients: 2e-2 allowed). A wrong
// log-sum-exp, block, merge or layout is off by tens of percent. The measured errors are
// printed. Ours run where they apply (an H100 / H200; an InputError elsewhere says why).
TEST(RingBlocks, KernelsOnTheGpu) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  const at::Tensor bf16 = at::zeros({1, 2, 4, 64}, at::TensorOptions(dev).dtype(at::kBFloat16));
  const bool own = kernels::own_attention_unsupported(bf16[0], bf16[0]).empty();
  EXPECT_EQ(nn::ring_block_kernel(bf16), own ? RingBlockKernel::own : RingBlockKernel::flash);
  // Head dim 128 as 64: ours where they apply (measured faster than flash at both).
  const at::Tensor bf16_128 = at::zeros({1, 2, 4, 128}, bf16.options());
  EXPECT_EQ(nn::ring_block_kernel(bf16_128), own ? RingBlockKernel::own : RingBlockKernel::flash);
  EXPECT_EQ(nn::ring_block_kernel(bf16_128, true),
            own ? RingBlockKernel::own : RingBlockKernel::composite);
  EXPECT_EQ(nn::ring_block_kernel(at::zeros({1, 2, 4, 64}, at::TensorOptions(dev))),
            RingBlockKernel::composite);
  // Deterministic: ours (its fixed-order dQ sums) or the composite, never flash.
  EXPECT_EQ(nn::ring_block_kernel(bf16, true),
            own ? RingBlockKernel::own : RingBlockKernel::composite);
  ::setenv("COLOSSAL_RING_BLOCKS", "flash", 1);
  EXPECT_EQ(nn::ring_block_kernel(bf16), RingBlockKernel::flash);
  expect_input_error([&] { nn::ring_block_kernel(bf16, true); }, "no deterministic backward");
  ::unsetenv("COLOSSAL_RING_BLOCKS");
  // The last case's tall block takes the parts' path on any card of 32 SMs or more.
  if (own) {
    EXPECT_EQ(kernels::attention_backward_query_parts(2, 1024, 512, 1,
                                                      kernels::attention_multiprocessors(dev)),
              4);
  }
  uint64_t seed = 11;
  for (const Case& c : cases()) {
    if (own) check_blocks(RingBlockKernel::own, at::kBFloat16, dev, c, 1e-2, 2e-2, seed);
    check_blocks(RingBlockKernel::flash, at::kBFloat16, dev, c, 1e-2, 2e-2, seed);
    // The composite on the GPU, same bf16 inputs: fp32 (TF32 left off by LibTorch's default).
    check_blocks(RingBlockKernel::composite, at::kBFloat16, dev, c, 1e-4, 1e-4, seed++);
  }
}

// ring_attention on one GPU (a ring of one rank runs only its diagonal block) through autograd,
// bf16 in, against the fp64 reference: what ring_attn's layers run, end to end, with each kernel
// that applies.
TEST(RingBlocks, RingAttentionOnTheGpu) {
  if (!Accelerator::cuda().available()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev = Accelerator::cuda().device();
  at::manual_seed(5);
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({2, 8, 130, 128}, f64).to(at::kBFloat16);
  const at::Tensor k = at::randn({2, 2, 130, 128}, f64).to(at::kBFloat16);
  const at::Tensor v = at::randn({2, 2, 130, 128}, f64).to(at::kBFloat16);
  const at::Tensor dout = at::randn({2, 8, 130, 128}, f64).to(at::kBFloat16);
  at::Tensor q64 = q.to(at::kDouble).requires_grad_(), k64 = k.to(at::kDouble).requires_grad_(),
             v64 = v.to(at::kDouble).requires_grad_();
  const at::Tensor want = reference(q64, k64, v64, 1.0 / std::sqrt(128.0));
  want.backward(dout.to(at::kDouble));
  std::vector<std::string> kernels_to_run = {"flash"};
  if (kernels::own_attention_unsupported(q.to(dev)[0], k.to(dev)[0]).empty())
    kernels_to_run.push_back("own");
  // Inputs as [B, H, S, D] tensors, and tokens-major ([B, S, H, D] memory seen as [B, H, S, D]:
  // what the model's projections and rotary kernel hand over, read without copies).
  for (const std::string& kernel : kernels_to_run)
    for (bool tokens_major : {false, true}) {
      SCOPED_TRACE(kernel + (tokens_major ? " tokens-major" : " heads-major"));
      std::printf("ring_attention %s %s\n", kernel.c_str(),
                  tokens_major ? "tokens-major" : "heads-major");
      ::setenv("COLOSSAL_RING_BLOCKS", kernel.c_str(), 1);
      auto leaf = [&](const at::Tensor& x) {
        return (tokens_major ? x.transpose(1, 2).contiguous() : x).to(dev).requires_grad_();
      };
      auto as_bhsd = [&](const at::Tensor& x) { return tokens_major ? x.transpose(1, 2) : x; };
      at::Tensor qd = leaf(q), kd = leaf(k), vd = leaf(v);
      const at::Tensor out =
          nn::ring_attention(as_bhsd(qd), as_bhsd(kd), as_bhsd(vd), dist::Communicator(), true);
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      out.backward(dout.to(dev));
      // As KernelsOnTheGpu, plus the output's and the gradients' own rounding to bf16 (2^-9).
      EXPECT_LE(rel_err(out, want.detach(), "out"), 1e-2);
      EXPECT_LE(rel_err(as_bhsd(qd.grad()), q64.grad(), "dq"), 2e-2);
      EXPECT_LE(rel_err(as_bhsd(kd.grad()), k64.grad(), "dk"), 2e-2);
      EXPECT_LE(rel_err(as_bhsd(vd.grad()), v64.grad(), "dv"), 2e-2);
    }
  ::unsetenv("COLOSSAL_RING_BLOCKS");
  // Deterministic (--deterministic): two runs give the same bits.
  std::vector<at::Tensor> first;
  for (int run = 0; run < 2; ++run) {
    at::Tensor qd = q.to(dev).requires_grad_(), kd = k.to(dev).requires_grad_(),
               vd = v.to(dev).requires_grad_();
    const at::Tensor out = nn::ring_attention(qd, kd, vd, dist::Communicator(), true, 0, true);
    out.backward(dout.to(dev));
    const std::vector<at::Tensor> got = {out, qd.grad(), kd.grad(), vd.grad()};
    if (run == 0) {
      first = got;
      EXPECT_LE(rel_err(qd.grad(), q64.grad(), "dq"), 2e-2);
      continue;
    }
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(at::equal(got[i], first[i])) << "deterministic run differs in tensor " << i;
  }
}
