// Dispatch, argument checks and autograd of our attention kernels (kernels/attention.h); the
// sm_90a kernels are in src/kernels_sm90/ (compiled when the CUTLASS headers are present).
#include "colossal/kernels/attention.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <string_view>

#include "colossal/core/accelerator.h"
#include "colossal/kernels/fp8.h"
#include "kernels/attention_tiles.h"
#include "kernels/op_common.h"

namespace colossal::kernels {

#ifdef COLOSSAL_WITH_SM90_KERNELS
COLOSSAL_REGISTER_CUDA_KERNEL("attention_sm90_fwd");
COLOSSAL_REGISTER_CUDA_KERNEL("attention_sm90_bwd");
#endif

using namespace detail;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string own_attention_unsupported(const at::Tensor& q, const at::Tensor& k) {
#ifndef COLOSSAL_WITH_SM90_KERNELS
  (void)q;
  (void)k;
  return "this build has no sm_90a attention kernels (configure with the CUTLASS headers: "
         "scripts/fetch_cutlass.sh)";
#else
  if (!q.defined() || !q.is_cuda()) return "the tensors are not on a CUDA device";
  const auto devices = cuda_devices();
  const int idx = q.device().has_index() ? q.device().index() : 0;
  if (idx < 0 || idx >= static_cast<int>(devices.size())) return "the CUDA device is not visible";
  const auto& d = devices[static_cast<size_t>(idx)];
  if (d.major != 9 || d.minor != 0)
    return d.name + " has compute capability " + std::to_string(d.major) + "." +
           std::to_string(d.minor) + "; the kernels are built for 9.0 (sm_90a: H100, H200)";
  if (q.scalar_type() != at::kBFloat16 || (k.defined() && k.scalar_type() != at::kBFloat16))
    return std::string("dtype ") + c10::toString(q.scalar_type()) + " is not bfloat16";
  if (q.dim() != 3 || !cuda::attention_sm90_supported(q.size(2)))
    return "head dimension " + std::to_string(q.dim() == 3 ? q.size(2) : -1) + " is not 64 or 128";
  return "";
#endif
}

// ---- Schedules ------------------------------------------------------------------------------
AttentionSchedule parse_attention_schedule(const std::string& text) {
  AttentionSchedule s;
  bool forward_seen = false;
  size_t begin = 0;
  while (true) {
    const size_t end = text.find('+', begin);
    const std::string part = text.substr(begin, end == std::string::npos ? end : end - begin);
    auto forward = [&](AttentionSchedule::Forward f) {
      COLOSSAL_CHECK_INPUT(!forward_seen, "attention schedule '", text,
                           "': more than one forward schedule");
      forward_seen = true;
      s.forward = f;
    };
    if (part == "plain")
      forward(AttentionSchedule::Forward::plain);
    else if (part == "overlap")
      forward(AttentionSchedule::Forward::overlap);
    else if (part == "pingpong")
      forward(AttentionSchedule::Forward::pingpong);
    else if (part == "dq_tma" && !s.dq_tma)
      s.dq_tma = true;
    else
      throw InputError(str("attention schedule '", text, "': unknown or repeated part '", part,
                           "' (expected plain, overlap or pingpong, optionally +dq_tma)"));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return s;
}

std::string to_string(const AttentionSchedule& schedule) {
  static const char* names[] = {"plain", "overlap", "pingpong"};
  return std::string(names[static_cast<int>(schedule.forward)]) +
         (schedule.dq_tma ? "+dq_tma" : "");
}

namespace {
std::mutex schedule_mutex;
std::optional<AttentionSchedule> schedule_set;
}  // namespace

AttentionSchedule attention_schedule() {
  const std::lock_guard<std::mutex> lock(schedule_mutex);
  if (!schedule_set) {
    const char* env = std::getenv("COLOSSAL_ATTENTION_SCHEDULE");
    AttentionSchedule s = kDefaultAttentionSchedule;
    if (env != nullptr && *env != '\0') {
      try {
        s = parse_attention_schedule(env);
      } catch (const InputError& e) {
        throw InputError(str("COLOSSAL_ATTENTION_SCHEDULE: ", e.what()));
      }
    }
    schedule_set = s;
  }
  return *schedule_set;
}

void set_attention_schedule(const AttentionSchedule& schedule) {
  const std::lock_guard<std::mutex> lock(schedule_mutex);
  schedule_set = schedule;
}

AttentionSections attention_sections(int64_t tokens, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, int64_t l2_bytes) {
  COLOSSAL_CHECK_INPUT(tokens >= 0 && kv_heads > 0 && heads > 0 && heads % kv_heads == 0 &&
                           head_dim > 0 && l2_bytes >= 0,
                       "attention_sections: ", tokens, " tokens, ", heads, " heads, ", kv_heads,
                       " kv heads, head dim ", head_dim, ", ", l2_bytes, " bytes");
  const int64_t group = heads / kv_heads;
  if (l2_bytes == 0 || tokens == 0) return {heads, kv_heads};
  auto fit = [&](int64_t per_kv_head) {
    return std::clamp<int64_t>(l2_bytes / std::max<int64_t>(per_kv_head, 1), 1, kv_heads);
  };
  const int64_t fwd_kv = fit(tokens * head_dim * 2 * 2);                // K, V
  const int64_t bwd_kv = fit(group * tokens * head_dim * (2 + 2 + 4));  // Q, dO, dQ (fp32)
  return {fwd_kv * group, bwd_kv};
}

namespace {
std::optional<int64_t> l2_budget_set;  // under schedule_mutex

// The whole number in [lo, hi] that environment variable `name` holds; nullopt when it is unset
// or empty. Anything else is an InputError: "NAME 'value': expected ...".
std::optional<int64_t> env_whole_number(const char* name, int64_t lo, int64_t hi,
                                        const char* expected) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  COLOSSAL_CHECK_INPUT(errno == 0 && end != env && *end == '\0' && v >= lo && v <= hi, name, " '",
                       env, "': expected ", expected);
  return static_cast<int64_t>(v);
}
}  // namespace

int64_t attention_l2_budget() {
  const std::lock_guard<std::mutex> lock(schedule_mutex);
  if (!l2_budget_set) {
    const std::optional<int64_t> mb =
        env_whole_number("COLOSSAL_ATTENTION_L2_MB", 0, 4096,
                         "a whole number of MiB from 0 (no head sections) to 4096");
    l2_budget_set = mb.value_or(24) << 20;
  }
  return *l2_budget_set;
}

void set_attention_l2_budget(int64_t bytes) {
  COLOSSAL_CHECK_INPUT(bytes >= 0, "set_attention_l2_budget: ", bytes, " bytes");
  const std::lock_guard<std::mutex> lock(schedule_mutex);
  l2_budget_set = bytes;
}

namespace {
std::optional<int64_t> bwd_interleave_set;  // under schedule_mutex
}  // namespace

int64_t attention_bwd_interleave() {
  const std::lock_guard<std::mutex> lock(schedule_mutex);
  if (!bwd_interleave_set) {
    constexpr const char* kName = "COLOSSAL_ATTENTION_BWD_INTERLEAVE";
    const char* env = std::getenv(kName);
    bwd_interleave_set =
        env != nullptr && std::string_view(env) == "auto"
            ? kAttentionBwdInterleaveAuto
            : env_whole_number(kName, 0, 100,
                               "'auto' or a whole number of percent from 0 (head sections one "
                               "after another) to 100 (heaviest tiles first across all sections)")
                  .value_or(kAttentionBwdInterleaveDefault);
  }
  return *bwd_interleave_set;
}

void set_attention_bwd_interleave(int64_t percent) {
  COLOSSAL_CHECK_INPUT(percent == kAttentionBwdInterleaveAuto || (percent >= 0 && percent <= 100),
                       "set_attention_bwd_interleave: ", percent,
                       " is neither a percentage from 0 to 100 nor kAttentionBwdInterleaveAuto");
  const std::lock_guard<std::mutex> lock(schedule_mutex);
  bwd_interleave_set = percent;
}

namespace {
// tile_and_head's numbering (src/kernels_sm90/common.cuh), on the host: with n tiles and kv
// heads in sections of `sec` (sec = kv_heads: one section), section s holds kv heads
// [s * sec, s * sec + in), tile by tile, its heads adjacent. Returns CTA b's (section, tile).
std::pair<int64_t, int64_t> backward_section_and_tile(int64_t b, int64_t n, int64_t kv_heads,
                                                      int64_t sec) {
  const int64_t s = b / (n * sec), rest = b - s * n * sec;
  return {s, rest / std::min(sec, kv_heads - s * sec)};
}
}  // namespace

std::vector<int32_t> attention_backward_order(const std::vector<AttentionTile>& tiles,
                                              int64_t kv_heads, int64_t kv_section,
                                              int64_t interleave) {
  COLOSSAL_CHECK_INPUT(kv_heads > 0 && interleave >= 0 && interleave <= 100,
                       "attention_backward_order: ", kv_heads, " kv heads, interleave ",
                       interleave);
  const int64_t n = static_cast<int64_t>(tiles.size());
  COLOSSAL_CHECK_INPUT(n * kv_heads < (int64_t(1) << 31), "attention_backward_order: ", n,
                       " tiles x ", kv_heads, " kv heads are too many CTAs");
  const int64_t sec = kv_section <= 0 || kv_section >= kv_heads ? kv_heads : kv_section;
  int64_t wmax = 0;
  for (const AttentionTile& t : tiles) wmax = std::max(wmax, t.work);
  std::vector<std::pair<int64_t, int32_t>> keyed(static_cast<size_t>(n * kv_heads));
  for (int64_t b = 0; b < n * kv_heads; ++b) {
    const auto [s, tile] = backward_section_and_tile(b, n, kv_heads, sec);
    // In hundredths of a tile's work: section s is pushed back by (100 - interleave) % of the
    // heaviest tile's work per section before it.
    keyed[static_cast<size_t>(b)] = {
        100 * tiles[static_cast<size_t>(tile)].work - (100 - interleave) * s * wmax,
        static_cast<int32_t>(b)};
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int32_t> order(keyed.size());
  for (size_t i = 0; i < keyed.size(); ++i) order[i] = keyed[i].second;
  return order;
}

int64_t attention_bwd_interleave_auto(const std::vector<AttentionTile>& tiles, int64_t kv_heads,
                                      int64_t kv_section, int64_t group, int64_t sms,
                                      bool deterministic) {
  COLOSSAL_CHECK_INPUT(group > 0 && sms > 0, "attention_bwd_interleave_auto: group ", group, ", ",
                       sms, " SMs");
  const int64_t n = static_cast<int64_t>(tiles.size());
  if (n == 0 || kv_heads <= 0) return 0;
  const int64_t sec = kv_section <= 0 || kv_section >= kv_heads ? kv_heads : kv_section;
  if (sec == kv_heads) return 0;  // one section: every setting is the same order
  if (deterministic) return kAttentionBwdAutoDeterministic;
  // A CTA's cost in 64-query steps of one query head: its tile's work for each head of the
  // group, and about one step to start and to write dK and dV.
  constexpr int64_t kCtaCost = 2;
  double total = 0;
  for (const AttentionTile& t : tiles) total += static_cast<double>(t.work * group + kCtaCost);
  total *= static_cast<double>(kv_heads);
  std::vector<int64_t> busy_until(static_cast<size_t>(sms));
  std::vector<std::pair<int64_t, double>> shares;  // (interleave, busy share)
  double best = 0;
  for (int64_t interleave = 0; interleave <= kAttentionBwdAutoMax; interleave += 10) {
    // List scheduling: CTA by CTA in launch order, each to the SM that frees first.
    std::fill(busy_until.begin(), busy_until.end(), 0);
    std::make_heap(busy_until.begin(), busy_until.end(), std::greater<>());
    for (int32_t b : attention_backward_order(tiles, kv_heads, sec, interleave)) {
      const int64_t tile = backward_section_and_tile(b, n, kv_heads, sec).second;
      std::pop_heap(busy_until.begin(), busy_until.end(), std::greater<>());
      busy_until.back() += tiles[static_cast<size_t>(tile)].work * group + kCtaCost;
      std::push_heap(busy_until.begin(), busy_until.end(), std::greater<>());
    }
    const int64_t makespan = *std::max_element(busy_until.begin(), busy_until.end());
    const double share = total / static_cast<double>(sms) / static_cast<double>(makespan);
    shares.emplace_back(interleave, share);
    best = std::max(best, share);
  }
  // The sections are kept (lowest interleave) unless the count says another order keeps the
  // SMs busier by more than kAttentionBwdAutoSlack: the count does not see L2.
  for (const auto& [interleave, share] : shares)
    if (share >= best - kAttentionBwdAutoSlack) return interleave;
  return 0;
}

std::vector<AttentionSchedule> attention_schedules() {
  std::vector<AttentionSchedule> all;
  for (auto f : {AttentionSchedule::Forward::plain, AttentionSchedule::Forward::overlap,
                 AttentionSchedule::Forward::pingpong})
    for (bool dq_tma : {false, true}) all.push_back({f, dq_tma});
  return all;
}

std::string attention_hang_report() {
#ifdef COLOSSAL_WITH_SM90_KERNELS
  return cuda::attention_sm90_hang_report();
#else
  return "";
#endif
}

// ---- Work lists -----------------------------------------------------------------------------
namespace {
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
// Every (sequence, tile) pair of `block`-token tiles of the side `cut` with its work
// (work(the other side's length, tile)), heaviest first; equal work keeps the order of
// insertion (sequence, then tile).
template <class Work>
std::vector<AttentionTile> work_list(const std::vector<int64_t>& cut,
                                     const std::vector<int64_t>& other, int64_t block, Work work) {
  COLOSSAL_CHECK_INPUT(cut.size() == other.size(), "attention work lists: ", cut.size() - 1,
                       " query sequences against ", other.size() - 1, " key sequences");
  std::vector<AttentionTile> tiles;
  for (size_t s = 0; s + 1 < cut.size(); ++s) {
    const int64_t len = cut[s + 1] - cut[s], len_other = other[s + 1] - other[s];
    for (int64_t t = 0; t < ceil_div(len, block); ++t)
      tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(t), work(len_other, t)});
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const AttentionTile& a, const AttentionTile& b) { return a.work > b.work; });
  return tiles;
}
}  // namespace

