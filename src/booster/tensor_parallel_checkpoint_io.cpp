// TensorParallelCheckpointIO (see tensor_parallel_checkpoint_io.h): streamed gathers of sharded
// tensors to global rank 0 on save, per-rank slices of memory-mapped files on load.
#include "colossal/booster/tensor_parallel_checkpoint_io.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <unordered_map>

#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/core/logging.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/module.h"
#include "colossal/optim/lr_scheduler.h"
#include "colossal/optim/optimizer.h"

namespace colossal::booster {
namespace {

namespace fs = std::filesystem;
using SaveStats = TensorParallelCheckpointIO::SaveStats;

int global_rank() {
  return dist::is_initialized() ? dist::rank() : 0;
}

void barrier() {
  if (dist::is_initialized() && dist::world_size() > 1) dist::world_cpu().barrier();
}

void write_text_atomic(const std::string& path, const std::string& text) {
  checkpoint::write_file_atomic(
      path, [&](int fd) { checkpoint::write_all(fd, text.data(), text.size(), path); });
}

std::string join_names(const std::vector<std::string>& names, size_t limit = 20) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += str(" and ", names.size() - limit, " more");
  return out;
}

// Counts the buffers a save makes beyond the training state: assembled full tensors and shard
// receive/send buffers, from creation to release.
struct Meter {
  SaveStats stats;
  int64_t full = 0;
  uint64_t bytes = 0;
  void add(uint64_t b, bool is_full) {
    bytes += b;
    stats.peak_bytes = std::max(stats.peak_bytes, bytes);
    if (is_full) {
      ++full;
      ++stats.gathered;
      stats.peak_full_tensors = std::max(stats.peak_full_tensors, full);
      stats.largest_full_bytes = std::max(stats.largest_full_bytes, b);
    } else {
      stats.largest_buffer_bytes = std::max(stats.largest_buffer_bytes, b);
    }
  }
  void sub(uint64_t b, bool is_full) {
    bytes -= b;
    if (is_full) --full;
  }
};

// A metered shard buffer, released at scope exit.
struct Held {
  std::shared_ptr<Meter> meter;
  uint64_t b = 0;
  Held(std::shared_ptr<Meter> m, uint64_t bytes) : meter(std::move(m)), b(bytes) {
    meter->add(b, false);
  }
  ~Held() { meter->sub(b, false); }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
};

uint64_t nbytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

// An uninitialised CPU tensor whose lifetime (with every view of it) the meter follows.
at::Tensor metered_full(at::IntArrayRef shape, at::ScalarType dtype,
                        const std::shared_ptr<Meter>& meter) {
  at::Tensor buf = at::empty(shape, at::TensorOptions().dtype(dtype));
  const uint64_t b = nbytes(buf);
  meter->add(b, true);
  return at::from_blob(
      buf.data_ptr(), shape,
      [buf, meter, b](void*) mutable {
        buf = at::Tensor();
        meter->sub(b, true);
      },
      at::TensorOptions().dtype(dtype));
}

// For each position along `sp.dim` of this rank's shard, the index into the full tensor it
// holds (-1: a padding position), read off the layer's own shard_slice of an index tensor, so
// any slicing a layer implements (contiguous blocks, padding) is followed.
at::Tensor slice_indices(const ShardedParameter& sp, at::IntArrayRef local_shape,
                         const std::string& name) {
  const int64_t n = sp.full_shape[sp.dim];
  std::vector<int64_t> view(sp.full_shape.size(), 1);
  view[sp.dim] = n;
  at::Tensor full = at::arange(1, n + 1, at::kLong).view(view).expand(sp.full_shape);
  at::Tensor s = sp.module->shard_slice(sp.key, full);
  COLOSSAL_CHECK(s.sizes() == local_shape, "checkpoint: ", name, ": shard_slice gives shape ",
                 s.sizes(), " but the shard has ", local_shape);
  for (int64_t k = s.dim() - 1; k >= 0; --k)
    if (k != sp.dim) s = s.select(k, 0);
  return (s - 1).contiguous();
}

// Moves a sharded tensor's slices to the writer (`dst`, a rank of sp.group) one rank at a
// time. Senders call send_shard, the writer gather_full.
constexpr int kTagSize = 71, kTagIndex = 72, kTagData = 73;

at::Device comm_device(const dist::Communicator& g, const at::Tensor& t) {
  return g.backend() == dist::Backend::Nccl ? t.device() : at::Device(at::kCPU);
}

void send_shard(const ShardedParameter& sp, const at::Tensor& local, const at::Tensor& indices,
                int dst, const std::shared_ptr<Meter>& meter) {
  dist::Communicator g = sp.group;
  const at::Device dev = comm_device(g, local);
  at::Tensor size = at::full({1}, local.size(sp.dim), at::kLong).to(dev);
  g.send(size, dst, kTagSize);
  g.send(indices.to(dev), dst, kTagIndex);
  at::Tensor data = local.detach().to(dev).contiguous();
  std::optional<Held> held;
  if (data.data_ptr() != local.data_ptr()) held.emplace(meter, nbytes(data));
  g.send(data, dst, kTagData);
}

// Places `data` (a shard, slices along `dim` listed by `idx`) into `full`.
void place(at::Tensor& full, int64_t dim, const at::Tensor& idx, const at::Tensor& data,
           std::vector<char>& covered, const std::string& name) {
  auto acc = idx.accessor<int64_t, 1>();
  std::vector<int64_t> src, dst;
  bool contiguous = true;
  for (int64_t i = 0; i < idx.size(0); ++i) {
    const int64_t v = acc[i];
    if (v < 0) continue;
    COLOSSAL_CHECK(v < static_cast<int64_t>(covered.size()), "checkpoint: ", name, ": slice index ",
                   v, " is outside the full size ", covered.size());
    COLOSSAL_CHECK(!covered[v], "checkpoint: ", name, ": index ", v, " along dim ", dim,
                   " is held by two ranks");
    covered[v] = 1;
    if (!dst.empty() && (v != dst.back() + 1 || i != src.back() + 1)) contiguous = false;
    src.push_back(i);
    dst.push_back(v);
  }
  if (dst.empty()) return;
  const int64_t len = static_cast<int64_t>(dst.size());
  if (contiguous) {
    full.narrow(dim, dst[0], len).copy_(data.narrow(dim, src[0], len));
  } else {
    at::Tensor s = at::tensor(src, at::kLong).to(data.device());
    full.index_copy_(dim, at::tensor(dst, at::kLong), data.index_select(dim, s).to(at::kCPU));
  }
}

at::Tensor gather_full(const ShardedParameter& sp, const at::Tensor& local,
                       const at::Tensor& indices, const std::vector<int64_t>& full_shape,
                       const std::shared_ptr<Meter>& meter, const std::string& name) {
  dist::Communicator g = sp.group;
  const int64_t d = sp.dim;
  const at::Device dev = comm_device(g, local);
  at::Tensor full = metered_full(full_shape, local.scalar_type(), meter);
  std::vector<char> covered(static_cast<size_t>(full_shape[d]), 0);
  place(full, d, indices, local.detach(), covered, name);
  int64_t outer = 1;
  for (int64_t k = 0; k < d; ++k) outer *= full_shape[k];
  for (int r = 0; r < g.size(); ++r) {
    if (r == g.rank()) continue;
    at::Tensor size = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(dev));
    g.recv(size, r, kTagSize);
    const int64_t n = size.to(at::kCPU).item<int64_t>();
    COLOSSAL_CHECK(n >= 0 && n <= full_shape[d] * g.size(), "checkpoint: ", name, ": rank ", r,
                   " announces a shard of ", n, " along dim ", d);
    at::Tensor idx = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(dev));
    g.recv(idx, r, kTagIndex);
    idx = idx.to(at::kCPU);
    std::vector<int64_t> shard_shape = full_shape;
    shard_shape[d] = n;
    // The shard is a contiguous block of `full` when the leading dims are 1 and its indices
    // are one unpadded run: receive it in place, no buffer.
    bool in_place = dev.is_cpu() && outer == 1 && n > 0;
    int64_t first = 0;
    if (in_place) {
      auto acc = idx.accessor<int64_t, 1>();
      first = acc[0];
      for (int64_t i = 0; i < n && in_place; ++i) {
        in_place = acc[i] == first + i && acc[i] >= 0 && acc[i] < full_shape[d] &&
                   !covered[static_cast<size_t>(acc[i])];
      }
    }
    if (in_place) {
      at::Tensor view = full.narrow(d, first, n);
      g.recv(view, r, kTagData);
      for (int64_t i = 0; i < n; ++i) covered[static_cast<size_t>(first + i)] = 1;
      continue;
    }
    at::Tensor buf =
        at::empty(shard_shape, at::TensorOptions().dtype(local.scalar_type()).device(dev));
    Held held(meter, nbytes(buf));
    g.recv(buf, r, kTagData);
    place(full, d, idx, buf, covered, name);
  }
  const auto missing = std::count(covered.begin(), covered.end(), 0);
  COLOSSAL_CHECK(missing == 0, "checkpoint: ", name, ": ", missing, " of ", covered.size(),
                 " indices along dim ", d, " are held by no rank of group ", g.name());
  return full;
}

