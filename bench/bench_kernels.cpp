// Micro-benchmark of the fused kernels (kernels/fused.h) against the ATen composites they
// replace, next to the GPU's measured ceilings.
//
// On CUDA: the ceilings first (device copy GB/s counting read + write; bf16 GEMM 8192^3
// TFLOPS on random data), then RMSNorm / rotary / SwiGLU forward and backward at the Llama
// shapes of presets 1b (tokens 16384, H 2048, F 5632, heads 32/4, D 64) and 7b (tokens 4096 and
// 16384, H 4096, F 11008, heads 32, D 128), the multi-tensor AdamW over the 1b and 7b parameter
// lists (bf16 grads, fp32 master/m/v, bf16 working out) against at::_fused_adamw_ on fp32
// grads with separate casts, and the SDPA backends (flash, cuDNN, memory-efficient) at the W1/W2
// attention shapes. Times are medians of per-rep CUDA-event timings after warm-up; GB/s counts
// the minimal bytes each op must move. On a CPU-only machine the CPU paths run at small sizes.
//
// One op at a time (llm.c's per-op benchmark): `--op NAME` runs the ceilings and that op's
// cases only, `--list` names the ops. The ops outside the default run (add_rms_norm,
// swiglu_packed, linear_concat, cross_entropy_grad, sum_squares) are measured only this way.
//
//   bench_kernels [--reps N] [--warmup N] [--json FILE] [--cpu] [--copies | --rows | --op NAME]
//                 [--doc_index FILE] [--attn_case W1|W2|W2-B4] [--timing_log FILE]
//   bench_kernels --list
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/data/documents.h"
#include "colossal/kernels/attention.h"
#include "colossal/kernels/attention_merge.h"
#include "colossal/kernels/fp8.h"
#include "colossal/kernels/fused.h"
#include "colossal/kernels/quant.h"
#include "colossal/nn/sequence_parallel.h"
#include "documents.h"

#ifdef COLOSSAL_WITH_CUDNN_FRONTEND
#include "cudnn_sdpa.h"
#endif

using namespace colossal;
namespace K = colossal::kernels;

