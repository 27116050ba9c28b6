// flowtt_tb_bags (docs/batched_contract.md, "The bags op"): the offsets of a packed,
// feature-major batch made a valid CSR, then its positions -> their bags, tables and
// out-of-range policy, in one pass. Its
// argument check and the per-position arithmetic the CPU and CUDA implementations share
// (plain C++, host and device).
#pragma once

#include <cstdint>
#include <string>

#include "contract/tb_contract.h"
#include "contract/tb_plan_meta.h"

#if defined(__CUDACC__)
#define FLOWTT_BAGS_HD __host__ __device__ __forceinline__
#else
#define FLOWTT_BAGS_HD inline
#endif

namespace flowtt::tb {

struct TbBagsIn {
  const int32_t* ids;             // [n]
  const int32_t* offsets;         // [num_bags + 1], any values (out.offsets: the CSR used)
  const int32_t* feature_tables;  // [F]: the table of each feature
  const int32_t* num_rows;        // [T]: each table's N
  const int32_t* ends;            // [F]: feature f's positions from ends[f] on are in no bag
  int64_t n, num_bags, batch, F, T;
  bool clip;  // the "clip" policy, else "zero"
};

struct TbBagsOut {
  int32_t* ids;      // [n] in range of their table; dropped positions parked
  int32_t* tables;   // [n]
  float* live;       // [n] 1: in a bag (and in range under "zero"), else 0
  int32_t* bag_ids;  // [n] in [0, num_bags)
  int32_t* offsets;  // [num_bags + 1] the valid CSR over [0, n] the op uses (TbCsrClamp)
};

// An input offset clamped into [0, n]; the op's CSR is the running maximum of these (the
// clip, then the cummax, of bag.canonical_bags).
FLOWTT_BAGS_HD int32_t TbCsrClamp(int32_t offset, int64_t n) {
  return (int32_t)TbClamp64(offset, 0, n);
}

// The first k in [lo, hi) with offsets[k] > p, or hi (offsets non-decreasing there).
FLOWTT_BAGS_HD int64_t TbUpperBound(const int32_t* offsets, int64_t lo, int64_t hi, int64_t p) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] > p) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// Position p, whose upper bound in the valid CSR o.offsets is k (TbUpperBound over
// [0, num_bags + 1)): writes its bag, table, id (clipped, or 0 where out of range under
// "zero") and live flag (in the CSR, before its feature's end, and in range under "zero");
// returns the flag. Feature tables and row counts are clamped into [0, T)
// and >= 1, so any input reads in bounds.
FLOWTT_BAGS_HD bool TbBagsPosition(const TbBagsIn& a, int64_t p, int64_t k, const TbBagsOut& o) {
  // int32 arithmetic from here (num_bags < 2^31): a 64-bit division costs ~5x more on the GPU
  const int32_t bag = (int32_t)TbClamp64(k - 1, 0, a.num_bags - 1);
  const int32_t feature = bag / (int32_t)a.batch;
  const int32_t table = (int32_t)TbClamp64(a.feature_tables[feature], 0, a.T - 1);
  const int32_t limit = a.num_rows[table] < 1 ? 1 : a.num_rows[table];
  const int32_t id = a.ids[p];
  const bool valid = id >= 0 && id < limit;
  const bool live =
      p >= o.offsets[0] && p < o.offsets[a.num_bags] && p < a.ends[feature] && (a.clip || valid);
  o.ids[p] = a.clip ? (int32_t)TbClamp64(id, 0, limit - 1) : (valid ? id : 0);
  o.tables[p] = table;
  o.live[p] = live ? 1.f : 0.f;
  o.bag_ids[p] = bag;
  return live;
}

// Dimension lists of ids, offsets, feature_tables, num_rows, ends and the five outputs;
// batch >= 1 with num_bags = F * batch >= 1; ends [F]; n >= 1 and < 2^31 - 1. "" or why not.
template <typename Dims>
std::string TbCheckBags(const Dims& ids, const Dims& offsets, const Dims& feature_tables,
                        const Dims& num_rows, const Dims& ends, const Dims& ids_out,
                        const Dims& tables_out, const Dims& live_out, const Dims& bag_ids_out,
                        const Dims& offsets_out, int64_t batch) {
  for (const Dims* d : {&ids, &offsets, &feature_tables, &num_rows, &ends, &ids_out, &tables_out,
                        &live_out, &bag_ids_out, &offsets_out}) {
    if (d->size() != 1) return "flowtt_tb_bags: every operand and result must be 1-D";
  }
  const int64_t n = ids[0], num_bags = offsets[0] - 1, F = feature_tables[0];
  if (n < 1 || n + 1 >= kTbInt32Limit || num_bags + 1 >= kTbInt32Limit) {
    return "flowtt_tb_bags: need 1 <= n < 2^31 - 1 ids and fewer than 2^31 - 1 bags";
  }
  if (F < 1 || num_rows[0] < 1 || batch < 1 || num_bags != F * batch) {
    return "flowtt_tb_bags: need F >= 1 feature tables, T >= 1 row counts and offsets "
           "[F * batch + 1] with batch >= 1, got F = " +
           std::to_string(F) + ", T = " + std::to_string(num_rows[0]) + ", offsets [" +
           std::to_string(offsets[0]) + "], batch " + std::to_string(batch);
  }
  if (ends[0] != F) {
    return "flowtt_tb_bags: ends must be [F] = [" + std::to_string(F) + "], got [" +
           std::to_string(ends[0]) + "]";
  }
  if (ids_out[0] != n || tables_out[0] != n || live_out[0] != n || bag_ids_out[0] != n ||
      offsets_out[0] != offsets[0]) {
    return "flowtt_tb_bags: results must be ids, tables, live, bag_ids [n] and offsets "
           "[num_bags + 1]";
  }
  return "";
}

}  // namespace flowtt::tb

#undef FLOWTT_BAGS_HD
