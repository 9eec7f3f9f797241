// Fused kernels of the Llama training step (kernels/ layer): this umbrella header includes one
// header per op. Each op has a CUDA kernel for sm_90 (src/kernels/<op>.cu, built when nvcc is
// found) and a CPU path (fused loops in C++, src/kernels/<op>.cpp), chosen by the input's
// device; on a device with neither (e.g. MPS) the op runs the ATen composite that defines it
// (the *_reference functions), never silently something else.
//
// Numerics contract: each op equals its reference (the exact ATen composite the model used
// before, which is also what Hugging Face transformers computes) to within the rounding of the
// working dtype: fp32 to ~1e-6 relative, bf16/fp16 outputs to one unit in the last place,
// because the fused versions keep intermediates in fp32 where the composite rounds them.
// Forward ops are differentiable through autograd (custom autograd functions whose backward
// is fused too).
#pragma once

#include "colossal/kernels/adamw.h"            // fused_adamw, AdamWStep
#include "colossal/kernels/attention_merge.h"  // attention_merge
#include "colossal/kernels/cross_entropy.h"    // cross_entropy_grad_
#include "colossal/kernels/enabled.h"          // set_enabled, enabled, has_fused_kernels
#include "colossal/kernels/linear_concat.h"    // linear_concat
#include "colossal/kernels/rms_norm.h"         // rms_norm, add_rms_norm
#include "colossal/kernels/rotary.h"           // apply_rotary
#include "colossal/kernels/sum_squares.h"      // sum_squares
#include "colossal/kernels/swiglu.h"           // swiglu, swiglu_packed