// A CPU tensor ready to write; a copy (from a device, or of a non-contiguous view) is metered.
at::Tensor cpu_for_write(const at::Tensor& t, const std::shared_ptr<Meter>& meter) {
  if (t.device().is_cpu() && t.is_contiguous()) return t.detach();
  at::Tensor out = metered_full(t.sizes(), t.scalar_type(), meter);
  out.copy_(t.detach());
  return out;
}

// The tensors to write, every rank's view of them: name, the local tensor, its slicing.
struct Item {
  std::string name;
  at::Tensor local;                      // undefined: made on demand by a Fetch
  const ShardedParameter* sp = nullptr;  // null: replicated
  checkpoint::TensorDecl decl;           // full shape
  std::vector<int64_t> shape;            // this rank's shape (with a Fetch)
};

// Item i's local tensor, made when it is written (an optimizer state gathered over ZeRO's
// data-parallel group, one at a time); empty: the items hold their tensors.
using Fetch = std::function<at::Tensor(size_t)>;

// Every participant must declare the same tensors, or the streamed gathers would pair up the
// wrong slices: a hash of the declarations is compared over the group.
void check_same_declarations(const dist::Communicator& tp, const std::vector<Item>& items,
                             const char* what) {
  if (tp.size() <= 1) return;
  std::string text;
  for (const auto& it : items) {
    text += it.decl.name + ":" + c10::toString(it.decl.dtype);
    for (int64_t d : it.decl.shape) text += str(",", d);
    text += ";";
  }
  const int64_t h = static_cast<int64_t>(std::hash<std::string>{}(text) >> 1);
  at::Tensor mine = at::full({1}, h, at::kLong);
  at::Tensor all = at::empty({tp.size()}, at::kLong);
  dist::Communicator g = tp;
  if (g.backend() == dist::Backend::Nccl) {
    // NCCL moves device tensors only; the hashes are tiny.
    at::Tensor dm = mine.cuda(), da = all.cuda();
    g.all_gather(da, dm);
    all = da.cpu();
  } else {
    g.all_gather(all, mine);
  }
  auto acc = all.accessor<int64_t, 1>();
  for (int r = 0; r < tp.size(); ++r) {
    COLOSSAL_CHECK(acc[r] == h, "checkpoint: the ", what, " of tensor-parallel rank ", r,
                   " declares other tensors than rank ", tp.rank(),
                   " (different state names or shapes across the group)");
  }
}

// Streams `items` to files: the writer assembles and writes, the other participants send their
// slices in the same order. `write_files(produce)` runs on the writer only. With `fetch`, each
// item's local tensor is made just before its gather and dropped after it.
void stream_items(const std::vector<Item>& items, bool writer, int dst,
                  const std::vector<size_t>& order,
                  const std::function<void(const std::function<at::Tensor(size_t)>&)>& write_files,
                  const std::shared_ptr<Meter>& meter, const Fetch& fetch = {}) {
  std::unordered_map<const ShardedParameter*, at::Tensor> index_cache;
  auto indices_of = [&](const Item& it, const at::Tensor& local) {
    auto found = index_cache.find(it.sp);
    if (found != index_cache.end() && found->second.size(0) == local.size(it.sp->dim))
      return found->second;
    at::Tensor idx = slice_indices(*it.sp, local.sizes(), it.name);
    index_cache[it.sp] = idx;
    return idx;
  };
  auto local_of = [&](size_t i) {
    if (!fetch) return items[i].local;
    at::Tensor t = fetch(i);
    COLOSSAL_CHECK(t.defined() && t.sizes() == at::IntArrayRef(items[i].shape),
                   "checkpoint: ", items[i].name, ": the optimizer gave ",
                   t.defined() ? str(t.sizes()) : std::string("no tensor"),
                   " to the writing rank, expected its shard ", at::IntArrayRef(items[i].shape));
    return t;
  };
  if (writer) {
    write_files([&](size_t i) -> at::Tensor {
      const Item& it = items[i];
      at::Tensor local = local_of(i);
      if (!it.sp) return cpu_for_write(local, meter);
      return gather_full(*it.sp, local, indices_of(it, local), it.decl.shape, meter, it.name);
    });
  } else {
    for (size_t i : order) {
      const Item& it = items[i];
      at::Tensor local = local_of(i);
      if (it.sp) send_shard(*it.sp, local, indices_of(it, local), dst, meter);
    }
  }
}

// The group rank of global rank 0 in `g` (-1: not a member).
int rank_of_global_zero(const dist::Communicator& g) {
  const auto& r = g.ranks();
  auto it = std::find(r.begin(), r.end(), 0);
  return it == r.end() ? -1 : static_cast<int>(it - r.begin());
}

