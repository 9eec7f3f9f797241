// Issue 25, the first step: what cuDNN's own SDPA graphs give through the cuDNN frontend C++ API
// (header-only `nvidia-cudnn-frontend`, scripts/fetch_cudnn_frontend.sh) at our shapes, in the
// same table as LibTorch's SDPA backends (bench_kernels --op sdpa_fe). Graphs: forward with the
// log-sum-exp statistics (what training keeps), backward from them; bf16 in and out, fp32
// softmax and accumulation; causal; GQA by the K/V head count (no copies). Variable length:
// documents packed into rows (cut at row ends, as `colossal prepare` packs them), run as ragged
// sequences (THD layout: cumulative offsets per document, causal inside each, nothing across),
// against the dense causal rows of the same token count. Deterministic backward: timed too.
#include "cudnn_sdpa.h"
#include "documents.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <cudnn_frontend.h>

#include <dlfcn.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

// The frontend calls cuDNN through this handle (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): the
// cuDNN that LibTorch loaded, found by its soname at run time, so bench_kernels starts wherever
// LibTorch does and this op alone reports when no cuDNN is there.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace colossal::bench {

namespace {

namespace fe = cudnn_frontend;

void load_cudnn() {
  if (fe::cudnn_dlhandle) return;
  fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
  if (!fe::cudnn_dlhandle) fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW);
  if (!fe::cudnn_dlhandle)
    throw std::runtime_error(std::string("cannot load libcudnn.so.9: ") + dlerror());
}

void check(fe::error_t e, const char* what) {
  if (!e.is_good()) throw std::runtime_error(std::string(what) + ": " + e.get_message());
}

enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqQ,
  kSeqKv,
  kRagQ,
  kRagKv,
  kRagStats,
};

struct Handle {
  cudnnHandle_t h = nullptr;
  Handle() {
    load_cudnn();
    if (fe::detail::create_handle(&h) != CUDNN_STATUS_SUCCESS)
      throw std::runtime_error("cudnnCreate failed");
    fe::detail::set_stream(h, at::cuda::getCurrentCUDAStream());
  }
  ~Handle() { fe::detail::destroy_handle(h); }
};

// A problem: dense [b, h, s, d] (kv heads for K/V), or ragged: `docs` lengths packed in b rows
// of s tokens (then q/k/v are [tokens, heads, d] and each document is one sequence).
struct Problem {
  int64_t b, h, kv, s, d;
  std::vector<int64_t> docs;  // empty: dense
  bool ragged() const { return !docs.empty(); }
  int64_t batch() const { return ragged() ? int64_t(docs.size()) : b; }
  int64_t seq() const { return s; }  // the longest sequence (ragged: at most a row)
  double fwd_flops() const {         // causal: half of 4 h S^2 D per sequence
    if (!ragged()) return 4.0 * double(b) * h * double(s) * s * d * 0.5;
    double f = 0;
    for (int64_t l : docs) f += 4.0 * h * double(l) * l * d * 0.5;
    return f;
  }
};

