// Issue 25: what our sm_90a attention kernels assume about CuTe's wgmma fragments, checked on
// the host (make test, no GPU): for every consumer thread, the (row, column) each accumulator
// register holds, from the kernels' own types (src/kernels_sm90/attention_traits.cuh). A wrong
// assumption here is a wrong softmax or a lost gradient that a GPU test would only show as a
// numeric error; this names it.
//  - forward: register j of S holds row rows[(j / 2) % 2] (the softmax's statistics), the four
//    threads holding a row are lanes 4i .. 4i + 3 (the xor-1 / xor-2 shuffles), O's registers
//    hold the same two rows (the rescale and the log-sum-exp store), register pairs (j, j + 1)
//    are adjacent columns (bf16x2 stores), P read from S's registers is the A operand the P V
//    wgmma expects element for element;
//  - backward: S^T / dP^T and the dV / dK accumulators likewise (P^T and dS^T as A operands);
//    a thread's dQ rows are equal mod 8 (one swizzle per thread), its chunks (dq_chunk_register)
//    are four columns c, c + 1, c + 8, c + 9 of one row that dq_index puts in one aligned
//    16-byte vector (in dq_chunk_vector's order, both ways), a half-warp's 8-byte dQ stores hit
//    each shared-memory bank once, and a warp's vector atomics fill whole 32-byte sectors;
//    dq_index is a permutation of each row's columns and dq_chunk_column its inverse;
//  - every tile element is held by exactly one thread;
//  - the launch order (tile_and_head, common.cuh): every (work-list entry, head) pair exactly once,
//    section after section, entries in list order within a section and its heads adjacent.
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels_sm90/attention_traits.cuh"
#include "kernels_sm90/common.cuh"