std::vector<AttentionTile> attention_forward_tiles(const std::vector<int64_t>& cu_q,
                                                   const std::vector<int64_t>& cu_k, bool causal) {
  constexpr int64_t BM = cuda::kAttentionFwdBlockM, BN = cuda::kAttentionFwdBlockN;
  // A query tile reads the key tiles up to its last row (causal), else all of them.
  return work_list(cu_q, cu_k, BM, [&](int64_t keys, int64_t m) {
    return causal ? std::min(ceil_div(keys, BN), ceil_div((m + 1) * BM, BN)) : ceil_div(keys, BN);
  });
}

std::vector<AttentionTile> attention_backward_tiles(const std::vector<int64_t>& cu_q,
                                                    const std::vector<int64_t>& cu_k, bool causal) {
  constexpr int64_t BM = cuda::kAttentionBwdBlockM, BN = cuda::kAttentionBwdBlockN;
  // A key tile is seen by the query tiles from its own first row on (causal), else by all.
  return work_list(cu_k, cu_q, BN, [&](int64_t queries, int64_t n) {
    return ceil_div(queries, BM) - (causal ? n * BN / BM : 0);
  });
}

std::vector<AttentionTile> attention_forward_tiles(const std::vector<int64_t>& cu, bool causal) {
  return attention_forward_tiles(cu, cu, causal);
}