std::map<std::string, at::Tensor> by_name(const checkpoint::TensorList& list) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [n, t] : list) out.emplace(n, t);
  return out;
}

// The parameter a state tensor "<param name>.<key>" belongs to.
std::string param_of_state(const std::string& state_name) {
  const size_t dot = state_name.rfind('.');
  return dot == std::string::npos ? std::string() : state_name.substr(0, dot);
}

// ---- Pipeline stages ----

constexpr int kTagStage = 74;

bool is_nccl(const dist::Communicator& g) {
  return g.backend() == dist::Backend::Nccl;
}

// Every member's string, in group order (lengths first, then the padded bytes).
std::vector<std::string> all_gather_strings(const dist::Communicator& group,
                                            const std::string& mine) {
  dist::Communicator g = group;
  const int n = g.size();
  if (n <= 1) return {mine};
  auto dev = [&](const at::Tensor& t) { return is_nccl(g) ? t.cuda() : t; };
  at::Tensor len = dev(at::full({1}, static_cast<int64_t>(mine.size()), at::kLong));
  at::Tensor lens = dev(at::empty({n}, at::kLong));
  g.all_gather(lens, len);
  lens = lens.cpu();
  const int64_t width = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor buf = at::zeros({width}, at::kByte);
  if (!mine.empty()) std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  buf = dev(buf);
  at::Tensor all = dev(at::empty({n * width}, at::kByte));
  g.all_gather(all, buf);
  all = all.cpu();
  std::vector<std::string> out;
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < n; ++r)
    out.emplace_back(base + r * width, static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

std::string encode_decls(const std::vector<Item>& items) {
  json::Value a = json::Value::array();
  for (const auto& it : items) {
    json::Value e = json::Value::array();
    e.push_back(it.decl.name);
    e.push_back(checkpoint::dtype_to_safetensors(it.decl.dtype));
    json::Value shape = json::Value::array();
    for (int64_t d : it.decl.shape) shape.push_back(d);
    e.push_back(std::move(shape));
    a.push_back(std::move(e));
  }
  return a.dump();
}

std::vector<checkpoint::TensorDecl> decode_decls(const std::string& text) {
  std::vector<checkpoint::TensorDecl> out;
  const json::Value parsed = json::parse(text, "stage declarations");
  for (const auto& e : parsed.as_array()) {
    const auto& f = e.as_array();
    std::vector<int64_t> shape;
    for (const auto& d : f.at(2).as_array()) shape.push_back(d.as_int());
    out.push_back({f.at(0).as_string(), checkpoint::dtype_from_safetensors(f.at(1).as_string()),
                   std::move(shape)});
  }
  return out;
}

// What the stages hold: every stage's declarations (gathered over pp, the same on every rank),
// and which of them each stage writes: the names no lower stage holds.
struct Stages {
  std::vector<std::vector<checkpoint::TensorDecl>> decls;
  std::vector<std::vector<size_t>> owned;  // indices into decls[s]
};

Stages gather_stages(const dist::Communicator& pp, const std::vector<Item>& items,
                     const char* what) {
  Stages st;
  for (const auto& text : all_gather_strings(pp, encode_decls(items)))
    st.decls.push_back(decode_decls(text));
  std::map<std::string, std::pair<size_t, const checkpoint::TensorDecl*>> first;
  st.owned.resize(st.decls.size());
  for (size_t s = 0; s < st.decls.size(); ++s) {
    for (size_t i = 0; i < st.decls[s].size(); ++i) {
      const auto& d = st.decls[s][i];
      auto [it, fresh] = first.emplace(d.name, std::make_pair(s, &d));
      if (fresh) {
        st.owned[s].push_back(i);
        continue;
      }
      const auto& o = *it->second.second;
      COLOSSAL_CHECK(o.dtype == d.dtype && o.shape == d.shape, "checkpoint: the ", what, " ",
                     d.name, " is held by stages ", it->second.first, " and ", s,
                     " with different dtypes or shapes (", c10::toString(o.dtype), " ",
                     at::IntArrayRef(o.shape), " vs ", c10::toString(d.dtype), " ",
                     at::IntArrayRef(d.shape), ")");
    }
  }
  return st;
}

std::string shard_file_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

// model.safetensors, model.safetensors.index.json, model-NNNNN-of-NNNNN.safetensors, config.json:
// the files a model save writes (an earlier save's are not carried into a new one).
bool is_model_file(const std::string& name) {
  if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
      name == "config.json")
    return true;
  const std::string pattern = "model-00000-of-00000.safetensors";
  if (name.size() != pattern.size()) return false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = name[i];
    if (pattern[i] == '0' ? !(c >= '0' && c <= '9') : c != pattern[i]) return false;
  }
  return true;
}

// StagedDirectory's folder for `target` (every rank computes it; only rank 0 makes it).
std::string staging_path(std::string target) {
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  return target + ".staging";
}

// The full-shape state of a stage writer sent to global rank 0 over pp, and received there.
void send_full(const dist::Communicator& pp, const at::Tensor& t, const at::Device& dev) {
  dist::Communicator g = pp;
  g.send(is_nccl(g) ? t.to(dev) : t.contiguous(), 0, kTagStage);
}

at::Tensor recv_full(const dist::Communicator& pp, int src, const checkpoint::TensorDecl& d,
                     const at::Device& dev, const std::shared_ptr<Meter>& meter) {
  dist::Communicator g = pp;
  at::Tensor full = metered_full(d.shape, d.dtype, meter);
  if (!is_nccl(g)) {
    g.recv(full, src, kTagStage);
    return full;
  }
  at::Tensor buf = at::empty(d.shape, at::TensorOptions().dtype(d.dtype).device(dev));
  Held held(meter, nbytes(buf));
  g.recv(buf, src, kTagStage);
  full.copy_(buf);
  return full;
}

// The device pp collectives use: a CUDA device under NCCL (the stage's own), else the CPU.
at::Device stage_device(const dist::Communicator& pp, torch::nn::Module& stage) {
  if (!is_nccl(pp)) return at::Device(at::kCPU);
  for (const auto& p : stage.parameters(/*recurse=*/true))
    if (p.is_cuda()) return p.device();
  return at::Device(at::kCUDA);
}