namespace {

using namespace colossal::kernels::cuda::sm90;

int failures = 0;
#define EXPECT(cond, ...)                                             \
  do {                                                                \
    if (!(cond)) {                                                    \
      if (++failures <= 20) {                                         \
        std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                                     \
        std::printf("\n");                                            \
      }                                                               \
    }                                                                 \
  } while (0)

using Coord = std::pair<int, int>;

// The coordinates of a thread's accumulator registers, in register (logical fragment) order.
template <class Frag>
std::vector<Coord> coords(const Frag& f) {
  std::vector<Coord> v;
  for (int j = 0; j < int(size(f)); ++j) v.push_back({int(get<0>(f(j))), int(get<1>(f(j)))});
  return v;
}

// Registers j alternate rows by (j / 2) % 2 and pairs (j, j + 1) are adjacent columns; returns
// the thread's two rows.
std::pair<int, int> check_rows(const std::vector<Coord>& c, const char* what, int t) {
  int rows[2] = {-1, -1};
  for (int j = 0; j < int(c.size()); ++j) {
    int& r = rows[(j >> 1) & 1];
    if (r < 0) r = c[j].first;
    EXPECT(r == c[j].first, "%s thread %d register %d: row %d, expected %d", what, t, j, c[j].first,
           r);
    if (j % 2 == 1)
      EXPECT(c[j].first == c[j - 1].first && c[j].second == c[j - 1].second + 1,
             "%s thread %d registers %d, %d are not adjacent columns", what, t, j - 1, j);
  }
  EXPECT(rows[1] == rows[0] + 8, "%s thread %d: rows %d and %d", what, t, rows[0], rows[1]);
  return {rows[0], rows[1]};
}

// Every element of an m x n tile is held by exactly one (thread, register).
void check_cover(const std::vector<std::vector<Coord>>& per_thread, int m, int n,
                 const char* what) {
  std::vector<int> seen(size_t(m) * n, 0);
  for (const auto& c : per_thread)
    for (const Coord& x : c) {
      EXPECT(x.first >= 0 && x.first < m && x.second >= 0 && x.second < n, "%s: (%d, %d) outside",
             what, x.first, x.second);
      if (x.first >= 0 && x.first < m && x.second >= 0 && x.second < n)
        ++seen[size_t(x.first) * n + x.second];
    }
  int bad = 0;
  for (int s : seen) bad += s != 1;
  EXPECT(bad == 0, "%s: %d of %d elements not held exactly once", what, bad, m * n);
}

// The register at offset LayoutP(i) of the accumulator (which holds S element `acc[j]` with
// acc_layout(j) = LayoutP(i)) must be the A element a_coords[i] the next wgmma reads.
template <class AccLayout, class PLayout>
void check_registers_as_a(const std::vector<Coord>& acc, const AccLayout& acc_layout,
                          const PLayout& p_layout, const std::vector<Coord>& a_coords,
                          const char* what, int t) {
  std::map<int, int> at;  // register offset -> logical accumulator index
  for (int j = 0; j < int(size(acc_layout)); ++j) at[int(acc_layout(j))] = j;
  EXPECT(a_coords.size() == acc.size(), "%s thread %d: %zu A elements, %zu accumulators", what, t,
         a_coords.size(), acc.size());
  for (int i = 0; i < int(size(p_layout)) && i < int(a_coords.size()); ++i) {
    const auto it = at.find(int(p_layout(i)));
    EXPECT(it != at.end(), "%s thread %d: A register %d reads no accumulator", what, t, i);
    if (it == at.end()) continue;
    EXPECT(acc[it->second] == a_coords[i],
           "%s thread %d A register %d: holds (%d, %d), the wgmma reads it as (%d, %d)", what, t, i,
           acc[it->second].first, acc[it->second].second, a_coords[i].first, a_coords[i].second);
  }
}

// The forward's epilogue (attention_fwd.cu), with the index functions it uses
// (attention_traits.cuh): each warp's stmatrix .x4 k writes matrix i from register i =
// pack(O(fwd_o_register(k, i)), + 1) at the row lane 8i + r addresses (fwd_o_stmatrix_row, in
// column block fwd_o_stmatrix_block, chunk fwd_o_chunk); then thread t of a warpgroup reads
// chunk q = t + 128 k (row q / (D / 8), column block q % (D / 8)) and stores it there. Every
// element must land where the readback stores it, each shared-memory slot written once, and
// neither the 8 rows of a matrix nor a quarter-warp's 8 chunks may share a bank group (16 bytes
// of the 128-byte bank line).
template <int kD>
void forward_staging(const std::vector<std::vector<Coord>>& o_all) {
  constexpr int kChunks = kD / 8;
  for (int wg = 0; wg < 2; ++wg) {
    std::map<int, Coord> slot;  // element offset in the warpgroup's buffer -> (row, col) of O
    for (int w = 0; w < 4; ++w) {
      for (int k = 0; k < kChunks / 2; ++k) {
        for (int i = 0; i < 4; ++i) {
          const int block = fwd_o_stmatrix_block(k, i);
          std::set<int> banks;
          for (int rr = 0; rr < 8; ++rr) {
            const int row = fwd_o_stmatrix_row(w, 8 * i + rr);
            banks.insert((row * kD + fwd_o_chunk(row, block) * 8) / 8 % 8);
          }
          EXPECT(banks.size() == 8,
                 "forward staging D %d warp %d stmatrix %d matrix %d: %zu bank groups", kD, w, k, i,
                 banks.size());
          for (int lane = 0; lane < 32; ++lane) {
            const int t = wg * 128 + w * 32 + lane;
            const int j = fwd_o_register(k, i);
            // Lane l holds row l / 4 of the matrix, whose address lane 8i + l / 4 gave.
            const int row = fwd_o_stmatrix_row(w, 8 * i + lane / 4);
            for (int e = 0; e < 2; ++e) {
              const int off = row * kD + fwd_o_chunk(row, block) * 8 + 2 * (lane % 4) + e;
              EXPECT(slot.count(off) == 0, "forward staging D %d: slot %d written twice", kD, off);
              slot[off] = o_all[t][j + e];
            }
          }
        }
      }
    }
    EXPECT(int(slot.size()) == 64 * kD, "forward staging D %d: %zu slots written", kD, slot.size());
    for (int t = 0; t < 128; ++t)
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const FwdOReadback rb = fwd_o_readback(kD, t, k);  // what the kernel reads and stores
        for (int e = 0; e < 8; ++e) {
          const auto it = slot.find(rb.offset + e);
          EXPECT(it != slot.end() && it->second == Coord(wg * 64 + rb.row, rb.chunk * 8 + e),
                 "forward staging D %d warpgroup %d: thread %d read %d element %d is stored at "
                 "(%d, %d) but holds (%d, %d)",
                 kD, wg, t, k, e, wg * 64 + rb.row, rb.chunk * 8 + e,
                 it == slot.end() ? -1 : it->second.first,
                 it == slot.end() ? -1 : it->second.second);
        }
      }
    for (int k = 0; k < 64 * kChunks / 128; ++k)
      for (int t0 = 0; t0 < 128; t0 += 8) {  // a quarter-warp's 16-byte reads
        std::set<int> banks;
        for (int t = t0; t < t0 + 8; ++t) banks.insert(fwd_o_readback(kD, t, k).offset / 8 % 8);
        EXPECT(banks.size() == 8,
               "forward staging D %d: read %d of threads %d..%d shares bank groups", kD, k, t0,
               t0 + 7);
      }
  }
}