namespace {

struct Opts {
  int reps = 20, warmup = 5;
  std::string json;
  bool cpu = false;
  bool copies_only = false;  // --copies: ceilings and host<->device copies only
  bool rows_only = false;    // --rows: ceilings and the row ops (RMSNorm, rotary, SwiGLU) only
  std::string op;            // --op NAME: ceilings and this op only
  // --doc_index FILE (a `colossal prepare` document index): --op attention's packed documents
  // take their lengths from it (a real corpus's), besides the log-normal stand-in.
  std::string doc_index;
  // --attn_case W1 | W2 | W2-B4: --op attention runs that case only (a profiler's run).
  std::string attn_case;
  // --timing_log FILE: each timing appends a line "start end rep_ms..." (wall-clock seconds since
  // the epoch when its warm-up had been issued and when its reps were done, then every rep's
  // time), in row order, so a sampler's clocks and power (scripts/attn_clocks.py) can be matched
  // to the rows. The warm-up is left out: the first call of a library may spend it on the host
  // (cuDNN builds its plans) with the GPU idle.
  std::string timing_log;
};

struct Row {
  Row(std::string g, std::string n, std::string s, std::string d)
      : group(std::move(g)), name(std::move(n)), shape(std::move(s)), dir(std::move(d)) {}
  std::string group, name, shape, dir;
  double fused_ms = -1, aten_ms = -1, bytes = 0, flops = 0;
  std::string note;
};

bool g_cuda = false;
Opts g_opts;
double g_copy_gbs = 0, g_gemm_tflops = 0;
std::vector<Row> g_rows;

at::TensorOptions opts(at::ScalarType dt = at::kBFloat16) {
  return at::TensorOptions().dtype(dt).device(g_cuda ? at::Device(at::kCUDA, 0)
                                                     : at::Device(at::kCPU));
}

double epoch_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One line of --timing_log: the timing's window and every rep's milliseconds.
void log_timing(double start, const std::vector<double>& t) {
  if (g_opts.timing_log.empty()) return;
  std::FILE* f = std::fopen(g_opts.timing_log.c_str(), "a");
  if (f == nullptr) {
    std::fprintf(stderr, "bench_kernels: cannot append to --timing_log %s\n",
                 g_opts.timing_log.c_str());
    std::exit(2);
  }
  std::fprintf(f, "%.3f %.3f", start, epoch_s());
  for (double ms : t) std::fprintf(f, " %.4f", ms);
  std::fprintf(f, "\n");
  std::fclose(f);
}

double median_of(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Medians of CUDA bodies timed by events in rotation, after warm-up: round i runs body i mod n
// first (two bodies: a b, b a, a b, ...); `setup` runs untimed before each. Bodies timed one
// after the other can meet different clocks: under a long enough load the card reaches its
// power limit and lowers its SM clock (an H100 at W2 B4: about 12 % slower within 30 reps,
// 0.13 s, both libraries alike; scripts/attn_clocks.py), so a body timed after a pause runs
// faster. Rotating gives them the same clocks. One --timing_log line per body, in order.
std::vector<double> cuda_medians_ms(const std::vector<std::function<void()>>& bodies,
                                    const std::function<void()>& setup = nullptr) {
  const size_t n = bodies.size();
  for (int i = 0; i < g_opts.warmup; ++i)
    for (const auto& body : bodies) {
      if (setup) setup();
      body();
    }
  const double start = epoch_s();
  Accelerator& acc = Accelerator::cuda();
  std::vector<std::vector<std::unique_ptr<Event>>> begin(n), end(n);
  for (int i = 0; i < g_opts.reps; ++i)
    for (size_t j = 0; j < n; ++j) {
      const size_t which = (static_cast<size_t>(i) + j) % n;
      if (setup) setup();
      begin[which].push_back(acc.new_event(true));
      end[which].push_back(acc.new_event(true));
      begin[which].back()->record();
      bodies[which]();
      end[which].back()->record();
    }
  acc.synchronize();
  std::vector<double> medians;
  for (size_t w = 0; w < n; ++w) {
    std::vector<double> t;
    for (int i = 0; i < g_opts.reps; ++i)
      t.push_back(begin[w][static_cast<size_t>(i)]->elapsed_ms(*end[w][static_cast<size_t>(i)]));
    log_timing(start, t);
    medians.push_back(median_of(std::move(t)));
  }
  return medians;
}

// Median milliseconds of `body` over reps, after warm-up; `setup` runs untimed before each rep.
double median_ms(const std::function<void()>& body, const std::function<void()>& setup = nullptr) {
  if (g_cuda) return cuda_medians_ms({body}, setup)[0];
  for (int i = 0; i < g_opts.warmup; ++i) {
    if (setup) setup();
    body();
  }
  const double start = epoch_s();
  std::vector<double> t;
  for (int i = 0; i < g_opts.reps; ++i) {
    if (setup) setup();
    auto s = std::chrono::steady_clock::now();
    body();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
  }
  log_timing(start, t);
  return median_of(t);
}

// Medians of two CUDA bodies timed in alternation (cuda_medians_ms), a's then b's.
std::pair<double, double> median_ms_alternating(const std::function<void()>& a,
                                                const std::function<void()>& b) {
  const std::vector<double> m = cuda_medians_ms({a, b});
  return {m[0], m[1]};
}

std::string shape_str(std::initializer_list<int64_t> s) {
  std::string out;
  for (int64_t v : s) out += (out.empty() ? "" : "x") + std::to_string(v);
  return out;
}

void sync() {
  if (g_cuda) Accelerator::cuda().synchronize();
}

// ---- ceilings ----
void ceilings() {
  const int64_t n = g_cuda ? (int64_t(1) << 30) : (int64_t(1) << 24);  // bytes per buffer / 1
  at::Tensor a = at::empty({n}, opts(at::kByte)).fill_(1), b = at::empty_like(a);
  const double ms = median_ms([&] { b.copy_(a); });
  g_copy_gbs = 2.0 * double(n) / (ms * 1e6);
  const int64_t m = g_cuda ? 8192 : 512;
  at::Tensor x = at::randn({m, m}, opts()), y = at::randn({m, m}, opts());
  const double gms = median_ms([&] { at::mm(x, y); });
  g_gemm_tflops = 2.0 * double(m) * m * m / (gms * 1e9);
  std::printf(
      "ceilings: device copy %.0f GB/s (read+write, %ld MiB), bf16 GEMM %ld^3 %.1f TFLOPS\n",
      g_copy_gbs, long(n >> 20), long(m), g_gemm_tflops);
}

// ---- host <-> device copies (the reference for Gemini's chunk traffic) ----
// Pinned and pageable host buffers, both directions, at chunk-like sizes; GB/s = bytes / time.
void host_copies() {
  if (!g_cuda) return;
  for (int64_t mib : {32, 128, 512}) {
    const int64_t n = mib << 20;
    at::Tensor dev = at::empty({n}, opts(at::kByte)).fill_(1);
    for (bool pinned : {true, false}) {
      at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
      host.fill_(2);
      const double up = median_ms([&] { dev.copy_(host, /*non_blocking=*/pinned); });
      const double down = median_ms([&] { host.copy_(dev, /*non_blocking=*/pinned); });
      std::printf("host copy %s %4ld MiB: host->device %.1f GB/s, device->host %.1f GB/s\n",
                  pinned ? "pinned  " : "pageable", long(mib), double(n) / (up * 1e6),
                  double(n) / (down * 1e6));
      Row r("host_copy", pinned ? "pinned" : "pageable", std::to_string(mib) + "MiB", "h2d");
      r.fused_ms = up;
      r.bytes = double(n);
      g_rows.push_back(r);
      Row d("host_copy", pinned ? "pinned" : "pageable", std::to_string(mib) + "MiB", "d2h");
      d.fused_ms = down;
      d.bytes = double(n);
      g_rows.push_back(d);
    }
  }
}

// ---- elementwise / row ops ----
// Times fused vs composite forward, and backward (forward untimed, then the gradient call).
void fwd_bwd(const std::string& group, const std::string& name, const std::string& shape,
             const std::vector<at::Tensor>& inputs,
             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fused,
             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& aten,
             const std::vector<bool>& grad_of, double fwd_bytes, double bwd_bytes) {
  Row f{group, name, shape, "fwd"};
  {
    at::NoGradGuard ng;
    f.fused_ms = median_ms([&] { fused(inputs); });
    f.aten_ms = median_ms([&] { aten(inputs); });
  }
  f.bytes = fwd_bytes;
  g_rows.push_back(f);
  Row b{group, name, shape, "bwd"};
  std::vector<at::Tensor> leaves;
  std::vector<at::Tensor> in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor t = inputs[i].detach();
    if (grad_of[i]) {
      t.requires_grad_(true);
      leaves.push_back(t);
    }
    in.push_back(t);
  }
  for (int which = 0; which < 2; ++which) {
    at::Tensor y, dy;
    auto setup = [&] {
      y = which == 0 ? fused(in) : aten(in);
      if (!dy.defined()) dy = at::randn_like(y);
    };
    const double ms = median_ms([&] { torch::autograd::grad({y}, leaves, {dy}); }, setup);
    (which == 0 ? b.fused_ms : b.aten_ms) = ms;
  }
  b.bytes = bwd_bytes;
  g_rows.push_back(b);
}

// The shapes of the row ops: a Llama preset's hidden, FFN and head sizes at a token count.
struct Preset {
  std::string name;
  int64_t tokens, h, f, heads, kv, d;
  std::string tag() const { return name + " T=" + std::to_string(tokens); }
};

std::vector<Preset> row_presets() {
  if (!g_cuda) return {{"tiny", 512, 256, 688, 4, 2, 64}};
  return {{"1b", 16384, 2048, 5632, 32, 4, 64},
          {"7b", 4096, 4096, 11008, 32, 32, 128},
          {"7b", 16384, 4096, 11008, 32, 32, 128}};
}

constexpr double kBf16 = 2;  // bytes per element of the benchmarks' working dtype

void bench_rms_norm(const Preset& p) {
  const int64_t tokens = p.tokens, h = p.h;
  const double e = kBf16;
  at::Tensor x = at::randn({tokens, h}, opts()), w = at::rand({h}, opts()) + 0.5;
  fwd_bwd(
      "rms_norm", p.tag(), shape_str({tokens, h}), {x, w},
      [](const auto& v) { return K::rms_norm(v[0], v[1], 1e-5); },
      [](const auto& v) { return K::rms_norm_reference(v[0], v[1], 1e-5); }, {true, true},
      2 * tokens * h * e + 4.0 * tokens, 3 * tokens * h * e + 4.0 * tokens);
}

void bench_rotary(const Preset& p) {
  const int64_t tokens = p.tokens, heads = p.heads, d = p.d;
  const double e = kBf16;
  // q as the projection produces it: [B, S, heads, D] viewed [B, heads, S, D]; B*S = tokens
  const int64_t s = std::min<int64_t>(tokens, p.name == "1b" ? 2048 : 4096), b = tokens / s;
  at::Tensor q = at::randn({b, s, heads, d}, opts()).transpose(1, 2);
  at::Tensor ang = at::rand({b, s, d}, opts(at::kFloat)) * 6.28;
  at::Tensor c = ang.cos().to(at::kBFloat16), sn = ang.sin().to(at::kBFloat16);
  const double bytes = 2 * tokens * heads * d * e + 2 * b * s * d * e;
  fwd_bwd(
      "rotary", p.tag(), shape_str({b, heads, s, d}), {q, c, sn},
      [](const auto& v) { return K::apply_rotary(v[0], v[1], v[2]); },
      [](const auto& v) { return K::apply_rotary_reference(v[0], v[1], v[2]); },
      {true, false, false}, bytes, bytes);
}

void bench_swiglu(const Preset& p) {
  const int64_t tokens = p.tokens, f = p.f;
  const double e = kBf16;
  at::Tensor g = at::randn({tokens, f}, opts()), u = at::randn({tokens, f}, opts());
  fwd_bwd(
      "swiglu", p.tag(), shape_str({tokens, f}), {g, u},
      [](const auto& v) { return K::swiglu(v[0], v[1]); },
      [](const auto& v) { return K::swiglu_reference(v[0], v[1]); }, {true, true},
      3 * tokens * f * e, 5 * tokens * f * e);
}

// The default run's row ops of one preset, in their historical order.
void row_ops(const Preset& p) {
  bench_rms_norm(p);
  bench_rotary(p);
  bench_swiglu(p);
}

// ---- AdamW ----
// The parameter shapes of a Llama preset (untied embeddings).
std::vector<std::vector<int64_t>> llama_params(int64_t layers, int64_t h, int64_t f, int64_t heads,
                                               int64_t kv, int64_t vocab) {
  const int64_t d = h / heads;
  std::vector<std::vector<int64_t>> p = {{vocab, h}};
  for (int64_t l = 0; l < layers; ++l) {
    for (auto s : std::vector<std::vector<int64_t>>{{heads * d, h},
                                                    {kv * d, h},
                                                    {kv * d, h},
                                                    {h, heads * d},
                                                    {f, h},
                                                    {f, h},
                                                    {h, f},
                                                    {h},
                                                    {h}})
      p.push_back(s);
  }
  p.push_back({h});
  p.push_back({vocab, h});
  return p;
}

void adamw(const std::string& name, const std::vector<std::vector<int64_t>>& shapes) {
  Row r{"fused_adamw", name, "", "step"};
  double n = 0;
  for (const auto& s : shapes) {
    double k = 1;
    for (int64_t v : s) k *= double(v);
    n += k;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2fe9 params, %zu tensors", n / 1e9, shapes.size());
  r.shape = buf;
  r.bytes = 28 * n;  // read p, m, v (fp32), g (bf16); write p, m, v, working (bf16)
  try {
    std::vector<at::Tensor> p, g, m, v, w;
    for (const auto& s : shapes) {
      p.push_back(at::randn(s, opts(at::kFloat)) * 0.02);
      g.push_back(at::randn(s, opts()) * 1e-3);
      m.push_back(at::zeros(s, opts(at::kFloat)));
      v.push_back(at::zeros(s, opts(at::kFloat)));
      w.push_back(at::empty(s, opts()));
    }
    K::AdamWStep hy;
    hy.lr = 1e-4;
    hy.weight_decay = 0.1;
    r.fused_ms = median_ms([&] { K::fused_adamw(p, g, m, v, w, hy); });
    try {
      // What a PyTorch user runs: fp32 grads (upcast), the fused ATen step, the bf16 cast.
      std::vector<at::Tensor> steps, g32;
      for (size_t i = 0; i < p.size(); ++i) {
        steps.push_back(at::ones({}, opts(at::kFloat)));
        g32.push_back(at::empty(p[i].sizes(), opts(at::kFloat)));
      }
      r.aten_ms = median_ms([&] {
        for (size_t i = 0; i < p.size(); ++i) g32[i].copy_(g[i]);
        at::_fused_adamw_(p, g32, m, v, {}, steps, hy.lr, hy.beta1, hy.beta2, hy.weight_decay,
                          hy.eps, false, false, std::nullopt, std::nullopt);
        for (size_t i = 0; i < p.size(); ++i) w[i].copy_(p[i]);
      });
    } catch (const c10::OutOfMemoryError&) {
      r.note = "ATen side: out of memory for the fp32 grads";
    }
  } catch (const c10::OutOfMemoryError&) {
    r.note = "out of memory";
  }
  sync();
  g_rows.push_back(r);
}

// ---- SDPA backends ----
// "B8 h32/4 S2048 D64": batch, query / kv heads, sequence, head dim.
std::string attn_shape(int64_t b, int64_t h, int64_t kv, int64_t s, int64_t d) {
  return "B" + std::to_string(b) + " h" + std::to_string(h) + "/" + std::to_string(kv) + " S" +
         std::to_string(s) + " D" + std::to_string(d);
}

using AttnFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;

// One attention function's rows: forward (no grad) and forward + backward (autograd), q/k/v as
// given; a backend that cannot serve the inputs gets a "not available" note.
void attention_rows(const std::string& group, const std::string& name, const std::string& shape,
                    double fwd_flops, const AttnFn& fn, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v) {
  Row r{group, name, shape, "fwd"};
  Row rb{group, name, shape, "fwd+bwd"};
  r.flops = fwd_flops;
  rb.flops = 2.5 * fwd_flops;
  try {
    {
      at::NoGradGuard ng;
      r.fused_ms = median_ms([&] { fn(q, k, v); });
    }
    at::Tensor ql = q.detach().requires_grad_(true), kl = k.detach().requires_grad_(true),
               vl = v.detach().requires_grad_(true);
    at::Tensor dy = at::randn_like(q);
    rb.fused_ms = median_ms([&] {
      at::Tensor o = fn(ql, kl, vl);
      torch::autograd::grad({o}, {ql, kl, vl}, {dy});
    });
  } catch (const std::exception& e) {
    std::string what = e.what();
    r.note = rb.note = "not available: " + what.substr(0, std::min<size_t>(what.find('\n'), 90));
    r.fused_ms = rb.fused_ms = -1;
  }
  sync();
  g_rows.push_back(r);
  g_rows.push_back(rb);
}

void sdpa(const std::string& name, int64_t b, int64_t h, int64_t kv, int64_t s, int64_t d) {
  const double fwd_flops = 4.0 * b * h * double(s) * s * d * 0.5;  // causal
  const std::string shape = attn_shape(b, h, kv, s, d);
  at::Tensor q = at::randn({b, h, s, d}, opts()), k = at::randn({b, kv, s, d}, opts()),
             v = at::randn({b, kv, s, d}, opts());
  if (kv != h) {  // the private backends take equal head counts: expand the KV heads (GQA)
    k = k.repeat_interleave(h / kv, 1);
    v = v.repeat_interleave(h / kv, 1);
  }
  std::vector<std::pair<std::string, AttnFn>> backends = {
      {"flash",
       [](const auto& q_, const auto& k_, const auto& v_) {
         return std::get<0>(at::_scaled_dot_product_flash_attention(q_, k_, v_, 0.0, true));
       }},
      {"cudnn",
       [](const auto& q_, const auto& k_, const auto& v_) {
         return std::get<0>(
             at::_scaled_dot_product_cudnn_attention(q_, k_, v_, std::nullopt, true, 0.0, true));
       }},
      {"efficient",
       [](const auto& q_, const auto& k_, const auto& v_) {
         return std::get<0>(at::_scaled_dot_product_efficient_attention(q_, k_, v_, std::nullopt,
                                                                        true, 0.0, true));
       }},
      {"sdpa(auto)", [](const auto& q_, const auto& k_, const auto& v_) {
         return at::scaled_dot_product_attention(q_, k_, v_, std::nullopt, 0.0, true);
       }}};
  for (auto& [bn, fn] : backends)
    attention_rows("sdpa", name + " " + bn, shape, fwd_flops, fn, q, k, v);
}

// ---- ops measured only with --op ----
// Residual add + RMSNorm; backward from the normed output y (the residual output's gradient
// is left undefined, as at the last layer).
void bench_add_rms_norm(const Preset& p) {
  const int64_t tokens = p.tokens, h = p.h;
  const double e = kBf16;
  at::Tensor x = at::randn({tokens, h}, opts()), r = at::randn({tokens, h}, opts()),
             w = at::rand({h}, opts()) + 0.5;
  fwd_bwd(
      "add_rms_norm", p.tag(), shape_str({tokens, h}), {x, r, w},
      [](const auto& v) { return K::add_rms_norm(v[0], v[1], v[2], 1e-5).second; },
      [](const auto& v) { return K::add_rms_norm_reference(v[0], v[1], v[2], 1e-5).second; },
      {true, true, true}, 4 * tokens * h * e + 4.0 * tokens, 4 * tokens * h * e + 4.0 * tokens);
}

// gate and up packed in one [tokens, 2F] tensor, as linear_concat produces them.
void bench_swiglu_packed(const Preset& p) {
  const int64_t tokens = p.tokens, f = p.f;
  const double e = kBf16;
  at::Tensor gu = at::randn({tokens, 2 * f}, opts());
  fwd_bwd(
      "swiglu_packed", p.tag(), shape_str({tokens, 2 * f}), {gu},
      [](const auto& v) { return K::swiglu_packed(v[0]); },
      [](const auto& v) { return K::swiglu_packed_reference(v[0]); }, {true}, 3 * tokens * f * e,
      5 * tokens * f * e);
}

// The q/k/v projection: one GEMM against the concatenated weights vs three GEMMs and a cat.
// Rates are TFLOPS against the GEMM ceiling.
void bench_linear_concat(const Preset& p) {
  const int64_t tokens = p.tokens, h = p.h, kvd = p.kv * p.d;
  at::Tensor x = at::randn({tokens, h}, opts()) * 0.1;
  at::Tensor wq = at::randn({p.heads * p.d, h}, opts()) * 0.02,
             wk = at::randn({kvd, h}, opts()) * 0.02, wv = at::randn({kvd, h}, opts()) * 0.02;
  const double gemm = 2.0 * double(tokens) * double(h) * double(p.heads * p.d + 2 * kvd);
  const size_t first = g_rows.size();
  fwd_bwd(
      "linear_concat", p.tag() + " qkv", shape_str({tokens, h}), {x, wq, wk, wv},
      [](const auto& v) {
        return K::linear_concat(v[0], {v[1], v[2], v[3]});
      },
      [](const auto& v) {
        return K::linear_concat_reference(v[0], {v[1], v[2], v[3]});
      },
      {true, true, true, true}, 0, 0);
  g_rows[first].flops = gemm;          // forward: one GEMM
  g_rows[first + 1].flops = 2 * gemm;  // backward: dx and dW
}

// The fused CE's per-chunk step: in place on a [rows, V] logits block (restored before each
// rep, untimed). One fp32-statistics read, one read and one write.
void bench_cross_entropy_grad() {
  const int64_t rows = g_cuda ? 8192 : 256, vocab = g_cuda ? 32000 : 1000;
  at::Tensor src = at::randn({rows, vocab}, opts()), logits = at::empty_like(src);
  at::Tensor targets = at::randint(vocab, {rows}, opts(at::kLong));
  Row r{"cross_entropy_grad", "V=" + std::to_string(vocab), shape_str({rows, vocab}), "fwd+bwd"};
  at::NoGradGuard ng;
  auto restore = [&] { logits.copy_(src); };
  r.fused_ms =
      median_ms([&] { K::cross_entropy_grad_(logits, targets, -100, at::Tensor()); }, restore);
  r.aten_ms = median_ms(
      [&] { K::cross_entropy_grad_reference_(logits, targets, -100, at::Tensor()); }, restore);
  r.bytes = 3.0 * double(rows) * double(vocab) * kBf16 + 12.0 * double(rows);
  g_rows.push_back(r);
}

// The gradient norm's pass over a Llama parameter list of bf16 gradients.
void bench_sum_squares() {
  const auto shapes =
      g_cuda ? llama_params(22, 2048, 5632, 32, 4, 32000) : llama_params(2, 256, 688, 4, 2, 1000);
  std::vector<at::Tensor> ts;
  double n = 0;
  for (const auto& s : shapes) {
    ts.push_back(at::randn(s, opts()));
    n += double(ts.back().numel());
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2fe9 elements, %zu tensors", n / 1e9, shapes.size());
  Row r{"sum_squares", g_cuda ? "1b grads" : "tiny grads", buf, "fwd"};
  at::NoGradGuard ng;
  r.fused_ms = median_ms([&] { K::sum_squares(ts); });
  r.aten_ms = median_ms([&] { K::sum_squares_reference(ts); });
  r.bytes = n * kBf16;
  g_rows.push_back(r);
}

// FP8 training's casts (issue 20) at the 7b shapes: our two-pass kernels (amax, then data and
// its transpose) against the ATen composite; bytes: two reads of the input and the fp8 writes.
void bench_fp8_cast() {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> cases =
      g_cuda
          ? std::vector<std::pair<std::string, std::vector<int64_t>>>{{"x 7b", {4096, 4096}},
                                                                      {"x 7b mlp", {4096, 11008}},
                                                                      {"w down", {4096, 11008}}}
          : std::vector<std::pair<std::string, std::vector<int64_t>>>{{"tiny", {256, 512}}};
  at::NoGradGuard ng;
  for (const auto& [name, shape] : cases)
    for (bool transpose : {false, true}) {
      at::Tensor x = at::randn(shape, opts());
      const double n = double(shape[0]) * double(shape[1]);
      Row r{"fp8_cast", name + (transpose ? " +T" : ""), shape_str({shape[0], shape[1]}), "fwd"};
      r.fused_ms = median_ms([&] { K::cast_to_fp8(x, at::kFloat8_e4m3fn, false, transpose); });
      r.aten_ms =
          median_ms([&] { K::cast_to_fp8_reference(x, at::kFloat8_e4m3fn, false, transpose); });
      r.bytes = 2 * n * kBf16 + n * (transpose ? 2 : 1);
      g_rows.push_back(r);
    }
}

// FP8 GEMM rate (at::_scaled_mm, tensorwise) against the bf16 GEMM at the 7b layer shapes, 4096
// tokens: "fused" is FP8, "aten" the same product in bf16; flops 2 M N K. Per shape the three
// GEMMs of an FP8 linear layer as Fp8Linear runs them: y = x W^T (e4m3 x e4m3, fast
// accumulation), dx = dy W (e5m2 x e4m3) and dW = dy^T x (e5m2 x e4m3), both with the periodic
// fp32 promotion (no fast accumulation), and dx with fast accumulation for comparison.
void bench_fp8_gemm() {
  const int64_t m = 4096;
  at::NoGradGuard ng;
  const auto e4 = at::kFloat8_e4m3fn, e5 = at::kFloat8_e5m2;
  for (const auto& [name, n, k] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"q/k/v/o", 4096, 4096}, {"gate/up", 11008, 4096}, {"down", 4096, 11008}}) {
    at::Tensor x = at::randn({m, k}, opts()), w = at::randn({n, k}, opts()) * 0.02,
               dy = at::randn({m, n}, opts()) * 1e-3;
    K::Fp8Tensor qx = K::cast_to_fp8(x, e4, false, true), qw = K::cast_to_fp8(w, e4, false, true),
                 qd = K::cast_to_fp8(dy, e5, false, true);
    // a @ b^T for a [m, k] and b [n, k] row-major (each the cast's data or its transpose, as
    // `at_` / `bt` say) against the same product in bf16, ba @ bb^T.
    auto row = [&](const std::string& dir, const K::Fp8Tensor& a, bool at_, const K::Fp8Tensor& b,
                   bool bt, bool fast, const at::Tensor& ba, const at::Tensor& bb) {
      const at::Tensor& ad = at_ ? a.data_t : a.data;
      const at::Tensor& bd = bt ? b.data_t : b.data;
      Row r{"fp8_gemm", name, shape_str({ad.size(0), bd.size(0), ad.size(1)}), dir};
      r.fused_ms = median_ms([&] {
        at::_scaled_mm(ad, bd.t(), a.inv_scale, b.inv_scale, std::nullopt, std::nullopt,
                       at::kBFloat16, fast);
      });
      r.aten_ms = median_ms([&] { at::mm(ba, bb.t()); });
      r.flops = 2.0 * double(ad.size(0)) * double(bd.size(0)) * double(ad.size(1));
      g_rows.push_back(r);
    };
    at::Tensor wt = w.t().contiguous(), dyt = dy.t().contiguous(), xt = x.t().contiguous();
    row("y fast", qx, false, qw, false, true, x, w);
    row("dx", qd, false, qw, true, false, dy, wt);
    row("dx fast", qd, false, qw, true, true, dy, wt);
    row("dW", qd, true, qx, true, false, dyt, xt);
  }
}

// QLoRA's NF4 dequantisation (double quantisation) of a 7b MLP weight into bf16: our kernel
// against the ATen reference; bytes: the codes and constants read, the bf16 weight written.
void bench_nf4_dequantize() {
  const int64_t rows = g_cuda ? 11008 : 256, cols = g_cuda ? 4096 : 512, n = rows * cols;
  K::NF4View v;
  v.numel = n;
  v.codes = at::randint(0, 256, {(n + 1) / 2}, opts(at::kByte));
  v.absmax = at::randint(0, 256, {n / 64}, opts(at::kByte));
  v.absmax2 = at::rand({(n / 64 + 255) / 256}, opts(at::kFloat));
  v.dmap = at::linspace(-1, 1, 256, opts(at::kFloat));
  v.offset = 0.01f;
  Row r{"nf4_dequant", "7b mlp", shape_str({rows, cols}), "fwd"};
  r.fused_ms = median_ms([&] { K::dequantize_nf4(v, at::kBFloat16); });
  r.aten_ms = median_ms([&] { K::dequantize_nf4_reference(v, at::kBFloat16); });
  r.bytes = double(n) / 2 + double(n) / 64 + double(n) * kBf16;
  g_rows.push_back(r);
}

void print_and_save() {
  std::printf("\n%-11s %-24s %-30s %-7s %10s %10s %7s %9s %7s\n", "kernel", "case", "shape", "dir",
              "fused ms", "aten ms", "speedup", "GB/s|TF", "%ceil");
  for (const Row& r : g_rows) {
    const double rate = r.fused_ms <= 0 ? 0
                        : r.flops > 0   ? r.flops / (r.fused_ms * 1e9)
                                        : r.bytes / (r.fused_ms * 1e6);
    const double ceil = r.flops > 0 ? g_gemm_tflops : g_copy_gbs;
    char fm[32], am[32], sp[32], rt[32], pc[32];
    std::snprintf(fm, sizeof fm, r.fused_ms > 0 ? "%.3f" : "-", r.fused_ms);
    std::snprintf(am, sizeof am, r.aten_ms > 0 ? "%.3f" : "-", r.aten_ms);
    std::snprintf(sp, sizeof sp, r.fused_ms > 0 && r.aten_ms > 0 ? "%.2fx" : "-",
                  r.aten_ms / r.fused_ms);
    std::snprintf(rt, sizeof rt, rate > 0 ? "%.0f" : "-", rate);
    std::snprintf(pc, sizeof pc, rate > 0 && ceil > 0 ? "%.0f%%" : "-", 100 * rate / ceil);
    std::printf("%-11s %-24s %-30s %-7s %10s %10s %7s %9s %7s %s\n", r.group.c_str(),
                r.name.c_str(), r.shape.c_str(), r.dir.c_str(), fm, am, sp, rt, pc, r.note.c_str());
  }
  std::printf(
      "(GB/s: minimal bytes moved by the fused op / its time; %%ceil vs the measured copy "
      "ceiling. sdpa rows: TFLOPS (causal 4*B*h*S^2*D/2 fwd, 2.5x fwd+bwd) vs the GEMM "
      "ceiling; the aten column of sdpa rows is unused.)\n");
  if (g_opts.json.empty()) return;
  std::ofstream out(g_opts.json);
  auto esc = [](const std::string& s) {
    std::string o;
    for (char c : s) {
      if (c == '"' || c == '\\') o += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) o += c;
    }
    return o;
  };
  out << "{\"device\": \"" << (g_cuda ? "cuda" : "cpu") << "\", \"copy_gbs\": " << g_copy_gbs
      << ", \"gemm_bf16_tflops\": " << g_gemm_tflops << ", \"reps\": " << g_opts.reps
      << ", \"rows\": [\n";
  for (size_t i = 0; i < g_rows.size(); ++i) {
    const Row& r = g_rows[i];
    out << "  {\"kernel\": \"" << esc(r.group) << "\", \"case\": \"" << esc(r.name)
        << "\", \"shape\": \"" << esc(r.shape) << "\", \"dir\": \"" << esc(r.dir)
        << "\", \"fused_ms\": " << r.fused_ms << ", \"aten_ms\": " << r.aten_ms
        << ", \"bytes\": " << r.bytes << ", \"flops\": " << r.flops << ", \"note\": \""
        << esc(r.note) << "\"}" << (i + 1 < g_rows.size() ? ",\n" : "\n");
  }
  out << "]}\n";
  std::printf("wrote %s\n", g_opts.json.c_str());
}