// The stages' optimizer scalars as one model's: each group's params and the steps, in stage
// order, a name held by several stages once; the rest (type, hyper-parameters) from stage 0.
json::Value merge_scalars(const std::vector<std::string>& stages) {
  std::vector<json::Value> sc;
  for (const auto& t : stages) sc.push_back(json::parse(t, "optimizer scalars"));
  json::Value out = sc.at(0);
  const json::Value* g0 = out.find("param_groups");
  if (g0 && g0->is_array()) {
    const size_t ng = g0->as_array().size();
    json::Value groups = json::Value::array();
    for (size_t gi = 0; gi < ng; ++gi) {
      json::Value g = g0->as_array()[gi];
      json::Value params = json::Value::array();
      std::set<std::string> seen;
      for (size_t s = 0; s < sc.size(); ++s) {
        const auto& gs = sc[s].at("param_groups").as_array("optimizer scalars param_groups");
        COLOSSAL_CHECK(gs.size() == ng, "save_optimizer: stage ", s, " has ", gs.size(),
                       " param groups but stage 0 has ", ng);
        for (const auto& n : gs[gi].at("params").as_array())
          if (seen.insert(n.as_string()).second) params.push_back(n);
      }
      g.set("params", std::move(params));
      groups.push_back(std::move(g));
    }
    out.set("param_groups", std::move(groups));
  }
  if (out.find("steps")) {
    json::Value steps = json::Value::object();
    std::set<std::string> seen;
    for (const auto& s : sc)
      if (const json::Value* st = s.find("steps"))
        for (const auto& [n, v] : st->as_object())
          if (seen.insert(n).second) steps.set(n, v);
    out.set("steps", std::move(steps));
  }
  return out;
}

// A saved state's scalars cut down to the parameters of this stage (`local`): each group's
// params in their saved order and their steps.
json::Value stage_scalars(const json::Value& scalars, const std::set<std::string>& local) {
  json::Value out = scalars;
  if (const json::Value* gs = scalars.find("param_groups"); gs && gs->is_array()) {
    json::Value groups = json::Value::array();
    for (const auto& g : gs->as_array()) {
      json::Value ng = g;
      if (const json::Value* ps = g.find("params"); ps && ps->is_array()) {
        json::Value params = json::Value::array();
        for (const auto& n : ps->as_array())
          if (n.is_string() && local.count(n.as_string())) params.push_back(n);
        ng.set("params", std::move(params));
      }
      groups.push_back(std::move(ng));
    }
    out.set("param_groups", std::move(groups));
  }
  if (const json::Value* st = scalars.find("steps"); st && st->is_object()) {
    json::Value steps = json::Value::object();
    for (const auto& [n, v] : st->as_object())
      if (local.count(n)) steps.set(n, v);
    out.set("steps", std::move(steps));
  }
  return out;
}