template <int kD>
void forward() {
  using T = FwdTraits<kD, 128, kFwdStages>;
  constexpr int BM = T::kBlockM, BN = T::BN::value;
  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  std::vector<std::vector<Coord>> s_all, o_all;
  std::vector<std::pair<int, int>> rows(256);
  for (int t = 0; t < 256; ++t) {
    auto thr_qk = mma_qk.get_thread_slice(t);
    auto thr_pv = mma_pv.get_thread_slice(t);
    const auto s = coords(thr_qk.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{})));
    const auto o = coords(thr_pv.partition_C(make_identity_tensor(Shape<Int<BM>, Int<kD>>{})));
    rows[t] = check_rows(s, "forward S", t);
    // Register pair (j, j + 1): adjacent columns, column block j / 4 from the first, row half
    // (j / 2) % 2 (what the rescale, the row sums' inverse and fwd_o_register assume).
    for (int j = 0; j < int(o.size()); ++j)
      EXPECT(o[j].first == o[0].first + 8 * ((j / 2) % 2) &&
                 o[j].second == o[0].second + 8 * (j / 4) + j % 2,
             "forward O thread %d register %d: (%d, %d), the epilogue stores it at (%d, %d)", t, j,
             o[j].first, o[j].second, o[0].first + 8 * ((j / 2) % 2),
             o[0].second + 8 * (j / 4) + j % 2);
    EXPECT(check_rows(o, "forward O", t) == rows[t], "forward thread %d: O rows differ from S rows",
           t);
    // P from S's registers as the P V wgmma's A operand.
    auto acc = partition_fragment_C(mma_qk, Shape<Int<BM>, Int<BN>>{});
    const auto a = coords(thr_pv.partition_A(make_identity_tensor(Shape<Int<BM>, Int<BN>>{})));
    check_registers_as_a(s, acc.layout(), typename T::LayoutP{}, a, "forward P", t);
    s_all.push_back(s);
    o_all.push_back(o);
  }
  // The four threads holding a row: lanes 4i .. 4i + 3 of one warp (shuffles xor 1 and 2).
  for (int t = 0; t < 256; ++t)
    for (int u = 0; u < 256; ++u) {
      const bool same = rows[t] == rows[u], quad = (t & ~3) == (u & ~3);
      EXPECT(same == quad, "forward: threads %d and %d %s rows", t, u, same ? "share" : "split");
    }
  check_cover(s_all, BM, BN, "forward S");
  check_cover(o_all, BM, kD, "forward O");
  forward_staging<kD>(o_all);
}