// The AdamW and SDPA cases of the default run.
void adamw_cases() {
  if (!g_cuda) {
    adamw("tiny", llama_params(2, 256, 688, 4, 2, 1000));
    return;
  }
  Accelerator::cuda().empty_cache();  // the 7b AdamW case needs ~135 GB
  adamw("1b", llama_params(22, 2048, 5632, 32, 4, 32000));
  Accelerator::cuda().empty_cache();
  adamw("7b", llama_params(32, 4096, 11008, 32, 32, 32000));
  Accelerator::cuda().empty_cache();
}

#ifdef COLOSSAL_WITH_CUDNN_FRONTEND
// cuDNN's SDPA graphs through its frontend (bench/cudnn_sdpa.cpp), in this table's rows: the
// issue-25 comparison point next to the `sdpa` op's LibTorch backends.
void sdpa_frontend_cases() {
  for (const auto& f : colossal::bench::cudnn_frontend_sdpa(
           [](const std::function<void()>& body) { return median_ms(body); })) {
    Row r{"sdpa_fe", f.name, f.shape, f.dir};
    r.fused_ms = f.ms;
    r.flops = f.flops;
    r.note = f.note;
    g_rows.push_back(r);
  }
}
#endif

// ---- Our attention (issue 25) next to LibTorch's cuDNN and flash SDPA on the same inputs ----
// Forward TFLOPS (causal FLOPs counted as half); dense = b equal sequences through the
// variable-length interface; docs = packed documents (bench/documents.h), FLOPs of the
// documents' own causal squares.
void attention_case(const std::string& name, int64_t b, int64_t h, int64_t kv, int64_t s,
                    int64_t d) {
  const std::string why =
      K::own_attention_unsupported(at::empty({1, 1, d}, opts()), at::empty({1, 1, d}, opts()));
  const int64_t T = b * s;
  at::Tensor q = at::randn({T, h, d}, opts()), k = at::randn({T, kv, d}, opts()),
             v = at::randn({T, kv, d}, opts());
  // The timed bodies: one forward, and one forward+backward, of our kernels on these tokens.
  at::Tensor o = at::empty_like(q), dy = at::randn_like(q);
  at::Tensor ql = q.detach().requires_grad_(true), kl = k.detach().requires_grad_(true),
             vl = v.detach().requires_grad_(true);
  auto fwd_ms = [&](const at::Tensor& cu_t) {
    return median_ms([&] { K::attention_forward(q, k, v, cu_t, s, true, 0, o); });
  };
  auto fwd_bwd_ms = [&](const at::Tensor& cu_t, bool det) {
    return median_ms([&] {
      at::Tensor y = K::attention(ql, kl, vl, cu_t, s, true, 0, det);
      torch::autograd::grad({y}, {ql, kl, vl}, {dy});
    });
  };
  auto run_own = [&](const std::string& tag, const std::vector<int64_t>& lens) {
    std::vector<int64_t> cu{0};
    double flops = 0;
    for (int64_t l : lens) {
      cu.push_back(cu.back() + l);
      flops += 4.0 * h * double(l) * l * d * 0.5;
    }
    const std::string shape = attn_shape(b, h, kv, s, d) +
                              (tag != "dense" ? " " + std::to_string(lens.size()) + " docs" : "");
    // Every schedule (kernels::AttentionSchedule): the forward's rows once per forward schedule,
    // fwd+bwd once per schedule, the deterministic backward once (it ignores dq_tma).
    const K::AttentionSchedule saved =
        why.empty() ? K::attention_schedule() : K::AttentionSchedule{};
    for (const K::AttentionSchedule& sched : K::attention_schedules()) {
      const std::string label = name + " own " + tag + " " + K::to_string(sched);
      Row r{"attention", label, shape, "fwd"};
      Row rb{"attention", label, shape, "fwd+bwd"};
      Row rd{"attention", name + " own " + tag + " determ.", shape, "fwd+bwd"};
      r.flops = flops;
      rb.flops = rd.flops = 2.5 * flops;
      const bool with_fwd = !sched.dq_tma;
      const bool with_det = sched == K::AttentionSchedule{};
      if (!why.empty()) {
        r.note = rb.note = rd.note = "not available: " + why.substr(0, 90);
        r.fused_ms = rb.fused_ms = rd.fused_ms = -1;
      } else {
        K::set_attention_schedule(sched);
        // Offsets on the host, as the model passes them (DocumentMask::cu_seqlens_cpu): the work
        // list is built and uploaded once and every call after reuses it. Offsets on the device
        // cost each call a copy back and a synchronisation, so the host's preparation stands
        // between two launches; the "device offsets" rows below measure that path.
        const at::Tensor cu_t = at::tensor(cu, at::kLong);
        if (with_fwd) r.fused_ms = fwd_ms(cu_t);
        rb.fused_ms = fwd_bwd_ms(cu_t, false);
        if (with_det) rd.fused_ms = fwd_bwd_ms(cu_t, true);
        K::set_attention_schedule(saved);
      }
      sync();
      if (with_fwd) g_rows.push_back(r);
      g_rows.push_back(rb);
      if (with_det) g_rows.push_back(rd);
      if (!why.empty()) break;  // one set of "not available" rows
    }
    if (why.empty() && tag == "dense") {
      // The default schedule with the offsets on the device: what a caller without a host copy
      // pays (the copy back, the synchronisation, the host's work between launches).
      const std::string label =
          name + " own " + tag + " device-offsets " + K::to_string(K::attention_schedule());
      Row r{"attention", label, shape, "fwd"};
      Row rb{"attention", label, shape, "fwd+bwd"};
      r.flops = flops;
      rb.flops = 2.5 * flops;
      const at::Tensor cu_t = at::tensor(cu, at::kLong).to(at::kCUDA);
      r.fused_ms = fwd_ms(cu_t);
      rb.fused_ms = fwd_bwd_ms(cu_t, false);
      sync();
      g_rows.push_back(r);
      g_rows.push_back(rb);
    }
  };
  run_own("dense", std::vector<int64_t>(static_cast<size_t>(b), s));
  run_own("docs", colossal::bench::packed_documents(b, s, 7));
  if (!g_opts.doc_index.empty()) {
    // A real corpus's document lengths, in file order, packed into the rows as packing cuts them.
    const std::vector<uint64_t> off = colossal::data::read_doc_index(g_opts.doc_index);
    std::vector<int64_t> lens;
    for (size_t i = 0; i + 1 < off.size(); ++i)
      if (off[i + 1] > off[i]) lens.push_back(static_cast<int64_t>(off[i + 1] - off[i]));
    run_own("docs(index)", colossal::bench::pack_lengths(lens, b, s));
  }
  // LibTorch's best backends on the same tokens as [b, h, s, d] (kv heads expanded for them).
  at::Tensor qb = q.view({b, s, h, d}).transpose(1, 2), kb = k.view({b, s, kv, d}).transpose(1, 2),
             vb = v.view({b, s, kv, d}).transpose(1, 2);
  if (kv != h) {
    kb = kb.repeat_interleave(h / kv, 1);
    vb = vb.repeat_interleave(h / kv, 1);
  }
  qb = qb.contiguous();
  kb = kb.contiguous();
  vb = vb.contiguous();
  const double fwd_flops = 4.0 * b * h * double(s) * s * d * 0.5;
  const std::string shape = attn_shape(b, h, kv, s, d);
  attention_rows(
      "attention", name + " sdpa cudnn", shape, fwd_flops,
      [](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_) {
        return std::get<0>(
            at::_scaled_dot_product_cudnn_attention(q_, k_, v_, std::nullopt, true, 0.0, true));
      },
      qb, kb, vb);
  attention_rows(
      "attention", name + " sdpa flash", shape, fwd_flops,
      [](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_) {
        return std::get<0>(at::_scaled_dot_product_flash_attention(q_, k_, v_, 0.0, true));
      },
      qb, kb, vb);
  if (!why.empty()) return;
  // Our default schedule and cuDNN timed in alternation on the same tokens ("alt." rows): the
  // comparison the goals are read from, with both sides at the same clocks.
  const at::Tensor cu_t = [&] {
    std::vector<int64_t> cu{0};
    for (int64_t i = 0; i < b; ++i) cu.push_back(cu.back() + s);
    return at::tensor(cu, at::kLong);
  }();
  auto cudnn = [](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_) {
    return std::get<0>(
        at::_scaled_dot_product_cudnn_attention(q_, k_, v_, std::nullopt, true, 0.0, true));
  };
  at::Tensor qbl = qb.detach().requires_grad_(true), kbl = kb.detach().requires_grad_(true),
             vbl = vb.detach().requires_grad_(true);
  const at::Tensor dyb = dy.view({b, s, h, d}).transpose(1, 2).contiguous();
  const std::string own = name + " own dense " + K::to_string(K::attention_schedule()) + " alt.";
  const std::string other = name + " sdpa cudnn alt.";
  Row of{"attention", own, shape, "fwd"}, cf{"attention", other, shape, "fwd"};
  Row ob{"attention", own, shape, "fwd+bwd"}, cb{"attention", other, shape, "fwd+bwd"};
  of.flops = cf.flops = fwd_flops;
  ob.flops = cb.flops = 2.5 * fwd_flops;
  try {
    {
      at::NoGradGuard ng;
      std::tie(of.fused_ms, cf.fused_ms) = median_ms_alternating(
          [&] { K::attention_forward(q, k, v, cu_t, s, true, 0, o); }, [&] { cudnn(qb, kb, vb); });
    }
    std::tie(ob.fused_ms, cb.fused_ms) = median_ms_alternating(
        [&] {
          at::Tensor y = K::attention(ql, kl, vl, cu_t, s, true, 0, false);
          torch::autograd::grad({y}, {ql, kl, vl}, {dy});
        },
        [&] {
          at::Tensor y = cudnn(qbl, kbl, vbl);
          torch::autograd::grad({y}, {qbl, kbl, vbl}, {dyb});
        });
  } catch (const std::exception& e) {  // cuDNN cannot serve these shapes here: say so
    const std::string what = e.what();
    for (Row* r : {&of, &cf, &ob, &cb}) {
      r->note = "not available: " + what.substr(0, std::min<size_t>(what.find('\n'), 90));
      r->fused_ms = -1;
    }
  }
  sync();
  for (Row* r : {&of, &cf, &ob, &cb}) g_rows.push_back(*r);
}