// save_model with pipeline stages (see the header): every stage writer streams its stage's own
// tensors into its files in the staging folder; rank 0 adds the index and config and commits.
SaveStats save_model_stages(const dist::Communicator& tp, const dist::Communicator& dp,
                            const dist::Communicator& pp, const std::vector<Item>& items,
                            const models::CausalLM* lm, const std::string& dir, bool shard,
                            int64_t size_per_shard_mb) {
  checkpoint::SaveOptions so;
  so.shard = shard;
  so.size_per_shard_mb = size_per_shard_mb;
  const Stages st = gather_stages(pp, items, "tensor");
  // Every stage's files, numbered over the whole model in stage order (every rank plans all).
  const size_t nstages = st.decls.size();
  std::vector<checkpoint::StatePlan> plans(nstages);
  std::vector<size_t> first_file(nstages, 0);
  size_t nfiles = 0;
  for (size_t s = 0; s < nstages; ++s) {
    std::vector<checkpoint::TensorDecl> owned;
    for (size_t i : st.owned[s]) owned.push_back(st.decls[s][i]);
    first_file[s] = nfiles;
    if (owned.empty()) continue;
    plans[s] = checkpoint::plan_state_dict(owned, so);
    nfiles += plans[s].files.size();
  }
  COLOSSAL_CHECK(nfiles > 0, "save_model: no pipeline stage holds a tensor");
  auto file_of = [&](size_t s, size_t k) { return shard_file_name(first_file[s] + k + 1, nfiles); };

  const size_t stage = static_cast<size_t>(pp.rank());
  const bool rank0 = global_rank() == 0;
  std::unique_ptr<checkpoint::StagedDirectory> staged;
  if (rank0) {
    const fs::path parent = fs::path(staging_path(dir)).parent_path();
    if (!parent.empty()) fs::create_directories(parent);
    staged = std::make_unique<checkpoint::StagedDirectory>(dir);
  }
  barrier();  // the staging folder exists
  const fs::path staging = staging_path(dir);
  auto meter = std::make_shared<Meter>();
  const bool participant = !dp.valid() || dp.rank() == 0;
  if (participant && !plans[stage].files.empty()) {
    std::vector<Item> mine;
    for (size_t i : st.owned[stage]) mine.push_back(items[i]);
    check_same_declarations(tp, mine, "model");
    const checkpoint::StatePlan& plan = plans[stage];
    std::vector<size_t> order;
    for (const auto& f : plan.order) order.insert(order.end(), f.begin(), f.end());
    stream_items(
        mine, tp.rank() == 0, 0, order,
        [&](const std::function<at::Tensor(size_t)>& produce) {
          const checkpoint::Metadata md{{"format", "pt"}};  // transformers refuses files without
          for (size_t k = 0; k < plan.files.size(); ++k) {
            std::vector<size_t> members = plan.order[k];
            std::sort(members.begin(), members.end());
            std::vector<checkpoint::TensorDecl> decls;
            for (size_t i : members) decls.push_back(mine[i].decl);
            checkpoint::SafetensorsStreamWriter w((staging / file_of(stage, k)).string(),
                                                  std::move(decls), md);
            for (size_t pos = 0; !w.done(); ++pos) {
              const size_t i = members[w.next_index()];
              COLOSSAL_CHECK(i == plan.order[k][pos],
                             "save_model: write order differs from the plan");
              w.write_next(produce(i));
            }
            w.finish();
          }
        },
        meter);
  }
  barrier();  // every stage's files are in the staging folder
  if (rank0) {
    std::map<std::string, std::string> sorted;  // HF writes the index with sorted keys
    uint64_t total_size = 0, total_params = 0;
    const checkpoint::TensorDecl* first = nullptr;
    for (size_t s = 0; s < nstages; ++s) {
      for (size_t k = 0; k < plans[s].files.size(); ++k) {
        for (size_t i : plans[s].order[k]) {
          const checkpoint::TensorDecl& d = st.decls[s][st.owned[s][i]];
          COLOSSAL_CHECK(sorted.emplace(d.name, file_of(s, k)).second, "save_model: ", d.name,
                         " planned twice");
          total_size += d.nbytes();
          total_params += d.nbytes() / c10::elementSize(d.dtype);
        }
      }
      if (!first && !st.decls[s].empty()) first = &st.decls[s].front();
    }
    json::Value weight_map = json::Value::object();
    for (const auto& [n, f] : sorted) weight_map.set(n, f);
    json::Value meta = json::Value::object();
    meta.set("total_parameters", total_params);
    meta.set("total_size", total_size);
    json::Value index = json::Value::object();
    index.set("metadata", std::move(meta));
    index.set("weight_map", std::move(weight_map));
    write_text_atomic((staging / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    if (lm) {
      models::ModelConfig cfg = lm->config();
      cfg.dtype = checkpoint::hf_dtype_name(first->dtype);
      write_text_atomic((staging / "config.json").string(), cfg.to_json().dump(2) + "\n");
    }
    // Files of an existing folder that this save does not replace (optimizer states saved
    // there) stay: hard links into the new folder (copies where links fail).
    std::error_code ec;
    if (fs::is_directory(dir, ec)) {
      for (const auto& e : fs::directory_iterator(dir)) {
        const std::string name = e.path().filename().string();
        if (is_model_file(name) || fs::exists(staging / name)) continue;
        const auto rec = fs::copy_options::recursive;
        fs::copy(e.path(), staging / name, rec | fs::copy_options::create_hard_links, ec);
        if (ec) {
          ec.clear();
          fs::copy(e.path(), staging / name, rec, ec);
        }
        COLOSSAL_CHECK(!ec, "save_model: cannot carry ", e.path().string(),
                       " into the new checkpoint folder: ", ec.message());
      }
    }
    staged->commit();
  }
  barrier();  // the folder is in place
  return meter->stats;
}

// save_optimizer with pipeline stages: one file, written by global rank 0 in file order; each
// of its tensors comes from its own stage's tp gather (stage 0) or from the stage writer over pp.
SaveStats save_optimizer_stages(const dist::Communicator& tp, const dist::Communicator& dp,
                                const dist::Communicator& pp, const std::vector<Item>& items,
                                const json::Value& scalars, const json::Value& wrapper,
                                const std::string& dir, const Fetch& fetch, const at::Device& dev) {
  const Stages st = gather_stages(pp, items, "optimizer state");
  const std::vector<std::string> stage_scalars_text = all_gather_strings(pp, scalars.dump());
  // The file's tensors: each stage's own, in stage order.
  std::vector<checkpoint::TensorDecl> decls;
  std::vector<std::pair<size_t, size_t>> owner;  // stage, index into the stage's own list
  for (size_t s = 0; s < st.decls.size(); ++s) {
    for (size_t j = 0; j < st.owned[s].size(); ++j) {
      decls.push_back(st.decls[s][st.owned[s][j]]);
      owner.emplace_back(s, j);
    }
  }
  const std::vector<size_t> file_order = checkpoint::safetensors_file_order(decls);
  const size_t stage = static_cast<size_t>(pp.rank());
  std::vector<Item> mine;
  for (size_t i : st.owned[stage]) mine.push_back(items[i]);
  std::vector<size_t> order;  // this stage's own tensors (indices into mine) in file order
  for (size_t g : file_order)
    if (owner[g].first == stage) order.push_back(owner[g].second);

  auto meter = std::make_shared<Meter>();
  const bool participant = !dp.valid() || dp.rank() == 0;
  // Item j of this stage's own tensors is items[st.owned[stage][j]]: what fetch numbers.
  const Fetch fetch_mine = [&](size_t j) { return fetch(st.owned[stage][j]); };
  if (!participant) {  // ZeRO's gathers over dp to the participant, in its order
    for (size_t j : order) fetch_mine(j);
  } else {
    check_same_declarations(tp, mine, "optimizer state");
    stream_items(
        mine, tp.rank() == 0, 0, order,
        [&](const std::function<at::Tensor(size_t)>& produce) {
          if (global_rank() != 0) {  // a stage writer: to global rank 0, one tensor at a time
            for (size_t j : order) send_full(pp, produce(j), dev);
            return;
          }
          fs::create_directories(dir);
          checkpoint::SafetensorsStreamWriter w(dir + "/optimizer.safetensors", decls,
                                                {{"format", "colossal-optimizer"}});
          while (!w.done()) {
            const size_t g = w.next_index();
            const auto [s, j] = owner[g];
            w.write_next(s == stage ? produce(j)
                                    : recv_full(pp, static_cast<int>(s), decls[g], dev, meter));
          }
          w.finish();
          json::Value merged = merge_scalars(stage_scalars_text);
          merged.set("wrapper", wrapper);
          write_text_atomic(dir + "/optimizer.json", merged.dump(2));
        },
        meter, fetch_mine);
  }
  barrier();
  return meter->stats;
}

}  // namespace

std::map<std::string, ShardedParameter> find_sharded_parameters(torch::nn::Module& root,
                                                                const dist::Communicator& tp) {
  std::vector<std::pair<std::string, torch::nn::Module*>> all{{"", &root}};
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    all.emplace_back(item.key(), item.value().get());
  std::map<std::string, ShardedParameter> out;
  for (const auto& [prefix, raw] : all) {
    auto* mod = dynamic_cast<nn::Module*>(raw);
    if (!mod || !mod->shard_spec() || mod->shard_spec()->world <= 1) continue;
    const nn::ShardSpec& spec = *mod->shard_spec();
    for (const auto& p : raw->named_parameters(/*recurse=*/false)) {
      const std::string name = prefix.empty() ? p.key() : prefix + "." + p.key();
      const std::vector<int64_t> full = mod->full_shape(p.key());
      const auto local = p.value().sizes();
      COLOSSAL_CHECK(full.size() == local.size(), "checkpoint: ", name, ": full shape ",
                     at::IntArrayRef(full), " and shard ", local, " differ in rank");
      std::vector<int64_t> dims;
      for (size_t k = 0; k < full.size(); ++k)
        if (full[k] != local[k]) dims.push_back(static_cast<int64_t>(k));
      if (dims.empty()) continue;  // kept whole by its layer (a row-parallel bias)
      COLOSSAL_CHECK(dims.size() == 1, "checkpoint: ", name, ": shard ", local,
                     " differs from the full shape ", at::IntArrayRef(full),
                     " in more than one dimension; only one-dimensional sharding is saved");
      dist::Communicator g = spec.group.valid() ? spec.group : tp;
      COLOSSAL_CHECK(g.valid() && g.size() == spec.world && g.rank() == spec.rank,
                     "checkpoint: ", name, ": its spec says rank ", spec.rank, " of ", spec.world,
                     " but group ", g.valid() ? g.name() : std::string("(none)"), " has rank ",
                     g.valid() ? g.rank() : -1, " of ", g.valid() ? g.size() : 0);
      out[name] = ShardedParameter{mod, p.key(), full, dims[0], g};
    }
  }
  return out;
}

namespace {

// The model's tensors that `select` accepts (all when it is empty) as items over `tp`: each with
// its entry of `sharded` (find_sharded_parameters of the same root; the items point into it) and
// its full-shape declaration; every rank refuses a meta tensor or a dtype safetensors lacks alike,
// before any communication. `what` names the caller in errors.
std::vector<Item> model_items(torch::nn::Module& root,
                              const std::map<std::string, ShardedParameter>& sharded,
                              const dist::Communicator& tp,
                              const std::function<bool(const std::string&)>& select,
                              const char* what) {
  std::vector<Item> items;
  for (auto& [name, t] : checkpoint::module_state(root)) {
    if (select && !select(name)) continue;
    COLOSSAL_CHECK(!t.is_meta(), what, ": ", name,
                   " is on the meta device; materialize the model first");
    auto it = sharded.find(name);
    const ShardedParameter* sp = it == sharded.end() ? nullptr : &it->second;
    COLOSSAL_CHECK(!sp || sp->group.ranks() == tp.ranks(), what, ": ", name,
                   " is sharded over group ", sp ? sp->group.name() : "",
                   ", whose members are not those of the checkpoint IO's tp group ", tp.name());
    items.push_back({name,
                     t,
                     sp,
                     {name, t.scalar_type(), sp ? sp->full_shape : t.sizes().vec()},
                     t.sizes().vec()});
    checkpoint::dtype_to_safetensors(t.scalar_type());
  }
  return items;
}

}  // namespace

TensorParallelCheckpointIO::TensorParallelCheckpointIO(dist::Communicator tp, dist::Communicator dp)
    : tp_(std::move(tp)), dp_(std::move(dp)) {
  COLOSSAL_CHECK_INPUT(tp_.valid(),
                       "TensorParallelCheckpointIO: the tp group must be a valid communicator");
  // Global rank 0 writes; its tensor-parallel group gathers to it, so it is a dp rank 0.
  COLOSSAL_CHECK_INPUT(rank_of_global_zero(tp_) < 0 || !dp_.valid() || dp_.rank() == 0,
                       "TensorParallelCheckpointIO: the tp group ", tp_.name(),
                       " holds global rank 0 but this rank is dp rank ", dp_.rank(), " of ",
                       dp_.name(), "; tp and dp must be orthogonal axes of one mesh");
}

TensorParallelCheckpointIO::TensorParallelCheckpointIO(dist::Communicator tp, dist::Communicator dp,
                                                       dist::Communicator pp)
    : TensorParallelCheckpointIO(std::move(tp), std::move(dp)) {
  pp_ = std::move(pp);
  if (!pipelined()) return;
  // Stage writers (tp rank 0 of a dp rank 0 group) send to global rank 0 over their pp group,
  // which must therefore be rank 0's, with rank 0 as stage 0.
  const bool stage_writer = tp_.rank() == 0 && (!dp_.valid() || dp_.rank() == 0);
  COLOSSAL_CHECK_INPUT(global_rank() != 0 || (pp_.rank() == 0 && tp_.rank() == 0),
                       "TensorParallelCheckpointIO: global rank 0 must be tp rank 0 of stage 0, "
                       "but it is tp rank ",
                       tp_.rank(), " of ", tp_.name(), " and pp rank ", pp_.rank(), " of ",
                       pp_.name());
  COLOSSAL_CHECK_INPUT(!stage_writer || rank_of_global_zero(pp_) == 0,
                       "TensorParallelCheckpointIO: this rank writes its stage (tp rank 0, dp "
                       "rank 0) but its pp group ",
                       pp_.name(),
                       " does not have global rank 0 as stage 0; tp, dp and pp must be "
                       "orthogonal axes of one mesh");
}

void TensorParallelCheckpointIO::set_model(std::shared_ptr<torch::nn::Module> model) {
  model_ = model;
}

std::shared_ptr<torch::nn::Module> TensorParallelCheckpointIO::model_for_optimizer(
    const char* what) const {
  auto m = model_.lock();
  COLOSSAL_CHECK(m, "TensorParallelCheckpointIO::", what,
                 ": no model; set_model(model) before saving or loading optimizer states (the "
                 "plugin does it when it boosts the model)");
  return m;
}

void TensorParallelCheckpointIO::save_model(ModelWrapper& model, const std::string& dir, bool shard,
                                            int64_t size_per_shard_mb) {
  model.wait_weights();
  torch::nn::Module& root = model.module();
  const auto sharded = find_sharded_parameters(root, tp_);
  std::vector<Item> items = model_items(root, sharded, tp_, {}, "save_model");
  COLOSSAL_CHECK(!items.empty(), "save_model: the model has no parameters");
  auto lm = std::dynamic_pointer_cast<models::CausalLM>(model.module_ptr());
  if (pipelined()) {
    stats_ = save_model_stages(tp_, dp_, pp_, items, lm.get(), dir, shard, size_per_shard_mb);
    return;
  }
  if (lm) {
    COLOSSAL_CHECK(lm->whole(),
                   "save_model needs the whole model on each tensor-parallel group (this rank "
                   "holds blocks [",
                   lm->first_block(), ", ", lm->end_block(),
                   ")); pipeline stages are not saved here");
  }
  checkpoint::SaveOptions so;
  so.shard = shard;
  so.size_per_shard_mb = size_per_shard_mb;
  std::vector<checkpoint::TensorDecl> decls;
  for (const auto& it : items) decls.push_back(it.decl);
  const checkpoint::StatePlan plan = checkpoint::plan_state_dict(decls, so);  // checks options
  std::vector<size_t> order;
  for (const auto& f : plan.order) order.insert(order.end(), f.begin(), f.end());

  auto meter = std::make_shared<Meter>();
  const int dst = rank_of_global_zero(tp_);
  const bool writer = global_rank() == 0;
  if (dst >= 0) {  // the tensor-parallel group of the writer
    check_same_declarations(tp_, items, "model");
    stream_items(
        items, writer, dst, order,
        [&](const std::function<at::Tensor(size_t)>& produce) {
          checkpoint::save_state_dict_streamed(dir, decls, produce, so);
          if (lm) {
            models::ModelConfig cfg = lm->config();
            cfg.dtype = checkpoint::hf_dtype_name(decls.front().dtype);
            write_text_atomic((fs::path(dir) / "config.json").string(),
                              cfg.to_json().dump(2) + "\n");
          }
        },
        meter);
  }
  stats_ = meter->stats;
  barrier();
}

checkpoint::TensorList TensorParallelCheckpointIO::gather_model_tensors(
    ModelWrapper& model, const std::function<bool(const std::string&)>& select) {
  model.wait_weights();
  torch::nn::Module& root = model.module();
  const auto sharded = find_sharded_parameters(root, tp_);
  std::vector<Item> items = model_items(root, sharded, tp_, select, "gather_model_tensors");
  checkpoint::TensorList out;
  // Data-parallel copies hold the same values: the dp rank 0 groups gather.
  if (dp_.valid() && dp_.rank() != 0) return out;
  auto meter = std::make_shared<Meter>();
  // This stage's tensors whole on its writer, tp rank 0.
  const bool stage_writer = tp_.rank() == 0;
  check_same_declarations(tp_, items, "model");
  std::vector<at::Tensor> full(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    if (!it.sp) {
      if (stage_writer) full[i] = it.local.detach().to(at::kCPU, false, /*copy=*/true);
      continue;
    }
    const at::Tensor idx = slice_indices(*it.sp, it.local.sizes(), it.name);
    if (stage_writer) {
      full[i] = gather_full(*it.sp, it.local, idx, it.decl.shape, meter, it.name).clone();
    } else {
      send_shard(*it.sp, it.local, idx, 0, meter);
    }
  }
  if (!pipelined()) {
    if (global_rank() == 0)
      for (size_t i = 0; i < items.size(); ++i) out.emplace_back(items[i].name, full[i]);
    return out;
  }
  // The stage writers (rank 0's pp group) send their stage's tensors to rank 0, stage by stage.
  const Stages st = gather_stages(pp_, items, "model");
  if (rank_of_global_zero(pp_) < 0) return out;
  const at::Device dev = stage_device(pp_, root);
  const int stage = pp_.rank();
  if (stage == 0)
    for (size_t i = 0; i < items.size(); ++i) out.emplace_back(items[i].name, full[i]);
  for (size_t s = 1; s < st.decls.size(); ++s) {
    for (size_t i : st.owned[s]) {
      if (stage == 0) {
        out.emplace_back(st.decls[s][i].name,
                         recv_full(pp_, static_cast<int>(s), st.decls[s][i], dev, meter).clone());
      } else if (stage == static_cast<int>(s)) {
        send_full(pp_, full[i], dev);
      }
    }
  }
  return out;
}

void TensorParallelCheckpointIO::load_model(ModelWrapper& model, const std::string& path,
                                            bool strict, OptimizerWrapper* optimizer) {
  model.wait_weights();  // a late all-gather must not overwrite the loaded weights
  torch::nn::Module& root = model.module();
  const auto sharded = find_sharded_parameters(root, tp_);
  // Views of the mapped files: only the pages of this rank's slices are read. A stage opens
  // only the shards that hold its tensors.
  const checkpoint::TensorList state = checkpoint::module_state(root);
  std::set<std::string> local;
  for (const auto& [name, t] : state) local.insert(name);
  std::vector<std::string> file_names;
  const auto source =
      pipelined()
          ? by_name(checkpoint::load_state_dict(
                path, [&](const std::string& n) { return local.count(n) > 0; }, &file_names))
          : by_name(checkpoint::load_state_dict(path));
  if (!pipelined())
    for (const auto& [name, t] : source) file_names.push_back(name);
  std::vector<std::string> missing, unexpected, mismatched;
  std::map<std::string, bool> known;
  for (const auto& [name, t] : state) {
    known[name] = true;
    auto src = source.find(name);
    if (src == source.end()) {
      missing.push_back(name);
      continue;
    }
    auto sp = sharded.find(name);
    const std::vector<int64_t> want = sp == sharded.end() ? t.sizes().vec() : sp->second.full_shape;
    if (src->second.sizes().vec() != want)
      mismatched.push_back(
          str(name, " (checkpoint ", src->second.sizes(), ", model ", at::IntArrayRef(want), ")"));
  }
  // With stages, a file tensor is expected when any stage holds it.
  std::set<std::string> held;
  if (pipelined()) {
    std::string mine;
    for (const auto& [name, t] : state) mine += name + "\n";
    for (const auto& text : all_gather_strings(pp_, mine)) {
      size_t b = 0;
      for (size_t e = text.find('\n'); e != std::string::npos; b = e + 1, e = text.find('\n', b))
        held.insert(text.substr(b, e - b));
    }
  }
  for (const auto& name : file_names)
    if (!known.count(name) && !held.count(name)) unexpected.push_back(name);
  std::string problems;
  if (!mismatched.empty()) problems += str("; shape mismatch: ", join_names(mismatched));
  if (strict && !missing.empty())
    problems += str("; missing from the checkpoint: ", join_names(missing));
  if (pipelined()) {  // every rank learns every stage's problems and refuses alike
    const auto each = all_gather_strings(pp_, problems);
    problems.clear();
    for (size_t s = 0; s < each.size(); ++s)
      if (!each[s].empty()) problems += str("; stage ", s, ": ", each[s].substr(2));
  }
  if (strict && !unexpected.empty())
    problems += str("; not in the model: ", join_names(unexpected));
  COLOSSAL_CHECK_INPUT(problems.empty(), "checkpoint ", path, " does not match the model", problems,
                       strict ? " (is it the right checkpoint for this model and config?)" : "");
  if (!missing.empty())
    log_warn("checkpoint lacks ", missing.size(), " model tensors: ", join_names(missing, 10));
  if (!unexpected.empty())
    log_warn("checkpoint has ", unexpected.size(),
             " tensors the model does not: ", join_names(unexpected, 10));
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : state) {
    auto src = source.find(name);
    if (src == source.end()) continue;
    auto sp = sharded.find(name);
    at::Tensor slice = sp == sharded.end()
                           ? src->second
                           : sp->second.module->shard_slice(sp->second.key, src->second);
    COLOSSAL_CHECK(slice.sizes() == t.sizes(), "load_model: ", name, ": slice ", slice.sizes(),
                   " does not fit the shard ", t.sizes());
    const_cast<at::Tensor&>(t).copy_(slice);
    // The pages of the mapping just read go back to the kernel: resident memory grows by one
    // tensor during a load, not by the file.
    checkpoint::release_mapped_pages(src->second);
  }
  // fp32 masters follow the loaded weights (ColossalAI's update_master_params).
  if (optimizer) optimizer->sync_masters_from_params();
}

