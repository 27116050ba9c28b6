// The table metadata of flowtt_tb_plan (docs/batched_contract.md, "The plan op"): one
// int32 array [kTbPlanMetaRows, T], row r at meta + r * T, and the per-position key and
// per-key table the CPU and CUDA implementations share (plain C++, host and device).
#pragma once

#include <cstdint>

#include "contract/host_device.h"

namespace flowtt::tb {

// Rows of the meta array: each table's N, p2, p3, packed core offsets o1, o2, o3, the
// offset of its (i1, i2) prefixes in the prefix key space (exclusive cumsum of p1 * p2)
// and the low 32 bits of its offset in the row key space (exclusive cumsum of
// p1 * p2 * p3; used only where that space has at most 2^32 keys).
enum TbPlanMetaRow : int {
  kMetaRows = 0,
  kMetaP2,
  kMetaP3,
  kMetaO1,
  kMetaO2,
  kMetaO3,
  kMetaPrefixBase,
  kMetaRowBase
};
constexpr int kTbPlanMetaRows = 8;

struct TbPlanMeta {
  const int32_t* m;  // [kTbPlanMetaRows, T]
  int T;             // >= 1
  FLOWTT_HD int32_t at(int row, int t) const { return m[static_cast<int64_t>(row) * T + t]; }
  FLOWTT_HD uint32_t row_base(int t) const { return static_cast<uint32_t>(at(kMetaRowBase, t)); }
};

FLOWTT_HD int64_t TbClamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// The last t with base(t) <= x (0 if none), for non-decreasing base.
template <typename Base>
FLOWTT_HD int TbLastAtMost(int T, uint64_t x, Base base) {
  int lo = 0, hi = T - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (base(mid) <= static_cast<int64_t>(x)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The plan's outputs (fields of flowtt_jax.batched_plan.GroupPlan), written by the CPU and
// the CUDA plan alike.
struct TbPlanOut {
  int32_t* perm;           // [n]   positions sorted by (table, id) (stable)
  int32_t* inverse;        // [n]   position -> unique index
  int32_t* run_offsets;    // [n+1] each unique (table, id)'s first sorted position, then n
  int32_t* group_offsets;  // [n+1] each (table, i1, i2) group's first unique, then num_unique
  int32_t* u_i3;           // [n]   packed g3 row of each unique, then 0
  int32_t* g_i1;           // [n]   packed g1 row of each group, then 0
  int32_t* g_i2;           // [n]   packed g2 row of each group, then 0
  int32_t* counts;         // [2]   (num_unique, num_groups)
};

// A unique key's packed core rows u_i3, and a group's first key's g_i1, g_i2 (int32
// arithmetic wraps like the reference's for inconsistent meta; the rows ops check the
// plan's values).
struct TbPlanRows {
  int32_t i1, i2, i3;
};

// The two forms of the plan's sort keys (each monotone in (table, id), so the sorted
// keys are the (table, id) order):
//   prefix keys (extent >= 1): (prefix_base[t] + id / p3_t) * extent + id % p3_t with
//     extent = max_t p3_t: a key's prefix group is key / extent;
//   row keys (row_keys): row_base[t] + id, the denser form where the prefix keys pass
//     32 bits but these do not (Meta-like 788 tables: 31.8 against 33 bits): a key's
//     table by binary search of the row bases, then its group; extent = max_t p3_t still.
// Table and id are clamped first (table to [0, T), id to [0, N_t)); keys to max_key.
struct TbKeyForm {
  TbPlanMeta meta;
  int64_t extent;
  bool row_keys;

  FLOWTT_HD uint64_t key(int32_t table, int32_t id, uint64_t max_key) const {
    const int t = static_cast<int>(TbClamp64(table, 0, meta.T - 1));
    const int64_t rows = TbClamp64(meta.at(kMetaRows, t), 1, INT32_MAX);
    const int64_t i = TbClamp64(id, 0, rows - 1);
    uint64_t k;
    if (row_keys) {
      k = static_cast<uint64_t>(meta.row_base(t)) + static_cast<uint64_t>(i);
    } else {
      const int64_t p3 = p3_of(t);
      const int64_t base = TbClamp64(meta.at(kMetaPrefixBase, t), 0, INT32_MAX);
      k = static_cast<uint64_t>(base + i / p3) * static_cast<uint64_t>(extent) +
          static_cast<uint64_t>(i % p3);
    }
    return k < max_key ? k : max_key;
  }

  // Whether sorted keys prev < key are in different (table, i1, i2) prefix groups. Row
  // keys: a group spans fewer than p3_t <= extent keys, so keys extent apart differ;
  // else the table of key (binary search) decides.
  FLOWTT_HD bool new_group(uint64_t key, uint64_t prev) const {
    const uint64_t e = static_cast<uint64_t>(extent);
    if (!row_keys) return key / e != prev / e;
    if (key - prev >= e) return true;
    const int t = table_of_row_key(key);
    const uint64_t base = meta.row_base(t);
    if (prev < base) return true;
    const uint64_t p3 = static_cast<uint64_t>(p3_of(t));
    return (key - base) / p3 != (prev - base) / p3;
  }

  FLOWTT_HD TbPlanRows rows(uint64_t key) const {
    int t;
    int64_t local, i3;  // the key's i1 * p2 + i2 and i3 in its table
    if (row_keys) {
      t = table_of_row_key(key);
      const int64_t id = static_cast<int64_t>(key - meta.row_base(t));
      local = id / p3_of(t);
      i3 = id % p3_of(t);
    } else {
      const uint64_t prefix = key / static_cast<uint64_t>(extent);
      t = TbLastAtMost(meta.T, prefix,
                       [this](int u) -> int64_t { return meta.at(kMetaPrefixBase, u); });
      local = static_cast<int64_t>(prefix) - meta.at(kMetaPrefixBase, t);
      i3 = static_cast<int64_t>(key - prefix * static_cast<uint64_t>(extent));
    }
    const int64_t p2 = TbClamp64(meta.at(kMetaP2, t), 1, INT32_MAX);
    return {static_cast<int32_t>(meta.at(kMetaO1, t) + local / p2),
            static_cast<int32_t>(meta.at(kMetaO2, t) + local % p2),
            static_cast<int32_t>(meta.at(kMetaO3, t) + i3)};
  }

 private:
  FLOWTT_HD int64_t p3_of(int t) const { return TbClamp64(meta.at(kMetaP3, t), 1, INT32_MAX); }
  FLOWTT_HD int table_of_row_key(uint64_t key) const {
    return TbLastAtMost(meta.T, key, [this](int u) -> int64_t { return meta.row_base(u); });
  }
};

}  // namespace flowtt::tb