// --attn_case's names, each with its row label and shape (batch, heads, kv heads, seq, head dim).
struct AttentionCase {
  const char *name, *label;
  int64_t b, h, kv, s, d;
};
const AttentionCase kAttentionCases[] = {{"W1", "W1", 8, 32, 4, 2048, 64},
                                         {"W2", "W2", 1, 32, 32, 4096, 128},
                                         {"W2-B4", "W2", 4, 32, 32, 4096, 128}};

void attention_cases() {
  for (const AttentionCase& c : kAttentionCases)
    if (g_opts.attn_case.empty() || g_opts.attn_case == c.name)
      attention_case(c.label, c.b, c.h, c.kv, c.s, c.d);
}

void sdpa_cases() {
  sdpa("W1", 8, 32, 4, 2048, 64);
  for (int64_t b : {1, 2, 4}) sdpa("W2", b, 32, 32, 4096, 128);
}

// ---- ring attention's blocks (ring_attn on one rank, without the hops) ----
// Rank 3 of an 8-rank zigzag ring: its own chunks (c tokens each) against its diagonal block
// (causal) and the seven blocks that reach it (each 2c x c), merged by log-sum-exp, then each
// block's backward with the merged rows: what one ring_attn layer computes per rank between
// point-to-point hops. Rows "flash vs fp32": ATen's flash kernels in the fused column, the fp32
// composite (what ring_attn ran before) in the ATen column; "own vs flash" (on an H100 / H200):
// ours against flash. FLOPs: the causal pairs (16 c^2 per head) x 4 D forward, x 10 D
// forward+backward.
void ring_block_case(const std::string& name, int64_t h, int64_t kv, int64_t c, int64_t d) {
  constexpr int64_t kRanks = 8, kRank = 3;
  at::Tensor q = at::randn({1, h, 2 * c, d}, opts()), k = at::randn({1, kv, 2 * c, d}, opts()),
             v = at::randn({1, kv, 2 * c, d}, opts()), dout = at::randn({1, h, 2 * c, d}, opts());
  const double scale = 1.0 / std::sqrt(double(d));
  struct Block {
    int64_t q0, qn, k0, kn;
    bool causal;
  };
  std::vector<Block> blocks = {{0, 2 * c, 0, 2 * c, true}};
  for (int64_t src = 0; src < kRanks; ++src) {
    if (src < kRank) blocks.push_back({0, 2 * c, 0, c, false});
    if (src > kRank) blocks.push_back({c, c, 0, 2 * c, false});
  }
  // One rank's blocks; the backward too when `backward`. As ring_attn stores them: the inputs,
  // the running result and the accumulators tokens-major ([1, S, heads, D] memory).
  auto tokens_major = [](const at::Tensor& x) {
    return x.transpose(1, 2).contiguous().transpose(1, 2);
  };
  q = tokens_major(q);
  k = tokens_major(k);
  v = tokens_major(v);
  dout = tokens_major(dout);
  auto run = [&](nn::RingBlockKernel kernel, bool backward) {
    const at::Tensor qin = kernel == nn::RingBlockKernel::composite ? q.to(at::kFloat) : q;
    at::Tensor out = at::zeros({1, 2 * c, h, d}, q.options().dtype(at::kFloat)).transpose(1, 2);
    at::Tensor lse =
        at::full({1, h, 2 * c}, -std::numeric_limits<float>::infinity(), out.options());
    for (const Block& b : blocks)
      nn::ring_block_forward(kernel, qin.narrow(2, b.q0, b.qn), k.narrow(2, b.k0, b.kn),
                             v.narrow(2, b.k0, b.kn), b.causal, scale, out.narrow(2, b.q0, b.qn),
                             lse.narrow(2, b.q0, b.qn));
    if (!backward) return;
    // As the ring passes them: fp32 to the composite, else the returned output in q's dtype.
    const at::Tensor merged =
        kernel == nn::RingBlockKernel::composite ? out : out.to(q.scalar_type());
    at::Tensor dq = at::zeros_like(out), dk = at::zeros_like(k, out.options()),
               dv = at::zeros_like(k, out.options());
    for (const Block& b : blocks)
      nn::ring_block_backward(
          kernel, dout.narrow(2, b.q0, b.qn), qin.narrow(2, b.q0, b.qn), k.narrow(2, b.k0, b.kn),
          v.narrow(2, b.k0, b.kn), merged.narrow(2, b.q0, b.qn), lse.narrow(2, b.q0, b.qn),
          b.causal, scale,
          {dq.narrow(2, b.q0, b.qn), dk.narrow(2, b.k0, b.kn), dv.narrow(2, b.k0, b.kn)});
  };
  const std::string shape = shape_str({1, h, kv, 2 * c, d});
  const double pairs = 16.0 * double(c) * double(c) * double(h);
  const bool own = kernels::own_attention_unsupported(q[0], k[0]).empty();
  for (bool backward : {false, true}) {
    // The kernels timed in rotation (the same clocks for each).
    std::vector<std::function<void()>> bodies = {
        [&] { run(nn::RingBlockKernel::flash, backward); },
        [&] { run(nn::RingBlockKernel::composite, backward); }};
    if (own) bodies.push_back([&] { run(nn::RingBlockKernel::own, backward); });
    const std::vector<double> ms = cuda_medians_ms(bodies);
    const char* dir = backward ? "fwd+bwd" : "fwd";
    Row r{"ring_blocks", name + " flash vs fp32", shape, dir};
    r.fused_ms = ms[0];
    r.aten_ms = ms[1];
    r.flops = pairs * double(d) * (backward ? 10.0 : 4.0);
    g_rows.push_back(r);
    if (own) {
      Row o{"ring_blocks", name + " own vs flash", shape, dir};
      o.fused_ms = ms[2];
      o.aten_ms = ms[0];
      o.flops = r.flops;
      g_rows.push_back(o);
    }
  }
  // Our kernels alone on the same blocks, their inputs prepared outside the timed region as our
  // kernels' rows (each block one sequence, its keys with offsets of their own, as
  // ring_block_forward passes them), no merge, no accumulation: the per-rank time the blocks
  // could reach. "own alone vs own blocks": the kernels alone in the fused column, the ring's
  // blocks in the ATen column; the difference is what the ring adds around the kernels.
  if (own) {
    auto rows = [](const at::Tensor& x) {  // [1, heads, n, D] -> [n, heads, D] contiguous
      return x[0].transpose(0, 1).contiguous();
    };
    // One offsets tensor per length, as the ring passes them (the kernels keep their work
    // lists' upload while the same host tensors come again).
    std::map<std::pair<int64_t, int64_t>, at::Tensor> offsets;
    auto offsets_of = [&](int64_t count, int64_t n) {
      at::Tensor& t = offsets[{count, n}];
      if (!t.defined()) t = at::arange(0, count + 1, at::kInt).mul_(static_cast<int32_t>(n));
      return t;
    };
    // The backward's inputs as ring_block_backward passes them: a tall block's queries cut into
    // parts against copies of its keys where its CTAs would leave SMs idle
    // (kernels::attention_backward_query_parts).
    struct Prepared {
      at::Tensor q, k, v, dout, cu_q, cu_k, out, lse, kb, vb, cu_qb, cu_kb;
      int64_t qn, kn, pq;
      bool causal;
    };
    const int64_t sms = kernels::attention_multiprocessors(q.device());
    std::vector<Prepared> prep;
    for (const Block& b : blocks) {
      Prepared p;
      p.q = rows(q.narrow(2, b.q0, b.qn));
      p.k = rows(k.narrow(2, b.k0, b.kn));
      p.v = rows(v.narrow(2, b.k0, b.kn));
      p.dout = rows(dout.narrow(2, b.q0, b.qn));
      p.qn = b.qn;
      p.kn = b.kn;
      p.cu_q = offsets_of(1, b.qn);
      p.cu_k = offsets_of(1, b.kn);
      p.causal = b.causal;
      const int64_t parts =
          b.causal ? 1 : kernels::attention_backward_query_parts(1, b.qn, b.kn, kv, sms);
      p.pq = b.qn / parts;
      p.kb = parts > 1 ? p.k.repeat({parts, 1, 1}) : p.k;
      p.vb = parts > 1 ? p.v.repeat({parts, 1, 1}) : p.v;
      p.cu_qb = offsets_of(parts, p.pq);
      p.cu_kb = offsets_of(parts, b.kn);
      const kernels::AttentionResult r =
          kernels::attention_forward(p.q, p.k, p.v, p.cu_q, p.cu_k, p.qn, p.kn, p.causal, scale);
      p.out = r.out;
      p.lse = r.lse;
      prep.push_back(p);
    }
    for (bool backward : {false, true}) {
      const std::vector<double> ms = cuda_medians_ms(
          {[&] {
             for (const Prepared& p : prep) {
               kernels::attention_forward(p.q, p.k, p.v, p.cu_q, p.cu_k, p.qn, p.kn, p.causal,
                                          scale);
               if (backward)
                 kernels::attention_backward(p.q, p.kb, p.vb, p.out, p.dout, p.lse, p.cu_qb,
                                             p.cu_kb, p.pq, p.kn, p.causal, scale);
             }
           },
           [&] { run(nn::RingBlockKernel::own, backward); }});
      Row r{"ring_blocks", name + " own alone vs own blocks", shape, backward ? "fwd+bwd" : "fwd"};
      r.fused_ms = ms[0];
      r.aten_ms = ms[1];
      r.flops = pairs * double(d) * (backward ? 10.0 : 4.0);
      g_rows.push_back(r);
    }
  }
  // The merge alone: a bf16 result of 2c rows into the fp32 running result, our one-pass
  // kernel against the ATen composite (what every block ran before). Bytes: out read and
  // written, the part read, in fp32 / bf16.
  {
    at::Tensor out = tokens_major(at::randn(q.sizes(), q.options().dtype(at::kFloat)));
    at::Tensor lse = at::randn({1, h, 2 * c}, out.options());
    const at::Tensor part = q, part_lse = at::randn({1, h, 2 * c}, out.options());
    const std::vector<double> ms =
        cuda_medians_ms({[&] { kernels::attention_merge(out, lse, part, part_lse); },
                         [&] { kernels::attention_merge_reference(out, lse, part, part_lse); }});
    Row r{"ring_blocks", name + " merge", shape, "fwd"};
    r.fused_ms = ms[0];
    r.aten_ms = ms[1];
    r.bytes = double(q.numel()) * (4.0 + 4.0 + 2.0);
    g_rows.push_back(r);
  }
  sync();
}