template <int kD, int kBlockM, bool kDqTma>
void backward() {
  using T = BwdTraits<kD, kBlockM, kDqTma>;
  constexpr int BM = T::kBlockM, BN = T::kBlockN;
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmaKV mma_kv;
  typename T::TiledMmaQ mma_q;
  std::vector<std::vector<Coord>> s_all, kv_all, q_all;
  std::vector<std::vector<Coord>> q_by_thread(256);
  for (int t = 0; t < 256; ++t) {
    auto thr_sdp = mma_sdp.get_thread_slice(t);
    auto thr_kv = mma_kv.get_thread_slice(t);
    auto thr_q = mma_q.get_thread_slice(t);
    const auto s = coords(thr_sdp.partition_C(make_identity_tensor(Shape<Int<BN>, Int<BM>>{})));
    const auto kv = coords(thr_kv.partition_C(make_identity_tensor(Shape<Int<BN>, Int<kD>>{})));
    const auto q = coords(thr_q.partition_C(make_identity_tensor(Shape<Int<BM>, Int<kD>>{})));
    check_rows(s, "backward S^T", t);
    // The log-sum-exp and delta read once per column slot: register j's query is that of the
    // register its slot is read from (the kernel's lse_col / delta_col), and the slots cover
    // exactly the thread's distinct queries.
    std::set<int> slots, queries;
    for (int j = 0; j < int(s.size()); ++j) {
      const int first = bwd_slot_register(bwd_query_slot(j));
      EXPECT(s[j].second == s[first].second,
             "backward S^T thread %d register %d: query %d, but register %d holds query %d", t, j,
             s[j].second, first, s[first].second);
      slots.insert(bwd_query_slot(j));
      queries.insert(s[j].second);
    }
    EXPECT(slots.size() == queries.size() && int(slots.size()) == int(s.size()) / 2,
           "backward S^T thread %d: %zu column slots for %zu queries", t, slots.size(),
           queries.size());
    check_rows(kv, "backward dK/dV", t);
    // P^T and dS^T from S^T's registers as the dV / dK wgmma's A operand (keys x queries).
    auto acc = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
    const auto a = coords(thr_kv.partition_A(make_identity_tensor(Shape<Int<BN>, Int<BM>>{})));
    check_registers_as_a(s, acc.layout(), typename T::LayoutP{}, a, "backward P^T", t);
    // dQ: rows equal mod 8; chunk k's registers are columns c, c + 1, c + 8, c + 9 of one row,
    // stored as one aligned float4 by dq_column.
    EXPECT(q.size() % 4 == 0, "backward dQ thread %d: %zu registers", t, q.size());
    for (int j = 0; j < int(q.size()); ++j)
      EXPECT(q[j].first % 8 == q[0].first % 8, "backward dQ thread %d register %d: row %d vs %d", t,
             j, q[j].first, q[0].first);
    for (int k = 0; k < int(q.size()) / 4; ++k) {
      const Coord x = q[dq_chunk_register(k, 0)];
      const int offset[4] = {0, 1, 8, 9};
      for (int i = 0; i < 4; ++i) {
        const Coord y = q[dq_chunk_register(k, i)];
        EXPECT(y.first == x.first && y.second == x.second + offset[i],
               "backward dQ thread %d chunk %d register %d: (%d, %d), chunk starts at (%d, %d)", t,
               k, i, y.first, y.second, x.first, x.second);
      }
      // The kernel's float4 (dq_chunk_vector of the registers in dq_chunk_register order), added
      // at (dq_index & ~3): its slot s must hold the register whose column dq_column puts there.
      for (int64_t row = 0; row < 4; ++row) {
        const float4 v = dq_chunk_vector(make_float4(0.f, 1.f, 2.f, 3.f), row);
        const float slot_reg[4] = {v.x, v.y, v.z, v.w};
        for (int slot = 0; slot < 4; ++slot) {
          const int i = int(slot_reg[slot]);
          const Coord y = q[dq_chunk_register(k, i)];
          EXPECT(dq_column(y.second, row) == (dq_column(x.second, row) & ~3) + slot,
                 "backward dQ thread %d chunk %d row %d: the vector's element %d holds column %d, "
                 "which dq_column puts at %d",
                 t, k, int(row), slot, y.second, dq_column(y.second, row));
        }
      }
    }
    q_by_thread[t] = q;
    s_all.push_back(s);
    kv_all.push_back(kv);
    q_all.push_back(q);
  }
  check_cover(s_all, BN, BM, "backward S^T");
  check_cover(kv_all, BN, kD, "backward dK/dV");
  check_cover(q_all, BM, kD, "backward dQ");
  // The dQ tile's stores into shared memory (float2 at row * D + dq_column(col, row)): within
  // each half-warp, for every register pair and every sequence start, no two threads hit one
  // bank at different words.
  for (int start = 0; start < 8; ++start)
    for (int warp = 0; warp < 8; ++warp)
      for (int j = 0; j + 1 < int(q_by_thread[0].size()); j += 2)
        for (int half = 0; half < 2; ++half) {
          std::map<int, std::set<int>> bank_words;
          for (int lane = half * 16; lane < half * 16 + 16; ++lane) {
            const Coord x = q_by_thread[warp * 32 + lane][j];
            const int word = x.first * kD + dq_column(x.second, start + x.first);
            for (int w : {word, word + 1}) bank_words[w % 32].insert(w);
          }
          int worst = 0;
          for (const auto& [bank, words] : bank_words) worst = std::max(worst, int(words.size()));
          EXPECT(worst == 1, "dQ store D%d start %d warp %d register %d half %d: %d-way conflict",
                 kD, start, warp, j, half, worst);
        }
  // A warp's vector atomics (one 16-byte chunk a thread, at row * D + dq_column(col, row) & ~3)
  // touch only whole 32-byte sectors.
  for (int start = 0; start < 8; ++start)
    for (int warp = 0; warp < 8; ++warp)
      for (int k = 0; k < int(q_by_thread[0].size()) / 4; ++k) {
        std::map<int64_t, std::set<int>> sector_words;
        for (int lane = 0; lane < 32; ++lane) {
          const Coord x = q_by_thread[warp * 32 + lane][dq_chunk_register(k, 0)];
          const int word = x.first * kD + (dq_column(x.second, start + x.first) & ~3);
          for (int w = word; w < word + 4; ++w) sector_words[w / 8].insert(w);
        }
        for (const auto& [sector, words] : sector_words)
          EXPECT(words.size() == 8,
                 "dQ atomics D%d start %d warp %d chunk %d: sector %lld gets %zu words", kD, start,
                 warp, k, (long long)sector, words.size());
      }
  // dq_index: each row's columns permuted; dq_chunk_column is the inverse of each chunk.
  for (int64_t t = 0; t < 8; ++t) {
    std::set<int64_t> cols;
    for (int c = 0; c < kD; ++c) {
      const int64_t i = dq_index<kD>(t, c);
      EXPECT(i >= t * kD && i < (t + 1) * kD, "dq_index(%d, %d) = %lld leaves the row", int(t), c,
             (long long)i);
      cols.insert(i);
    }
    EXPECT(int(cols.size()) == kD, "dq_index row %d: %zu distinct columns", int(t), cols.size());
    // The conversion: physical chunk k read as a float4, dq_chunk_vector gives columns c, c + 1,
    // c + 8, c + 9 (c = dq_chunk_column) in that order.
    for (int k = 0; k < kD / 4; ++k) {
      const int c = dq_chunk_column(k, t), offset[4] = {0, 1, 8, 9};
      const float4 v = dq_chunk_vector(make_float4(0.f, 1.f, 2.f, 3.f), t);
      const float slot_of[4] = {v.x, v.y, v.z, v.w};
      for (int i = 0; i < 4; ++i) {
        const int slot = int(slot_of[i]);
        EXPECT(dq_index<kD>(t, c + offset[i]) == t * kD + 4 * k + slot,
               "dq_chunk_column(%d, %d) = %d: column %d is not element %d of chunk %d", k, int(t),
               c, c + offset[i], slot, k);
      }
    }
  }
}

}  // namespace

