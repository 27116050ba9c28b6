// The table metadata of flowtt_tb_plan (docs/batched_contract.md, "The plan op"): one
// int32 array [kTbPlanMetaRows, T], row r at meta + r * T, and the per-position key and
// per-key table the CPU and CUDA implementations share (plain C++, host and device).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLOWTT_HD __host__ __device__ __forceinline__
#else
#define FLOWTT_HD inline
#endif

namespace flowtt::tb {

// Rows of the meta array: each table's N, p2, p3, packed core offsets o1, o2, o3 and the
// offset of its (i1, i2) prefixes in the key space (exclusive cumsum of p1 * p2).
enum TbPlanMetaRow : int { kMetaRows = 0, kMetaP2, kMetaP3, kMetaO1, kMetaO2, kMetaO3, kMetaPrefixBase };
constexpr int kTbPlanMetaRows = 7;

struct TbPlanMeta {
  const int32_t* m;  // [kTbPlanMetaRows, T]
  int T;             // >= 1
  FLOWTT_HD int32_t at(int row, int t) const { return m[static_cast<int64_t>(row) * T + t]; }
};

FLOWTT_HD int64_t TbClamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The prefix key of (table, id), both clamped first (table to [0, T), id to [0, N_t)):
// (prefix_base[t] + id / p3_t) * extent + id % p3_t, at most max_key.
FLOWTT_HD uint64_t TbPlanKey(const TbPlanMeta& meta, int32_t table, int32_t id, int64_t extent,
                             uint64_t max_key) {
  const int t = static_cast<int>(TbClamp64(table, 0, meta.T - 1));
  const int64_t rows = TbClamp64(meta.at(kMetaRows, t), 1, INT32_MAX);
  const int64_t i = TbClamp64(id, 0, rows - 1);
  const int64_t p3 = TbClamp64(meta.at(kMetaP3, t), 1, INT32_MAX);
  const int64_t base = TbClamp64(meta.at(kMetaPrefixBase, t), 0, INT32_MAX);
  const uint64_t key = static_cast<uint64_t>(base + i / p3) * static_cast<uint64_t>(extent) +
                       static_cast<uint64_t>(i % p3);
  return key < max_key ? key : max_key;
}

// The table of a prefix: the last t with prefix_base[t] <= prefix (0 if none).
FLOWTT_HD int TbTableOfPrefix(const TbPlanMeta& meta, uint64_t prefix) {
  int lo = 0, hi = meta.T - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<int64_t>(meta.at(kMetaPrefixBase, mid)) <= static_cast<int64_t>(prefix)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The plan's packed core rows of a unique key: u_i3, and of a group's first key: g_i1,
// g_i2 (int32 arithmetic wraps like the reference's for inconsistent meta; the rows ops
// check the plan's values).
struct TbPlanRows {
  int32_t i1, i2, i3;
};
FLOWTT_HD TbPlanRows TbRowsOfKey(const TbPlanMeta& meta, uint64_t key, int64_t extent) {
  const uint64_t prefix = key / static_cast<uint64_t>(extent);
  const int t = TbTableOfPrefix(meta, prefix);
  const int64_t local = static_cast<int64_t>(prefix) - meta.at(kMetaPrefixBase, t);
  const int64_t p2 = TbClamp64(meta.at(kMetaP2, t), 1, INT32_MAX);
  return {static_cast<int32_t>(meta.at(kMetaO1, t) + local / p2),
          static_cast<int32_t>(meta.at(kMetaO2, t) + local % p2),
          static_cast<int32_t>(meta.at(kMetaO3, t) + static_cast<int64_t>(key - prefix * extent))};
}

}  // namespace flowtt::tb

#undef FLOWTT_HD