void ring_block_cases() {
  ring_block_case("1b", 32, 4, 2048, 64);    // 32k tokens over 8 ranks
  ring_block_case("7b", 32, 32, 2048, 128);  // 32k tokens over 8 ranks
  // The same with tensor parallelism over 8 besides (4 of 7b's 32 heads a rank): grids an
  // eighth as large, where a block's forward and backward can leave SMs idle.
  ring_block_case("7b tp8", 4, 4, 2048, 128);
}

// ---- the ops `--op` selects (named as the kernel column of the table) ----
struct Op {
  const char* name;
  const char* what;
  bool cuda_only;
  void (*run)();
};

template <void (*F)(const Preset&)>
void each_preset() {
  for (const Preset& p : row_presets()) F(p);
}

const std::vector<Op>& ops() {
  static const std::vector<Op> table = {
      {"host_copy", "pinned and pageable host<->device copies, both directions", true, host_copies},
      {"rms_norm", "RMSNorm forward and backward at the preset shapes", false,
       each_preset<bench_rms_norm>},
      {"add_rms_norm", "residual add + RMSNorm forward and backward", false,
       each_preset<bench_add_rms_norm>},
      {"rotary", "rotary embedding of q forward and backward", false, each_preset<bench_rotary>},
      {"swiglu", "SwiGLU on separate gate/up forward and backward", false,
       each_preset<bench_swiglu>},
      {"swiglu_packed", "SwiGLU on packed gate|up forward and backward", false,
       each_preset<bench_swiglu_packed>},
      {"linear_concat", "q/k/v as one concatenated GEMM vs three GEMMs and a cat", false,
       each_preset<bench_linear_concat>},
      {"cross_entropy_grad", "in-place softmax cross-entropy gradient of a logits block", false,
       bench_cross_entropy_grad},
      {"sum_squares", "sum of squares over a Llama gradient list (the norm's pass)", false,
       bench_sum_squares},
      {"fused_adamw", "multi-tensor AdamW over a Llama parameter list", false, adamw_cases},
      {"fp8_cast", "FP8 e4m3 cast with current scaling (and transpose) at 7b shapes", false,
       bench_fp8_cast},
      {"fp8_gemm", "FP8 _scaled_mm vs bf16 GEMM at the 7b layer shapes", true, bench_fp8_gemm},
      {"nf4_dequant", "NF4 (double-quantised) dequantisation of a 7b MLP weight to bf16", false,
       bench_nf4_dequantize},
      {"sdpa", "SDPA backends (flash, cuDNN, memory-efficient) at the W1/W2 shapes", true,
       sdpa_cases},
      {"attention", "our sm_90a attention (dense, packed documents) vs SDPA cuDNN / flash", true,
       attention_cases},
      {"ring_blocks", "ring_attn's blocks on one rank (8-rank ring, 32k tokens): own, flash, fp32",
       true, ring_block_cases},
#ifdef COLOSSAL_WITH_CUDNN_FRONTEND
      {"sdpa_fe", "cuDNN frontend SDPA graphs (dense, packed documents, deterministic)", true,
       sdpa_frontend_cases},
#endif
  };
  return table;
}