void TensorParallelCheckpointIO::save_optimizer(OptimizerWrapper& optimizer,
                                                const std::string& dir) {
  auto model = model_for_optimizer("save_optimizer");
  const auto sharded = find_sharded_parameters(*model, tp_);
  // Declarations only: each state is made full over ZeRO's dp group (to dp rank 0, this IO's
  // participant) when it is written, then gathered over tp, so a rank holds one state tensor
  // beyond training memory instead of the whole optimizer state.
  OptimizerWrapper::FullStatePlan plan = optimizer.full_state_plan();
  std::vector<Item> items;
  for (const auto& d : plan.tensors) {
    auto it = sharded.find(param_of_state(d.name));
    const ShardedParameter* sp = it == sharded.end() ? nullptr : &it->second;
    if (sp) {
      const auto local = it->second.module->param(it->second.key).sizes();
      COLOSSAL_CHECK(at::IntArrayRef(d.shape) == local, "save_optimizer: state ", d.name,
                     " has shape ", at::IntArrayRef(d.shape), " but its parameter's shard is ",
                     local, "; cannot lay it out in full");
      COLOSSAL_CHECK(sp->group.ranks() == tp_.ranks(), "save_optimizer: ", d.name,
                     " is sharded over group ", sp->group.name(),
                     ", whose members are not those of the checkpoint IO's tp group ", tp_.name());
    }
    items.push_back(
        {d.name, at::Tensor(), sp, {d.name, d.dtype, sp ? sp->full_shape : d.shape}, d.shape});
    checkpoint::dtype_to_safetensors(d.dtype);  // every rank refuses alike, before talking
  }
  const Fetch fetch = [&](size_t i) { return optimizer.full_state_tensor(plan, i); };
  if (pipelined()) {
    stats_ = save_optimizer_stages(tp_, dp_, pp_, items, plan.scalars, optimizer.state(), dir,
                                   fetch, stage_device(pp_, *model));
    return;
  }
  std::vector<checkpoint::TensorDecl> decls;
  for (const auto& it : items) decls.push_back(it.decl);
  const std::vector<size_t> order = checkpoint::safetensors_file_order(decls);

  auto meter = std::make_shared<Meter>();
  const int dst = rank_of_global_zero(tp_);
  const bool writer = global_rank() == 0;
  if (dst >= 0) {
    check_same_declarations(tp_, items, "optimizer state");
    stream_items(
        items, writer, dst, order,
        [&](const std::function<at::Tensor(size_t)>& produce) {
          std::filesystem::create_directories(dir);
          checkpoint::SafetensorsStreamWriter w(dir + "/optimizer.safetensors", decls,
                                                {{"format", "colossal-optimizer"}});
          while (!w.done()) w.write_next(produce(w.next_index()));
          w.finish();
          json::Value scalars = plan.scalars;
          scalars.set("wrapper", optimizer.state());
          write_text_atomic(dir + "/optimizer.json", scalars.dump(2));
        },
        meter, fetch);
  } else {
    for (size_t i : order) fetch(i);  // ZeRO's gathers over dp to the writer's tp group
  }
  stats_ = meter->stats;
  barrier();
}