void launch_order() {
  for (int tiles : {1, 5, 33})
    for (int heads : {1, 4, 32, 40})
      for (int section : {0, 1, 3, 8, 12, 32, 64}) {
        std::set<std::pair<int, int>> seen;
        int prev_tile = -1, prev_head = -1;
        for (int b = 0; b < tiles * heads; ++b) {
          const TileHead t = tile_and_head(b, tiles, heads, section);
          EXPECT(t.tile >= 0 && t.tile < tiles && t.head >= 0 && t.head < heads,
                 "tiles %d heads %d section %d: CTA %d -> (%d, %d)", tiles, heads, section, b,
                 t.tile, t.head);
          EXPECT(seen.insert({t.tile, t.head}).second,
                 "tiles %d heads %d section %d: (%d, %d) twice", tiles, heads, section, t.tile,
                 t.head);
          const int s = section <= 0 || section >= heads ? heads : section;
          if (b > 0) {
            const bool same_section = t.head / s == prev_head / s;
            // Within a section: the same entry with the next head, or the next entry from the
            // section's first head; else the next section's first entry and first head.
            const bool ok = same_section ? (t.tile == prev_tile && t.head == prev_head + 1) ||
                                               (t.tile == prev_tile + 1 && t.head == t.head / s * s)
                                         : t.head / s == prev_head / s + 1 && t.tile == 0 &&
                                               t.head == t.head / s * s;
            EXPECT(ok, "tiles %d heads %d section %d: CTA %d -> (%d, %d) after (%d, %d)", tiles,
                   heads, section, b, t.tile, t.head, prev_tile, prev_head);
          }
          prev_tile = t.tile;
          prev_head = t.head;
        }
        EXPECT(int(seen.size()) == tiles * heads, "tiles %d heads %d section %d: %zu pairs", tiles,
               heads, section, seen.size());
      }
}

int main() {
  launch_order();
  forward<64>();
  forward<128>();
  // Every query tile and dQ split the kernels instantiate (bwd_block_m: with and without
  // deterministic mode; the dQ split by queries with dq_tma at 128 queries).
  backward<64, bwd_block_m(64, false), true>();
  backward<64, bwd_block_m(64, false), false>();
  backward<64, bwd_block_m(64, true), false>();
  backward<128, bwd_block_m(128, false), true>();
  backward<128, bwd_block_m(128, false), false>();
  static_assert(bwd_block_m(128, true) == bwd_block_m(128, false));
  if (failures > 0) {
    std::printf("%d failed checks\n", failures);
    return 1;
  }
  std::printf(
      "attention layouts: all checks passed (forward and backward, head dims 64 and 128; the "
      "launch order)\n");
  return 0;
}