std::string op_names() {
  std::string out;
  for (const Op& o : ops()) out += (out.empty() ? "" : ", ") + std::string(o.name);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--reps")
      g_opts.reps = std::max(1, std::atoi(next().c_str()));
    else if (a == "--warmup")
      g_opts.warmup = std::max(0, std::atoi(next().c_str()));
    else if (a == "--json")
      g_opts.json = next();
    else if (a == "--cpu")
      g_opts.cpu = true;
    else if (a == "--copies")
      g_opts.copies_only = true;
    else if (a == "--rows")
      g_opts.rows_only = true;
    else if (a == "--op")
      g_opts.op = next();
    else if (a == "--doc_index")
      g_opts.doc_index = next();
    else if (a == "--timing_log")
      g_opts.timing_log = next();
    else if (a == "--attn_case") {
      g_opts.attn_case = next();
      bool known = false;
      std::string valid;
      for (const AttentionCase& c : kAttentionCases) {
        known = known || g_opts.attn_case == c.name;
        valid += (valid.empty() ? "" : ", ") + std::string(c.name);
      }
      if (!known) {
        std::fprintf(stderr, "bench_kernels: unknown --attn_case '%s'; valid: %s\n",
                     g_opts.attn_case.c_str(), valid.c_str());
        return 2;
      }
    } else if (a == "--list") {
      for (const Op& o : ops())
        std::printf("%-19s %s%s\n", o.name, o.what, o.cuda_only ? " (CUDA only)" : "");
      return 0;
    } else {
      std::fprintf(
          stderr,
          "usage: bench_kernels [--reps N] [--warmup N] [--json FILE] [--cpu] [--copies | "
          "--rows | --op NAME] [--doc_index FILE] [--attn_case W1|W2|W2-B4] [--timing_log FILE] | "
          "--list\n");
      return 2;
    }
  }
  const Op* op = nullptr;
  if (!g_opts.op.empty()) {
    for (const Op& o : ops())
      if (g_opts.op == o.name) op = &o;
    if (!op) {
      std::fprintf(stderr, "bench_kernels: unknown op '%s'; valid ops: %s\n", g_opts.op.c_str(),
                   op_names().c_str());
      return 2;
    }
    if (g_opts.copies_only || g_opts.rows_only) {
      std::fprintf(stderr, "bench_kernels: --op selects the cases; drop --copies / --rows\n");
      return 2;
    }
  }
  g_cuda = !g_opts.cpu && Accelerator::cuda().available();
  if (op && op->cuda_only && !g_cuda) {
    std::fprintf(stderr, "bench_kernels: op '%s' runs on CUDA only (this run is on the CPU)\n",
                 op->name);
    return 2;
  }
  if (g_cuda) {
    Accelerator::cuda().set_device(0);
    auto devs = cuda_devices();
    std::printf("bench_kernels on %s, %d reps (median), %d warm-up\n",
                devs.empty() ? "cuda" : devs[0].name.c_str(), g_opts.reps, g_opts.warmup);
  } else {
    std::printf("bench_kernels on CPU (small sizes), %d reps (median), %d warm-up\n", g_opts.reps,
                g_opts.warmup);
  }
  at::manual_seed(0);
  ceilings();
  if (op) {
    op->run();
    print_and_save();
    return 0;
  }
  if (!g_opts.rows_only) host_copies();
  if (g_opts.copies_only) return 0;  // the printed lines are the result
  for (const Preset& p : row_presets()) row_ops(p);
  if (g_opts.rows_only && g_cuda) {
    print_and_save();
    return 0;
  }
  adamw_cases();
  if (g_cuda) sdpa_cases();
  print_and_save();
  return 0;
}