// Dims and strides of a [batch, heads, seq, d] tensor: dense BHSD contiguous, or ragged BSHD
// over the packed tokens (the offsets say where each sequence starts).
std::pair<std::vector<int64_t>, std::vector<int64_t>> layout(const Problem& p, int64_t heads) {
  const int64_t n = p.batch(), s = p.seq(), d = p.d;
  if (!p.ragged()) return {{n, heads, s, d}, {heads * s * d, s * d, d, 1}};
  return {{n, heads, s, d}, {s * heads * d, d, heads * d, 1}};
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const Problem& p,
                                                     const char* name, int64_t uid, int64_t heads,
                                                     int64_t ragged_uid) {
  auto [dim, stride] = layout(p, heads);
  auto t = g.tensor(
      fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
  if (p.ragged()) {
    t->set_ragged_offset(g.tensor(fe::graph::Tensor_attributes()
                                      .set_name((std::string(name) + "_offsets").c_str())
                                      .set_uid(ragged_uid + uid * 100)
                                      .set_dim({p.batch() + 1, 1, 1, 1})
                                      .set_stride({1, 1, 1, 1})
                                      .set_data_type(fe::DataType_t::INT32)));
  }
  return t;
}

void output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, const Problem& p, int64_t uid,
            int64_t heads) {
  auto [dim, stride] = layout(p, heads);
  t->set_output(true).set_uid(uid).set_dim(dim).set_stride(stride);
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Tensor_attributes> seq_lens(fe::graph::Graph& g, const Problem& p,
                                                       const char* name, int64_t uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({p.batch(), 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

// Ragged problems: each sequence masked to its own length (forward and backward attributes).
template <typename Attributes>
void pad_to_documents(Attributes& a, fe::graph::Graph& g, const Problem& p) {
  if (!p.ragged()) return;
  a.set_padding_mask(true)
      .set_seq_len_q(seq_lens(g, p, "seq_q", kSeqQ))
      .set_seq_len_kv(seq_lens(g, p, "seq_kv", kSeqKv));
}

void build(fe::graph::Graph& g, cudnnHandle_t h) {
  check(g.validate(), "validate");
  check(g.build_operation_graph(h), "build_operation_graph");
  check(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check(g.check_support(h), "check_support");
  check(g.build_plans(h), "build_plans");
}

struct Graphs {
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
};

Graphs make_graphs(const Problem& p, cudnnHandle_t h, bool deterministic) {
  const float scale = 1.0f / std::sqrt(float(p.d));
  Graphs out;
  {
    auto g = new_graph();
    auto q = tensor(*g, p, "Q", kQ, p.h, kRagQ), k = tensor(*g, p, "K", kK, p.kv, kRagKv),
         v = tensor(*g, p, "V", kV, p.kv, kRagKv);
    auto a = fe::graph::SDPA_attributes()
                 .set_name("sdpa")
                 .set_generate_stats(true)
                 .set_attn_scale(scale)
                 .set_causal_mask(true);
    pad_to_documents(a, *g, p);
    auto [o, stats] = g->sdpa(q, k, v, a);
    output(o, p, kO, p.h);
    if (p.ragged()) o->set_ragged_offset(q->get_ragged_offset());
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
    build(*g, h);
    out.fwd = g;
  }
  {
    auto g = new_graph();
    auto q = tensor(*g, p, "Q", kQ, p.h, kRagQ), k = tensor(*g, p, "K", kK, p.kv, kRagKv),
         v = tensor(*g, p, "V", kV, p.kv, kRagKv), o = tensor(*g, p, "O", kO, p.h, kRagQ),
         dout = tensor(*g, p, "dO", kDO, p.h, kRagQ);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim({p.batch(), p.h, p.seq(), 1})
                               .set_stride({p.h * p.seq(), p.seq(), 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("sdpa_backward")
                 .set_attn_scale(scale)
                 .set_causal_mask(true)
                 .set_deterministic_algorithm(deterministic);
    pad_to_documents(a, *g, p);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, a);
    output(dq, p, kDQ, p.h);
    output(dk, p, kDK, p.kv);
    output(dv, p, kDV, p.kv);
    if (p.ragged()) {
      dq->set_ragged_offset(q->get_ragged_offset());
      dk->set_ragged_offset(k->get_ragged_offset());
      dv->set_ragged_offset(v->get_ragged_offset());
    }
    build(*g, h);
    out.bwd = g;
  }
  return out;
}

}  // namespace

std::vector<FeRow> cudnn_frontend_sdpa(const Timer& time_ms) {
  std::vector<FeRow> rows;
  Handle handle;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(at::kCUDA);
  struct Case {
    std::string name;
    Problem p;
  };
  std::vector<Case> cases{{"W1", {8, 32, 4, 2048, 64, {}}},
                          {"W1 docs", {8, 32, 4, 2048, 64, packed_documents(8, 2048, 7)}},
                          {"W2", {1, 32, 32, 4096, 128, {}}},
                          {"W2 docs", {1, 32, 32, 4096, 128, packed_documents(1, 4096, 7)}}};
  for (const auto& [name, p] : cases) {
    const int64_t tokens = p.b * p.s;
    std::string shape = "B" + std::to_string(p.b) + " h" + std::to_string(p.h) + "/" +
                        std::to_string(p.kv) + " S" + std::to_string(p.s) + " D" +
                        std::to_string(p.d);
    if (p.ragged()) shape += " " + std::to_string(p.docs.size()) + " docs";
    // Inputs: dense [b, heads, s, d]; ragged [tokens, heads, d] (BSHD over the packed tokens).
    auto make = [&](int64_t heads) {
      return p.ragged() ? at::randn({tokens, heads, p.d}, bf16)
                        : at::randn({p.b, heads, p.s, p.d}, bf16);
    };
    at::Tensor q = make(p.h), k = make(p.kv), v = make(p.kv), o = at::empty_like(q),
               dout = at::randn_like(q), dq = at::empty_like(q), dk = at::empty_like(k),
               dv = at::empty_like(v);
    at::Tensor stats = at::empty({p.batch(), p.h, p.seq(), 1}, bf16.dtype(at::kFloat));
    at::Tensor seq, off_q, off_kv;
    if (p.ragged()) {
      std::vector<int32_t> lens(p.docs.begin(), p.docs.end()), oq{0}, okv{0};
      for (int32_t l : lens) {
        oq.push_back(oq.back() + l * int32_t(p.h * p.d));
        okv.push_back(okv.back() + l * int32_t(p.kv * p.d));
      }
      auto dev = [&](const std::vector<int32_t>& x) {
        return at::tensor(at::IntArrayRef(std::vector<int64_t>(x.begin(), x.end())))
            .to(i32)
            .reshape({-1, 1, 1, 1});
      };
      seq = dev(lens);
      off_q = dev(oq);
      off_kv = dev(okv);
    }
    for (bool det : {false, true}) {
      FeRow f{name, shape, "fwd", -1, p.fwd_flops(), ""};
      FeRow fb{name + (det ? " determ." : ""), shape, "fwd+bwd", -1, 2.5 * p.fwd_flops(), ""};
      try {
        Graphs gs = make_graphs(p, handle.h, det);
        const int64_t ws = std::max(gs.fwd->get_workspace_size(), gs.bwd->get_workspace_size());
        at::Tensor work = at::empty({std::max<int64_t>(ws, 1)}, bf16.dtype(at::kByte));
        std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*> pack{
            {kQ, q.data_ptr()},   {kK, k.data_ptr()},         {kV, v.data_ptr()},
            {kO, o.data_ptr()},   {kStats, stats.data_ptr()}, {kDO, dout.data_ptr()},
            {kDQ, dq.data_ptr()}, {kDK, dk.data_ptr()},       {kDV, dv.data_ptr()}};
        if (p.ragged()) {
          pack[kSeqQ] = seq.data_ptr();
          pack[kSeqKv] = seq.data_ptr();
          for (int64_t uid : {kQ, kO, kDO}) pack[kRagQ + uid * 100] = off_q.data_ptr();
          for (int64_t uid : {kK, kV}) pack[kRagKv + uid * 100] = off_kv.data_ptr();
        }
        auto run_fwd = [&] { check(gs.fwd->execute(handle.h, pack, work.data_ptr()), "forward"); };
        auto run_bwd = [&] { check(gs.bwd->execute(handle.h, pack, work.data_ptr()), "backward"); };
        if (!det) {
          f.ms = time_ms(run_fwd);
          rows.push_back(f);
        }
        fb.ms = time_ms([&] {
          run_fwd();
          run_bwd();
        });
      } catch (const std::exception& e) {
        std::string what = e.what();
        fb.note = "not available: " + what.substr(0, std::min<size_t>(what.size(), 120));
        if (!det) {
          f.note = fb.note;
          rows.push_back(f);
        }
      }
      rows.push_back(fb);
    }
  }
  return rows;
}

}  // namespace colossal::bench