std::vector<AttentionTile> attention_backward_tiles(const std::vector<int64_t>& cu, bool causal) {
  return attention_backward_tiles(cu, cu, causal);
}

namespace {

// The checked inputs of one call: layouts the kernels take (views of a packed projection output
// as they are, each with its own row stride), the work on the device, the longest sequence,
// the scale.
struct Prepared {
  at::Tensor q, k, v;
  // int32 on the device: the queries' offsets [sequences + 1], the keys' (the same values
  // unless the call gave its own), then the forward's and the backward's work lists ((sequence,
  // tile) pairs), then the backward's launch order.
  at::Tensor work;
  // T, longest: the queries' rows and longest sequence; Tk, longest_k: the keys'.
  int64_t T = 0, Tk = 0, H = 0, D = 0, Hkv = 0, sequences = 0, longest = 0, longest_k = 0;
  int64_t fwd_tiles = 0, bwd_tiles = 0;
  // The head sections the lists were built for (the backward's launch order depends on them).
  AttentionSections sections;
  double scale = 0;
  const int* cu() const { return work.const_data_ptr<int>(); }
  const int* cu_k() const { return cu() + sequences + 1; }
  const int* fwd() const { return cu_k() + sequences + 1; }
  const int* bwd() const { return fwd() + 2 * fwd_tiles; }
  // The backward's launch order (attention_backward_order), bwd_tiles x Hkv entries.
  const int* bwd_order() const { return bwd() + 2 * bwd_tiles; }
};

// The device's SM count for the backward's automatic launch order (132 where it cannot be
// read: an H100 SXM's count; the order is then only less well balanced).
int64_t multiprocessors(const at::Device& device) {
  static const std::vector<CudaDeviceInfo> devices = cuda_devices();
  const int idx = device.has_index() ? device.index() : 0;
  if (!device.is_cuda() || idx < 0 || idx >= static_cast<int>(devices.size()) ||
      devices[static_cast<size_t>(idx)].multiprocessors <= 0)
    return 132;
  return devices[static_cast<size_t>(idx)].multiprocessors;
}

}  // namespace

