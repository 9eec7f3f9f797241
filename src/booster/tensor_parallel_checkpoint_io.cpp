// TensorParallelCheckpointIO (see tensor_parallel_checkpoint_io.h): streamed gathers of sharded
// tensors to global rank 0 on save, per-rank slices of memory-mapped files on load.
#include "colossal/booster/tensor_parallel_checkpoint_io.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <unordered_map>

#include "colossal/booster/wrappers.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
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
  at::Tensor local;
  const ShardedParameter* sp = nullptr;  // null: replicated
  checkpoint::TensorDecl decl;           // full shape
};

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
// slices in the same order. `write_files(produce)` runs on the writer only.
void stream_items(const std::vector<Item>& items, bool writer, int dst,
                  const std::vector<size_t>& order,
                  const std::function<void(const std::function<at::Tensor(size_t)>&)>& write_files,
                  const std::shared_ptr<Meter>& meter) {
  std::unordered_map<const ShardedParameter*, at::Tensor> index_cache;
  auto indices_of = [&](const Item& it) {
    auto found = index_cache.find(it.sp);
    if (found != index_cache.end() && found->second.size(0) == it.local.size(it.sp->dim))
      return found->second;
    at::Tensor idx = slice_indices(*it.sp, it.local.sizes(), it.name);
    index_cache[it.sp] = idx;
    return idx;
  };
  if (writer) {
    write_files([&](size_t i) -> at::Tensor {
      const Item& it = items[i];
      if (!it.sp) return cpu_for_write(it.local, meter);
      return gather_full(*it.sp, it.local, indices_of(it), it.decl.shape, meter, it.name);
    });
  } else {
    for (size_t i : order) {
      const Item& it = items[i];
      if (it.sp) send_shard(*it.sp, it.local, indices_of(it), dst, meter);
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
  std::vector<Item> items;
  for (auto& [name, t] : checkpoint::module_state(root)) {
    COLOSSAL_CHECK(!t.is_meta(), "save_model: ", name,
                   " is on the meta device; materialize the model first");
    auto it = sharded.find(name);
    const ShardedParameter* sp = it == sharded.end() ? nullptr : &it->second;
    COLOSSAL_CHECK(!sp || sp->group.ranks() == tp_.ranks(), "save_model: ", name,
                   " is sharded over group ", sp ? sp->group.name() : "",
                   ", whose members are not those of the checkpoint IO's tp group ", tp_.name());
    items.push_back({name, t, sp, {name, t.scalar_type(), sp ? sp->full_shape : t.sizes().vec()}});
    checkpoint::dtype_to_safetensors(t.scalar_type());  // every rank refuses alike, before talking
  }
  COLOSSAL_CHECK(!items.empty(), "save_model: the model has no parameters");
  auto lm = std::dynamic_pointer_cast<models::CausalLM>(model.module_ptr());
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

void TensorParallelCheckpointIO::load_model(ModelWrapper& model, const std::string& path,
                                            bool strict, OptimizerWrapper* optimizer) {
  model.wait_weights();  // a late all-gather must not overwrite the loaded weights
  torch::nn::Module& root = model.module();
  const auto sharded = find_sharded_parameters(root, tp_);
  // Views of the mapped files: only the pages of this rank's slices are read.
  const auto source = by_name(checkpoint::load_state_dict(path));
  const checkpoint::TensorList state = checkpoint::module_state(root);
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
  for (const auto& [name, t] : source)
    if (!known.count(name)) unexpected.push_back(name);
  std::string problems;
  if (!mismatched.empty()) problems += str("; shape mismatch: ", join_names(mismatched));
  if (strict && !missing.empty())
    problems += str("; missing from the checkpoint: ", join_names(missing));
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
  }
  // fp32 masters follow the loaded weights (ColossalAI's update_master_params).
  if (optimizer) optimizer->sync_masters_from_params();
}

void TensorParallelCheckpointIO::save_optimizer(OptimizerWrapper& optimizer,
                                                const std::string& dir) {
  auto model = model_for_optimizer("save_optimizer");
  const auto sharded = find_sharded_parameters(*model, tp_);
  optim::StateDict sd = optimizer.full_state_dict();  // collective under ZeRO (over dp)
  std::vector<Item> items;
  for (auto& [name, t] : sd.tensors) {
    auto it = sharded.find(param_of_state(name));
    const ShardedParameter* sp = it == sharded.end() ? nullptr : &it->second;
    if (sp) {
      const auto local = it->second.module->param(it->second.key).sizes();
      COLOSSAL_CHECK(t.sizes() == local, "save_optimizer: state ", name, " has shape ", t.sizes(),
                     " but its parameter's shard is ", local, "; cannot lay it out in full");
      COLOSSAL_CHECK(sp->group.ranks() == tp_.ranks(), "save_optimizer: ", name,
                     " is sharded over group ", sp->group.name(),
                     ", whose members are not those of the checkpoint IO's tp group ", tp_.name());
    }
    items.push_back({name, t, sp, {name, t.scalar_type(), sp ? sp->full_shape : t.sizes().vec()}});
    checkpoint::dtype_to_safetensors(t.scalar_type());
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
          json::Value scalars = sd.scalars;
          scalars.set("wrapper", optimizer.state());
          write_text_atomic(dir + "/optimizer.json", scalars.dump(2));
        },
        meter);
  }
  stats_ = meter->stats;
  barrier();
}

void TensorParallelCheckpointIO::load_optimizer(OptimizerWrapper& optimizer,
                                                const std::string& dir) {
  auto model = model_for_optimizer("load_optimizer");
  const auto sharded = find_sharded_parameters(*model, tp_);
  optim::StateDict sd;
  for (auto& [name, t] : checkpoint::load_safetensors(dir + "/optimizer.safetensors")) {
    auto it = sharded.find(param_of_state(name));
    if (it != sharded.end() && t.sizes().vec() == it->second.full_shape) {
      sd.tensors.emplace_back(name, it->second.module->shard_slice(it->second.key, t));
    } else {
      // Replicated, or a shape the optimizer itself reports against its parameter.
      sd.tensors.emplace_back(name, t);
    }
  }
  sd.scalars = json::parse_file(dir + "/optimizer.json");
  optimizer.load_full_state_dict(sd);
  if (const json::Value* w = sd.scalars.find("wrapper")) optimizer.load_state(*w);
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
