// Fused kernels of the Llama training step (kernels/ layer). Each op has a CUDA kernel for sm_90
// (src/kernels/*.cu, built when nvcc is found) and a CPU path (fused loops in C++), chosen by
// the input's device; on a device with neither (e.g. MPS) the op runs the ATen composite that
// defines it (the *_reference functions below), never silently something else.
//
// Numerics contract: each op equals its reference (the exact ATen composite the model used
// before, which is also what Hugging Face transformers computes) to within the rounding of the
// working dtype: fp32 to ~1e-6 relative, bf16/fp16 outputs to one unit in the last place,
// because the fused versions keep intermediates in fp32 where the composite rounds them.
// Forward ops are differentiable through autograd (custom autograd functions whose backward
// is fused too).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace colossal::kernels {

// ---- RMSNorm (HF LlamaRMSNorm) -------------------------------------------------------------
// x [..., H] fp32/bf16/fp16, weight [H] of x's dtype:
//   y = weight * to_dtype(x_f32 * rsqrt(mean(x_f32^2, -1) + eps))
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// ---- Residual add + RMSNorm (the seam between pre-norm blocks) -------------------------------
// x, r [..., H] of one dtype and device, weight [H]: returns {h, y} with h = x + r (rounded to
// the dtype, as ATen's add) and y = rms_norm(h, weight, eps). Backward: x and r both receive
// dh + (rms_norm's input gradient), summed in the working dtype as autograd sums them. On CUDA
// one kernel each way (the add and the residual gradient's sum ride on the norm's passes);
// on CPU the add is ATen's and the norm the fused loop.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                               const at::Tensor& weight, double eps);
std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& x, const at::Tensor& r,
                                                         const at::Tensor& weight, double eps);

// ---- Rotary position embedding (HF apply_rotary_pos_emb, rotate_half convention) ------------
// x [B, heads, S, D] (any strides with a unit last stride, e.g. the transposed projection
// output), cos/sin [B, S, D] of x's dtype:  y = x * cos + rotate_half(x) * sin,
// rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). The result has x's shape; it is stored
// [B, S, heads, D]-contiguous (a transposed view), the layout SDPA's flash kernel reads.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor apply_rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// ---- SwiGLU --------------------------------------------------------------------------------
// gate, up [..., F] of one dtype: y = silu(gate) * up (HF LlamaMLP's act_fn(gate) * up).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
at::Tensor swiglu_reference(const at::Tensor& gate, const at::Tensor& up);

// ---- Packed SwiGLU -------------------------------------------------------------------------
// gu [..., 2F] (gate in the first F columns, up in the last F, e.g. linear_concat's output of
// gate_proj and up_proj): y = silu(gate) * up, [..., F]. The gradient comes back packed in one
// [..., 2F] tensor, which is what linear_concat's backward reads (no split/cat copies).
at::Tensor swiglu_packed(const at::Tensor& gu);
at::Tensor swiglu_packed_reference(const at::Tensor& gu);

// ---- Concatenated linear (one GEMM for layers that read the same input) ---------------------
// y = cat([x·W1ᵀ + b1, x·W2ᵀ + b2, ...], -1) as one GEMM against the concatenated weight, e.g.
// q/k/v or gate/up. The concatenated weight exists only during the forward GEMM and is rebuilt
// for backward (never saved: no second copy of the weights lives until backward); the weight
// gradients are row blocks of one GEMM, dx one GEMM. biases: empty, or one per weight.
// An ATen composite (cuBLAS / CPU BLAS), so it runs on any device.
at::Tensor linear_concat(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& biases = {});
at::Tensor linear_concat_reference(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<at::Tensor>& biases = {});

// ---- Softmax cross-entropy and its gradient, in place (the fused CE's per-chunk step) ---------
// logits [n, V] contiguous fp32/bf16/fp16 (overwritten), targets [n] int64 in [0, V) or
// ignore_index, scale: an fp32 scalar tensor on logits' device (no host sync), or undefined = 1.
// Returns the per-row loss, fp32 [n]: logsumexp(row) - row[target] (0 on ignored rows), and
// overwrites logits with (softmax(row) - onehot(target)) * scale (0 on ignored rows), rounded
// to logits' dtype: the gradient of sum(loss) * scale. One read for the statistics (fp32), one
// read and one write for the gradient. A target outside [0, V) is an error (on CUDA: the kernel
// prints it and traps, as ATen's gather does).
at::Tensor cross_entropy_grad_(at::Tensor& logits, const at::Tensor& targets,
                               int64_t ignore_index, const at::Tensor& scale);
at::Tensor cross_entropy_grad_reference_(at::Tensor& logits, const at::Tensor& targets,
                                         int64_t ignore_index, const at::Tensor& scale);

// ---- Sum of squares of a tensor list (the gradient norm's pass) ------------------------------
// fp64 scalar tensor on the tensors' device: sum over every element of every tensor of x^2
// (inf/nan propagate). All tensors on one device; any float dtypes (grouped per dtype). On
// CUDA: squares summed in fp32 within blocks of 65536 elements, the block partials in fp64.
// Elsewhere (CPU included) the ATen composite: fp64 _foreach_norm, squared and summed.
at::Tensor sum_squares(const std::vector<at::Tensor>& tensors);
at::Tensor sum_squares_reference(const std::vector<at::Tensor>& tensors);

// ---- Multi-tensor AdamW on fp32 masters ------------------------------------------------------
// torch.optim.AdamW semantics (decoupled weight decay, bias-corrected), one step for every
// tensor of the lists, in as few launches as the sizes allow (one per ~chunk of tensors):
//   g    = grad / grad_divisor                      (grad fp32, bf16 or fp16; read, not changed)
//   p    = p * (1 - lr * weight_decay)
//   m    = beta1 * m + (1 - beta1) * g
//   v    = beta2 * v + (1 - beta2) * g^2
//   p    = p - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//   out  = to_dtype(p)                                 (only when `working` is not empty)
// params, exp_avgs, exp_avg_sqs: fp32, contiguous; grads: same shapes; working: empty, or one
// bf16/fp16 tensor per param (the model's working weights, written with the updated master).
// All tensors on one device. Errors (InputError/Error) name the offending list index.
struct AdamWStep {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;           // counted after the increment: 1 on the first update
  double grad_divisor = 1.0;  // gradients are divided by this (unscale and clip folded in)
};
void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& working,
                 const AdamWStep& hyper);
// The same update by ATen ops (grad upcast, at::_foreach_* math, working.copy_(p)).
void fused_adamw_reference(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& working, const AdamWStep& hyper);

// Process-wide switch (default on) read by the model layers and the optimizers: off, they run
// the ATen composites instead (A/B measurements: `colossal bench --fused_kernels false`).
void set_enabled(bool on);
bool enabled();

// Whether `t`'s device has our fused kernel for the ops above (CPU always; CUDA when this
// build compiled the .cu files).
bool has_fused_kernels(const at::Tensor& t);

}  // namespace colossal::kernels