int64_t attention_multiprocessors(const at::Device& device) {
  return multiprocessors(device);
}

int64_t attention_backward_query_parts(int64_t sequences, int64_t queries, int64_t keys,
                                       int64_t kv_heads, int64_t multiprocessors) {
  constexpr int64_t BM = cuda::kAttentionBwdBlockM, BN = cuda::kAttentionBwdBlockN;
  const int64_t ctas = sequences * ceil_div(keys, BN) * kv_heads;
  if (ctas <= 0 || queries <= 0 || queries % BM != 0) return 1;
  const int64_t tiles = queries / BM;
  int64_t parts = std::max<int64_t>(1, multiprocessors / ctas);
  while (parts > 1 && (tiles % parts != 0 || tiles / parts < kAttentionBwdMinPartTiles)) --parts;
  return parts;
}

namespace {

// Prepared::work for these offsets, uploaded in one copy. For a host tensor the upload of the
// last one seen on this thread is reused while it is unchanged (the layers of one forward pass
// the same tensor); offsets on the device were copied back to the host to be checked, so the
// lists are built from that copy.
void upload_work(Prepared& p, const at::Tensor& cu_seqlens, const std::vector<int64_t>& cu,
                 const at::Tensor& cu_seqlens_k, const std::vector<int64_t>& cu_k, bool causal,
                 bool deterministic, const at::Device& device) {
  // Everything the lists and the launch order are built from, besides the offsets' values.
  struct Key {
    int64_t version, version_k, kv_heads, kv_section, heads, interleave;
    bool causal, deterministic;
    at::Device device;
    bool operator==(const Key&) const = default;
  };
  struct Last {
    at::Tensor host, host_k, dev;
    Key key;
    int64_t fwd = 0, bwd = 0;
  };
  thread_local std::optional<Last> last;
  const int64_t setting = attention_bwd_interleave();
  const Key key{static_cast<int64_t>(cu_seqlens._version()),
                cu_seqlens_k.defined() ? static_cast<int64_t>(cu_seqlens_k._version()) : -1,
                p.Hkv,
                p.sections.bwd_kv_heads,
                p.H,
                setting,
                causal,
                deterministic,
                device};
  const bool host = cu_seqlens.is_cpu() && (!cu_seqlens_k.defined() || cu_seqlens_k.is_cpu());
  if (host && last && last->host.is_same(cu_seqlens) && last->host_k.is_same(cu_seqlens_k) &&
      last->key == key) {
    p.work = last->dev;
    p.fwd_tiles = last->fwd;
    p.bwd_tiles = last->bwd;
    return;
  }
  const std::vector<AttentionTile> f = attention_forward_tiles(cu, cu_k, causal);
  const std::vector<AttentionTile> b = attention_backward_tiles(cu, cu_k, causal);
  const int64_t interleave =
      setting != kAttentionBwdInterleaveAuto
          ? setting
          : attention_bwd_interleave_auto(b, p.Hkv, p.sections.bwd_kv_heads, p.H / p.Hkv,
                                          multiprocessors(device), deterministic);
  const std::vector<int32_t> order =
      attention_backward_order(b, p.Hkv, p.sections.bwd_kv_heads, interleave);
  std::vector<int32_t> all;
  all.reserve(2 * cu.size() + 2 * (f.size() + b.size()) + order.size());
  for (int64_t c : cu) all.push_back(static_cast<int32_t>(c));
  for (int64_t c : cu_k) all.push_back(static_cast<int32_t>(c));
  for (const auto* list : {&f, &b})
    for (const AttentionTile& t : *list) {
      all.push_back(t.seq);
      all.push_back(t.block);
    }
  all.insert(all.end(), order.begin(), order.end());
  p.fwd_tiles = static_cast<int64_t>(f.size());
  p.bwd_tiles = static_cast<int64_t>(b.size());
  // Without waiting for the device, which would sit idle while the host prepares each new
  // batch's list.
  p.work = upload_async(at::tensor(all, at::kInt), device);
  if (host) last = Last{cu_seqlens, cu_seqlens_k, p.work, key, p.fwd_tiles, p.bwd_tiles};
}

// Whether t ([T, heads, D]) is in the layout the kernels read as it is: the head dimension
// contiguous, heads packed, rows 16-byte strided and aligned (TMA's rule).
bool rows_ok(const at::Tensor& t, int64_t D) {
  return t.stride(2) == 1 && t.stride(1) == D && t.stride(0) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// t as it is when the kernels can read it, else a copy in the canonical layout (contiguous()
// would keep the odd strides of a size-1 dimension).
at::Tensor as_rows(const at::Tensor& t, int64_t D) {
  return rows_ok(t, D) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// cu_seqlens (int32 or int64 [sequences + 1]) on the host, checked: 0 first, `rows` last,
// non-decreasing. Offsets on the device cost a copy and a synchronisation; offsets on the host
// are uploaded once and reused while the same host tensor comes again (every layer of one
// forward). `longest` gets the longest sequence.
void check_offsets_type(const char* op, const char* name, const at::Tensor& cu_seqlens) {
  COLOSSAL_CHECK_INPUT(
      cu_seqlens.defined() && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2 &&
          (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong),
      op, ": ", name, " must be int32 or int64 [sequences + 1]");
}

std::vector<int64_t> checked_offsets(const char* op, const char* name, const at::Tensor& cu_seqlens,
                                     int64_t rows, int64_t& longest) {
  check_offsets_type(op, name, cu_seqlens);
  const at::Tensor host = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> cu(host.const_data_ptr<int64_t>(),
                          host.const_data_ptr<int64_t>() + host.numel());
  const size_t n = cu.size() - 1;
  COLOSSAL_CHECK_INPUT(cu[0] == 0 && cu[n] == rows, op, ": ", name,
                       " must start at 0 and end at the rows, ", rows, "; got ", cu[0], " and ",
                       cu[n]);
  longest = 0;
  for (size_t i = 0; i < n; ++i) {
    COLOSSAL_CHECK_INPUT(cu[i + 1] >= cu[i], op, ": ", name, " decreases at ", i + 1, " (", cu[i],
                         " then ", cu[i + 1], ")");
    longest = std::max(longest, cu[i + 1] - cu[i]);
  }
  return cu;
}

// cu_seqlens_k undefined: the keys are the queries' rows (self-attention over packed sequences).
Prepared prepare(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_k, int64_t max_seqlen,
                 int64_t max_seqlen_k, bool causal, double scale, bool deterministic) {
  COLOSSAL_CHECK_INPUT(q.defined() && k.defined() && v.defined(), op,
                       ": q, k and v must be defined");
  COLOSSAL_CHECK_INPUT(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                       ": q, k and v must be [T, heads, D]; got ", q.sizes(), ", ", k.sizes(), ", ",
                       v.sizes());
  check_same(op, "k", k, "q", q);
  check_same(op, "v", v, "q", q);
  const bool cross = cu_seqlens_k.defined();
  Prepared p;
  p.T = q.size(0);
  p.Tk = k.size(0);
  p.H = q.size(1);
  p.D = q.size(2);
  p.Hkv = k.size(1);
  const std::string rows = cross ? "Tk" : std::to_string(p.T);
  COLOSSAL_CHECK_INPUT(
      (cross || p.Tk == p.T) && v.size(0) == p.Tk && k.sizes() == v.sizes() && k.size(2) == p.D, op,
      ": k and v must be [", rows, ", kv_heads, ", p.D, "] alike; got ", k.sizes(), " and ",
      v.sizes());
  COLOSSAL_CHECK_INPUT(p.Hkv > 0 && p.H % p.Hkv == 0, op, ": heads ", p.H,
                       " is not a multiple of kv_heads ", p.Hkv);
  const char* name_q = cross ? "cu_seqlens_q" : "cu_seqlens";
  check_offsets_type(op, name_q, cu_seqlens);
  if (cross) check_offsets_type(op, "cu_seqlens_k", cu_seqlens_k);
  const std::string why = own_attention_unsupported(q, k);
  COLOSSAL_CHECK_INPUT(why.empty(), op, ": ", why);
  COLOSSAL_CHECK_INPUT(p.T < (int64_t(1) << 31) && p.Tk < (int64_t(1) << 31), op, ": ", p.T,
                       " query and ", p.Tk, " key tokens: too many for one call");
  const std::vector<int64_t> cu = checked_offsets(op, name_q, cu_seqlens, p.T, p.longest);
  p.sequences = static_cast<int64_t>(cu.size()) - 1;
  std::vector<int64_t> cu_k = cu;
  p.longest_k = p.longest;
  if (cross) {
    cu_k = checked_offsets(op, "cu_seqlens_k", cu_seqlens_k, p.Tk, p.longest_k);
    COLOSSAL_CHECK_INPUT(cu_k.size() == cu.size(), op, ": cu_seqlens_q holds ", p.sequences,
                         " sequences, cu_seqlens_k ", cu_k.size() - 1);
    for (int64_t i = 0; i < p.sequences; ++i) {
      const int64_t nq = cu[i + 1] - cu[i], nk = cu_k[i + 1] - cu_k[i];
      COLOSSAL_CHECK_INPUT((nq == 0) == (nk == 0), op, ": sequence ", i, " has ", nq,
                           " queries and ", nk,
                           " keys (rows without a partner would be left unwritten)");
      COLOSSAL_CHECK_INPUT(!causal || nq == nk, op, ": causal sequence ", i, " has ", nq,
                           " queries and ", nk, " keys; causal needs as many of each");
    }
    COLOSSAL_CHECK_INPUT(max_seqlen_k <= 0 || max_seqlen_k >= p.longest_k, op, ": max_seqlen_k ",
                         max_seqlen_k, " is shorter than key sequence length ", p.longest_k);
  }
  COLOSSAL_CHECK_INPUT(max_seqlen <= 0 || max_seqlen >= p.longest, op, ": ",
                       cross ? "max_seqlen_q " : "max_seqlen ", max_seqlen,
                       " is shorter than sequence length ", p.longest);
  COLOSSAL_CHECK_INPUT(p.sequences <= 65535 && p.H <= 65535, op, ": ", p.sequences,
                       " sequences and ", p.H, " heads: at most 65535 of each in one call");
  p.q = as_rows(q, p.D);
  p.k = as_rows(k, p.D);
  p.v = as_rows(v, p.D);
  // The forward's sections count the keys' rows, the backward's the queries'.
  p.sections = {attention_sections(p.Tk, p.H, p.Hkv, p.D, attention_l2_budget()).fwd_heads,
                attention_sections(p.T, p.H, p.Hkv, p.D, attention_l2_budget()).bwd_kv_heads};
  upload_work(p, cu_seqlens, cu, cu_seqlens_k, cu_k, causal, deterministic, q.device());
  COLOSSAL_CHECK_INPUT(std::max(p.fwd_tiles * p.H, p.bwd_tiles * p.Hkv) < (int64_t(1) << 31), op,
                       ": ", p.T, " tokens in ", p.H, " heads are too many for one call");
  p.scale = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  return p;
}

#ifdef COLOSSAL_WITH_SM90_KERNELS
// The head sections it returns serve the backward too (AttentionBwdArgs::kv_head_section).
AttentionSections fill_args(const Prepared& p, bool causal, cuda::AttentionFwdArgs& a) {
  a.q = p.q.const_data_ptr();
  a.k = p.k.const_data_ptr();
  a.v = p.v.const_data_ptr();
  a.cu_seqlens = p.cu();
  a.cu_seqlens_k = p.cu_k();
  a.tiles = p.fwd();
  a.tile_count = p.fwd_tiles;
  const AttentionSections sections = p.sections;
  a.head_section = sections.fwd_heads;
  a.total = p.T;
  a.total_k = p.Tk;
  a.sequences = p.sequences;
  a.max_seqlen = p.longest;
  a.heads = p.H;
  a.kv_heads = p.Hkv;
  a.head_dim = p.D;
  a.q_row_stride = p.q.stride(0);
  a.kv_row_stride = p.k.stride(0);
  a.v_row_stride = p.v.stride(0);
  a.causal = causal;
  a.scale = p.scale;
  switch (attention_schedule().forward) {
    case AttentionSchedule::Forward::plain:
      a.schedule = cuda::AttentionFwdSchedule::plain;
      break;
    case AttentionSchedule::Forward::overlap:
      a.schedule = cuda::AttentionFwdSchedule::overlap;
      break;
    case AttentionSchedule::Forward::pingpong:
      a.schedule = cuda::AttentionFwdSchedule::pingpong;
      break;
  }
  return sections;
}
#endif

AttentionResult forward_prepared(const Prepared& p, bool causal,
                                 const std::optional<at::Tensor>& out) {
  at::Tensor o;
  if (out) {
    o = *out;
    COLOSSAL_CHECK_INPUT(o.sizes() == p.q.sizes() && o.is_contiguous() &&
                             o.scalar_type() == p.q.scalar_type() && o.device() == p.q.device() &&
                             reinterpret_cast<uintptr_t>(o.const_data_ptr()) % 16 == 0,
                         "attention_forward: out must be contiguous ", p.q.sizes(), " ",
                         p.q.scalar_type(), " on ", p.q.device(), ", 16-byte aligned");
  } else {
    o = at::empty(p.q.sizes(), p.q.options().memory_format(at::MemoryFormat::Contiguous));
  }
  at::Tensor lse = at::empty({p.H, p.T}, p.q.options().dtype(at::kFloat));
#ifdef COLOSSAL_WITH_SM90_KERNELS
  const c10::DeviceGuard guard(p.q.device());
  cuda::AttentionFwdArgs a;
  fill_args(p, causal, a);
  a.out = o.data_ptr();
  a.lse = lse.data_ptr<float>();
  // FP8 known amax (kernels/fp8.h): the output is an FP8 o_proj's input.
  at::Tensor amax = p.T > 0 ? fp8_amax_slot(p.q) : at::Tensor();
  if (amax.defined()) a.out_amax = amax.data_ptr<float>();
  const at::Tensor counter = at::zeros({1}, p.q.options().dtype(at::kInt));
  a.work_counter = counter.data_ptr<int>();
  if (p.T > 0) cuda::attention_sm90_fwd(a, stream_of(p.q));
  if (amax.defined()) record_fp8_amax(o, amax);
#else
  (void)causal;
#endif
  return {o, lse};
}

AttentionGrads backward_prepared(const Prepared& p, const at::Tensor& out, const at::Tensor& dout,
                                 const at::Tensor& lse, bool causal, bool deterministic) {
  const char* op = "attention_backward";
  COLOSSAL_CHECK_INPUT(
      out.defined() && out.sizes() == p.q.sizes() && out.scalar_type() == p.q.scalar_type(), op,
      ": out must be the forward's output ", p.q.sizes());
  COLOSSAL_CHECK_INPUT(
      dout.defined() && dout.sizes() == p.q.sizes() && dout.scalar_type() == p.q.scalar_type(), op,
      ": dout must be ", p.q.sizes(), " ", p.q.scalar_type());
  COLOSSAL_CHECK_INPUT(lse.defined() && lse.scalar_type() == at::kFloat &&
                           lse.sizes() == at::IntArrayRef({p.H, p.T}),
                       op, ": lse must be float32 [", p.H, ", ", p.T, "] from the forward");
  const at::Tensor o = out.contiguous(), l = lse.contiguous();
  const at::Tensor g = as_rows(dout, p.D);
  AttentionGrads r;
  r.dq = at::empty(p.q.sizes(), p.q.options().memory_format(at::MemoryFormat::Contiguous));
  r.dk = at::empty(p.k.sizes(), p.k.options().memory_format(at::MemoryFormat::Contiguous));
  r.dv = at::empty(p.v.sizes(), p.v.options().memory_format(at::MemoryFormat::Contiguous));
#ifdef COLOSSAL_WITH_SM90_KERNELS
  const c10::DeviceGuard guard(p.q.device());
  at::Tensor delta = at::empty({p.H, p.T}, p.q.options().dtype(at::kFloat));
  at::Tensor dq_accum = at::empty({cuda::attention_sm90_dq_accum_elements(p.T, p.H, p.D)},
                                  p.q.options().dtype(at::kFloat));
  const int64_t sems =
      deterministic ? cuda::attention_sm90_bwd_semaphores(p.sequences, p.longest, p.H) : 0;
  at::Tensor sem = at::empty({std::max<int64_t>(sems, 1)}, p.q.options().dtype(at::kInt));
  cuda::AttentionBwdArgs a;
  const AttentionSections sections = fill_args(p, causal, a);
  a.out = const_cast<void*>(o.const_data_ptr());
  a.lse = const_cast<float*>(l.const_data_ptr<float>());
  a.dout = g.const_data_ptr();
  a.dout_row_stride = g.stride(0);
  a.delta = delta.data_ptr<float>();
  a.dq_accum = dq_accum.data_ptr<float>();
  a.dq_semaphore = sem.data_ptr<int>();
  a.semaphore_count = sems;
  a.dq = r.dq.data_ptr();
  a.dk = r.dk.data_ptr();
  a.dv = r.dv.data_ptr();
  a.deterministic = deterministic;
  a.dq_tma = attention_schedule().dq_tma && !deterministic;
  a.bwd_tiles = p.bwd();
  a.bwd_tile_count = p.bwd_tiles;
  a.bwd_order = p.bwd_order();
  a.kv_head_section = sections.bwd_kv_heads;
  if (p.T > 0) cuda::attention_sm90_bwd(a, stream_of(p.q));
#else
  (void)causal;
  (void)deterministic;
#endif
  return r;
}

struct AttentionFn : torch::autograd::Function<AttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                            bool causal, double scale, bool deterministic) {
    Prepared p = prepare("attention", q, k, v, cu_seqlens, at::Tensor(), max_seqlen, 0, causal,
                         scale, deterministic);
    AttentionResult r = forward_prepared(p, causal, std::nullopt);
    // The checked inputs as the kernels take them (the backward needs no second check).
    ctx->save_for_backward({p.q, p.k, p.v, r.out, r.lse, p.work});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = p.scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["sequences"] = p.sequences;
    ctx->saved_data["longest"] = p.longest;
    ctx->saved_data["fwd_tiles"] = p.fwd_tiles;
    ctx->saved_data["bwd_tiles"] = p.bwd_tiles;
    ctx->saved_data["fwd_heads"] = p.sections.fwd_heads;
    ctx->saved_data["bwd_kv_heads"] = p.sections.bwd_kv_heads;
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    if (!grad[0].defined())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    Prepared p;
    p.q = saved[0];
    p.k = saved[1];
    p.v = saved[2];
    p.work = saved[5];
    p.T = p.q.size(0);
    p.Tk = p.k.size(0);
    p.H = p.q.size(1);
    p.D = p.q.size(2);
    p.Hkv = p.k.size(1);
    p.sequences = ctx->saved_data["sequences"].toInt();
    p.longest = ctx->saved_data["longest"].toInt();
    p.fwd_tiles = ctx->saved_data["fwd_tiles"].toInt();
    p.bwd_tiles = ctx->saved_data["bwd_tiles"].toInt();
    p.sections.fwd_heads = ctx->saved_data["fwd_heads"].toInt();
    p.sections.bwd_kv_heads = ctx->saved_data["bwd_kv_heads"].toInt();
    p.scale = ctx->saved_data["scale"].toDouble();
    AttentionGrads g =
        backward_prepared(p, saved[3], grad[0], saved[4], ctx->saved_data["causal"].toBool(),
                          ctx->saved_data["deterministic"].toBool());
    return {g.dq, g.dk, g.dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

AttentionResult attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                                  double scale, const std::optional<at::Tensor>& out) {
  return forward_prepared(prepare("attention_forward", q, k, v, cu_seqlens, at::Tensor(),
                                  max_seqlen, 0, causal, scale, false),
                          causal, out);
}

AttentionResult attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                  double scale, const std::optional<at::Tensor>& out) {
  COLOSSAL_CHECK_INPUT(cu_seqlens_k.defined(), "attention_forward: cu_seqlens_k is undefined");
  return forward_prepared(prepare("attention_forward", q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, causal, scale, false),
                          causal, out);
}

AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& dout,
                                  const at::Tensor& lse, const at::Tensor& cu_seqlens,
                                  int64_t max_seqlen, bool causal, double scale,
                                  bool deterministic) {
  return backward_prepared(prepare("attention_backward", q, k, v, cu_seqlens, at::Tensor(),
                                   max_seqlen, 0, causal, scale, deterministic),
                           out, dout, lse, causal, deterministic);
}

AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& dout,
                                  const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                                  const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                  int64_t max_seqlen_k, bool causal, double scale,
                                  bool deterministic) {
  COLOSSAL_CHECK_INPUT(cu_seqlens_k.defined(), "attention_backward: cu_seqlens_k is undefined");
  return backward_prepared(prepare("attention_backward", q, k, v, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q, max_seqlen_k, causal, scale, deterministic),
                           out, dout, lse, causal, deterministic);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& cu_seqlens, int64_t max_seqlen, bool causal, double scale,
                     bool deterministic) {
  return AttentionFn::apply(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic);
}

}  // namespace colossal::kernels