namespace {

// The optimizer file as this rank's optimizer sees it: a sharded parameter's states (saved in
// full) have its shard's shape, and a read of a flat range of the shard reads only the rows of
// the file that the shard holds (the layer's own shard_slice decides which; padding reads as
// zeros). With stages, only this stage's parameters' states are present.
class ShardedStateSource : public optim::StateSource {
 public:
  ShardedStateSource(const std::string& path, json::Value scalars,
                     const std::map<std::string, ShardedParameter>& sharded,
                     const std::set<std::string>* stage_params)
      : reader_(path), scalars_(std::move(scalars)), sharded_(sharded), stage_(stage_params) {}

  const json::Value& scalars() const override { return scalars_; }

  bool find(const std::string& name, std::vector<int64_t>* shape) const override {
    const std::string param = param_of_state(name);
    if (stage_ && !stage_->count(param)) return false;
    const checkpoint::TensorInfo* info = reader_.find(name);
    if (!info) return false;
    if (shape) {
      const ShardedParameter* sp = sliced(param, *info);
      *shape = sp ? sp->module->param(sp->key).sizes().vec() : info->shape;
    }
    return true;
  }

  void read(const std::string& name, int64_t begin, const at::Tensor& out) const override {
    const checkpoint::TensorInfo* info = reader_.find(name);
    COLOSSAL_CHECK(info, "load_optimizer: ", name, " is not in ", reader_.path());
    const ShardedParameter* sp = sliced(param_of_state(name), *info);
    if (!sp) {
      reader_.read_slice(name, begin, out);
      return;
    }
    const std::vector<int64_t> local = sp->module->param(sp->key).sizes().vec();
    auto cached = indices_.find(sp);
    if (cached == indices_.end())
      cached = indices_.emplace(sp, slice_indices(*sp, local, name)).first;
    auto idx = cached->second.accessor<int64_t, 1>();
    const int64_t d = sp->dim, ld = local[d], fd = sp->full_shape[d];
    int64_t inner = 1;
    for (size_t k = d + 1; k < local.size(); ++k) inner *= local[k];
    int64_t total = 1;
    for (int64_t v : local) total *= v;
    const int64_t n = out.numel();
    COLOSSAL_CHECK(begin >= 0 && begin + n <= total, "load_optimizer: ", name, ": elements [",
                   begin, ", ", begin + n, ") are outside its shard of ", total);
    // A flat view to fill: `out` itself when a contiguous CPU tensor, else a host buffer copied
    // in at the end (one device copy per read, not one per row).
    at::Tensor flat = out.is_cpu() && out.is_contiguous()
                          ? out.view({n})
                          : at::empty({n}, out.options().device(at::kCPU));
    // Runs of shard elements that are consecutive in the file: within a row of `inner`, and
    // across rows while the shard's indices along `d` are consecutive.
    int64_t p = begin;
    while (p < begin + n) {
      const int64_t row = p / inner, o = row / ld, j = row % ld, k = p % inner;
      int64_t len = std::min(inner - k, begin + n - p);
      if (idx[j] < 0) {  // a padding row
        flat.narrow(0, p - begin, len).zero_();
        p += len;
        continue;
      }
      int64_t jj = j;
      while (p + len < begin + n && jj + 1 < ld && idx[jj + 1] == idx[jj] + 1) {
        ++jj;
        len += std::min(inner, begin + n - (p + len));
      }
      reader_.read_slice(name, (o * fd + idx[j]) * inner + k, flat.narrow(0, p - begin, len));
      p += len;
    }
    if (!flat.is_same(out)) out.copy_(flat.view(out.sizes()));
  }

