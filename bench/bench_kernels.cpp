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
//   bench_kernels [--reps N] [--warmup N] [--json FILE] [--cpu]
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/fused.h"

using namespace colossal;
namespace K = colossal::kernels;

namespace {

struct Opts {
  int reps = 20, warmup = 5;
  std::string json;
  bool cpu = false;
  bool copies_only = false;  // --copies: ceilings and host<->device copies only
  bool rows_only = false;    // --rows: ceilings and the row ops (RMSNorm, rotary, SwiGLU) only
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

// Median milliseconds of `body` over reps, after warm-up; `setup` runs untimed before each rep.
double median_ms(const std::function<void()>& body, const std::function<void()>& setup = nullptr) {
  for (int i = 0; i < g_opts.warmup; ++i) {
    if (setup) setup();
    body();
  }
  std::vector<double> t;
  if (g_cuda) {
    Accelerator& acc = Accelerator::cuda();
    std::vector<std::unique_ptr<Event>> a, b;
    for (int i = 0; i < g_opts.reps; ++i) {
      if (setup) setup();
      a.push_back(acc.new_event(true));
      b.push_back(acc.new_event(true));
      a.back()->record();
      body();
      b.back()->record();
    }
    acc.synchronize();
    for (int i = 0; i < g_opts.reps; ++i) t.push_back(a[i]->elapsed_ms(*b[i]));
  } else {
    for (int i = 0; i < g_opts.reps; ++i) {
      if (setup) setup();
      auto s = std::chrono::steady_clock::now();
      body();
      t.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
    }
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
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

void row_ops(const std::string& preset, int64_t tokens, int64_t h, int64_t f, int64_t heads,
             int64_t d) {
  const double e = 2;  // bf16
  const std::string tag = preset + " T=" + std::to_string(tokens);
  {
    at::Tensor x = at::randn({tokens, h}, opts()), w = at::rand({h}, opts()) + 0.5;
    fwd_bwd(
        "rms_norm", tag, shape_str({tokens, h}), {x, w},
        [](const auto& v) { return K::rms_norm(v[0], v[1], 1e-5); },
        [](const auto& v) { return K::rms_norm_reference(v[0], v[1], 1e-5); }, {true, true},
        2 * tokens * h * e + 4.0 * tokens, 3 * tokens * h * e + 4.0 * tokens);
  }
  {
    // q as the projection produces it: [B, S, heads, D] viewed [B, heads, S, D]; B*S = tokens
    const int64_t s = std::min<int64_t>(tokens, preset == "1b" ? 2048 : 4096), b = tokens / s;
    at::Tensor q = at::randn({b, s, heads, d}, opts()).transpose(1, 2);
    at::Tensor ang = at::rand({b, s, d}, opts(at::kFloat)) * 6.28;
    at::Tensor c = ang.cos().to(at::kBFloat16), sn = ang.sin().to(at::kBFloat16);
    const double bytes = 2 * tokens * heads * d * e + 2 * b * s * d * e;
    fwd_bwd(
        "rotary", tag, shape_str({b, heads, s, d}), {q, c, sn},
        [](const auto& v) { return K::apply_rotary(v[0], v[1], v[2]); },
        [](const auto& v) { return K::apply_rotary_reference(v[0], v[1], v[2]); },
        {true, false, false}, bytes, bytes);
  }
  {
    at::Tensor g = at::randn({tokens, f}, opts()), u = at::randn({tokens, f}, opts());
    fwd_bwd(
        "swiglu", tag, shape_str({tokens, f}), {g, u},
        [](const auto& v) { return K::swiglu(v[0], v[1]); },
        [](const auto& v) { return K::swiglu_reference(v[0], v[1]); }, {true, true},
        3 * tokens * f * e, 5 * tokens * f * e);
  }
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
void sdpa(const std::string& name, int64_t b, int64_t h, int64_t kv, int64_t s, int64_t d) {
  const double fwd_flops = 4.0 * b * h * double(s) * s * d * 0.5;  // causal
  const std::string shape = "B" + std::to_string(b) + " h" + std::to_string(h) + "/" +
                            std::to_string(kv) + " S" + std::to_string(s) + " D" +
                            std::to_string(d);
  at::Tensor q = at::randn({b, h, s, d}, opts()), k = at::randn({b, kv, s, d}, opts()),
             v = at::randn({b, kv, s, d}, opts());
  if (kv != h) {  // the private backends take equal head counts: expand the KV heads (GQA)
    k = k.repeat_interleave(h / kv, 1);
    v = v.repeat_interleave(h / kv, 1);
  }
  using Fn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;
  std::vector<std::pair<std::string, Fn>> backends = {
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
  for (auto& [bn, fn] : backends) {
    Row r{"sdpa", name + " " + bn, shape, "fwd"};
    Row rb{"sdpa", name + " " + bn, shape, "fwd+bwd"};
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
    else {
      std::fprintf(stderr,
                   "usage: bench_kernels [--reps N] [--warmup N] [--json FILE] [--cpu] [--copies] "
                   "[--rows]\n");
      return 2;
    }
  }
  g_cuda = !g_opts.cpu && Accelerator::cuda().available();
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
  if (!g_opts.rows_only) host_copies();
  if (g_opts.copies_only) return 0;  // the printed lines are the result
  if (g_cuda) {
    row_ops("1b", 16384, 2048, 5632, 32, 64);
    row_ops("7b", 4096, 4096, 11008, 32, 128);
    row_ops("7b", 16384, 4096, 11008, 32, 128);
    if (g_opts.rows_only) {
      print_and_save();
      return 0;
    }
    Accelerator::cuda().empty_cache();  // the 7b AdamW case needs ~135 GB
    adamw("1b", llama_params(22, 2048, 5632, 32, 4, 32000));
    Accelerator::cuda().empty_cache();
    adamw("7b", llama_params(32, 4096, 11008, 32, 32, 32000));
    Accelerator::cuda().empty_cache();
    sdpa("W1", 8, 32, 4, 2048, 64);
    for (int64_t b : {1, 2, 4}) sdpa("W2", b, 32, 32, 4096, 128);
  } else {
    row_ops("tiny", 512, 256, 688, 4, 64);
    adamw("tiny", llama_params(2, 256, 688, 4, 2, 1000));
  }
  print_and_save();
  return 0;
}