 private:
  // The parameter's slicing when the file holds its states in full (any other shape is passed
  // through, and the optimizer reports it against its parameter).
  const ShardedParameter* sliced(const std::string& param,
                                 const checkpoint::TensorInfo& info) const {
    auto it = sharded_.find(param);
    if (it == sharded_.end() || info.shape != it->second.full_shape) return nullptr;
    return &it->second;
  }

  checkpoint::SafetensorsReader reader_;
  json::Value scalars_;
  const std::map<std::string, ShardedParameter>& sharded_;
  const std::set<std::string>* stage_;
  mutable std::map<const ShardedParameter*, at::Tensor> indices_;
};

}  // namespace

void TensorParallelCheckpointIO::load_optimizer(OptimizerWrapper& optimizer,
                                                const std::string& dir) {
  auto model = model_for_optimizer("load_optimizer");
  const auto sharded = find_sharded_parameters(*model, tp_);
  // With stages, the file holds every stage's states: keep this stage's.
  std::set<std::string> local;
  if (pipelined())
    for (const auto& p : model->named_parameters(/*recurse=*/true)) local.insert(p.key());
  json::Value scalars = json::parse_file(dir + "/optimizer.json");
  if (pipelined()) scalars = stage_scalars(scalars, local);
  ShardedStateSource source(dir + "/optimizer.safetensors", std::move(scalars), sharded,
                            pipelined() ? &local : nullptr);
  optimizer.load_full_state(source);
  if (const json::Value* w = source.scalars().find("wrapper")) optimizer.load_state(*w);
}

void TensorParallelCheckpointIO::save_lr_scheduler(optim::LRScheduler& scheduler,
                                                   const std::string& file) {
  DataParallelCheckpointIO().save_lr_scheduler(scheduler, file);
}

void TensorParallelCheckpointIO::load_lr_scheduler(optim::LRScheduler& scheduler,
                                                   const std::string& file) {
  DataParallelCheckpointIO().load_lr_scheduler(scheduler, file);
}

}  // namespace colossal::booster
