// CPU implementation of the flowtt op contract (docs/op_contract.md), 3 cores.
// Plain C++, no XLA types: the handlers in ffi/cpu/handlers.cc validate shapes and
// call these. Every loop runs in a fixed order, so results are bitwise
// reproducible. Each function returns an empty string on success, else why not.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "contract/core_shape.h"
#include "contract/pool_layout.h"

namespace flowtt::cpu {

using Shape = CoreShape;

// Plan arrays shared by the tt_rows ops.
struct GroupPlan {
  const int32_t* unique_ids;     // [n]
  const int32_t* group_offsets;  // [n+1]
  int64_t n;
  int32_t num_unique, num_groups;
};

inline std::string CheckGroups(const Shape& s, const GroupPlan& p) {
  if (p.num_unique < 0 || p.num_unique > p.n || p.num_groups < 0 || p.num_groups > p.n) {
    return "plan counts out of range";
  }
  for (int32_t g = 0; g <= p.num_groups; ++g) {
    int32_t o = p.group_offsets[g];
    if (o < 0 || o > p.num_unique || (g > 0 && o < p.group_offsets[g - 1])) {
      return "group_offsets are not a valid partition of the unique ids";
    }
  }
  if (p.group_offsets[0] != 0 || p.group_offsets[p.num_groups] != p.num_unique) {
    return "group_offsets are not a valid partition of the unique ids";
  }
  for (int32_t u = 0; u < p.num_unique; ++u) {
    if (p.unique_ids[u] < 0 || p.unique_ids[u] >= s.rows()) {
      return "id " + std::to_string(p.unique_ids[u]) + " outside [0, " + std::to_string(s.rows()) +
             ")";
    }
  }
  return "";
}

// prefix[q1*q2, r2] = g1[i1, 0] (q1 x r1) . g2[i2] (r1 x q2 x r2)
inline void Prefix(const Shape& s, const float* g1, const float* g2, int64_t i1, int64_t i2,
                   float* prefix) {
  const float* a = g1 + i1 * s.q1 * s.r1;
  const float* b = g2 + i2 * s.r1 * s.q2 * s.r2;
  std::memset(prefix, 0, sizeof(float) * s.q1 * s.q2 * s.r2);
  for (int64_t x = 0; x < s.q1; ++x) {
    for (int64_t k = 0; k < s.r1; ++k) {
      const float av = a[x * s.r1 + k];
      const float* brow = b + k * s.q2 * s.r2;
      float* out = prefix + x * s.q2 * s.r2;
      for (int64_t j = 0; j < s.q2 * s.r2; ++j) out[j] += av * brow[j];
    }
  }
}

// Rows of the unique indices [u_begin, u_end) (0 <= u_begin < u_end <= num_unique, groups
// checked) into rows[(u - u_begin) * D]. A group cut by the range gets its prefix
// recomputed, bit for bit the same. `prefix`: scratch of q1*q2*r2 floats.
inline void RowsRange(const Shape& s, const float* g1, const float* g2, const float* g3,
                      const GroupPlan& p, int32_t u_begin, int32_t u_end, float* prefix,
                      float* rows) {
  const int64_t m = s.q1 * s.q2, d = s.dim();
  // The group holding u_begin: the last one starting at or before it.
  int32_t g =
      int32_t(std::upper_bound(p.group_offsets, p.group_offsets + p.num_groups + 1, u_begin) -
              p.group_offsets) -
      1;
  for (; g < p.num_groups && p.group_offsets[g] < u_end; ++g) {
    const int32_t u0 = std::max(p.group_offsets[g], u_begin);
    const int32_t u1 = std::min(p.group_offsets[g + 1], u_end);
    if (u0 >= u1) continue;
    const int64_t id0 = p.unique_ids[u0];
    Prefix(s, g1, g2, id0 / (s.p2 * s.p3), (id0 / s.p3) % s.p2, prefix);
    for (int32_t u = u0; u < u1; ++u) {
      const float* c = g3 + (p.unique_ids[u] % s.p3) * s.r2 * s.q3;  // [r2, q3]
      float* row = rows + int64_t(u - u_begin) * d;
      std::memset(row, 0, sizeof(float) * d);
      for (int64_t x = 0; x < m; ++x) {
        for (int64_t k = 0; k < s.r2; ++k) {
          const float pv = prefix[x * s.r2 + k];
          for (int64_t z = 0; z < s.q3; ++z) row[x * s.q3 + z] += pv * c[k * s.q3 + z];
        }
      }
    }
  }
}

inline std::string RowsFwd(const Shape& s, const float* g1, const float* g2, const float* g3,
                           const GroupPlan& p, float* rows) {
  if (std::string e = CheckGroups(s, p); !e.empty()) return e;
  const int64_t d = s.dim();
  std::vector<float> prefix(s.q1 * s.q2 * s.r2);
  if (p.num_unique > 0) RowsRange(s, g1, g2, g3, p, 0, p.num_unique, prefix.data(), rows);
  std::memset(rows + int64_t(p.num_unique) * d, 0, sizeof(float) * (p.n - p.num_unique) * d);
  return "";
}

inline std::string RowsBwd(const Shape& s, const float* g1, const float* g2, const float* g3,
                           const float* d_rows, const GroupPlan& p, float* dg1, float* dg2,
                           float* dg3) {
  if (std::string e = CheckGroups(s, p); !e.empty()) return e;
  std::memset(dg1, 0, sizeof(float) * s.p1 * s.q1 * s.r1);
  std::memset(dg2, 0, sizeof(float) * s.p2 * s.r1 * s.q2 * s.r2);
  std::memset(dg3, 0, sizeof(float) * s.p3 * s.r2 * s.q3);
  const int64_t m = s.q1 * s.q2, d = s.dim();
  std::vector<float> prefix(m * s.r2), d_prefix(m * s.r2);
  for (int32_t g = 0; g < p.num_groups; ++g) {
    const int32_t u0 = p.group_offsets[g], u1 = p.group_offsets[g + 1];
    if (u0 >= u1) continue;
    const int64_t id0 = p.unique_ids[u0];
    const int64_t i1 = id0 / (s.p2 * s.p3), i2 = (id0 / s.p3) % s.p2;
    Prefix(s, g1, g2, i1, i2, prefix.data());
    std::fill(d_prefix.begin(), d_prefix.end(), 0.0f);
    for (int32_t u = u0; u < u1; ++u) {
      const int64_t i3 = p.unique_ids[u] % s.p3;
      const float* c = g3 + i3 * s.r2 * s.q3;
      float* dc = dg3 + i3 * s.r2 * s.q3;
      const float* dr = d_rows + int64_t(u) * d;  // [m, q3]
      for (int64_t x = 0; x < m; ++x) {
        for (int64_t k = 0; k < s.r2; ++k) {
          const float pv = prefix[x * s.r2 + k];
          float acc = 0.0f;
          for (int64_t z = 0; z < s.q3; ++z) {
            dc[k * s.q3 + z] += pv * dr[x * s.q3 + z];
            acc += dr[x * s.q3 + z] * c[k * s.q3 + z];
          }
          d_prefix[x * s.r2 + k] += acc;
        }
      }
    }
    // prefix[x1, x2, k2] = sum_k1 a[x1, k1] b[k1, x2, k2]
    const float* a = g1 + i1 * s.q1 * s.r1;
    const float* b = g2 + i2 * s.r1 * s.q2 * s.r2;
    float* da = dg1 + i1 * s.q1 * s.r1;
    float* db = dg2 + i2 * s.r1 * s.q2 * s.r2;
    const int64_t w = s.q2 * s.r2;
    for (int64_t x = 0; x < s.q1; ++x) {
      const float* dp = d_prefix.data() + x * w;
      for (int64_t k = 0; k < s.r1; ++k) {
        const float av = a[x * s.r1 + k];
        const float* brow = b + k * w;
        float* dbrow = db + k * w;
        float acc = 0.0f;
        for (int64_t j = 0; j < w; ++j) {
          dbrow[j] += av * dp[j];
          acc += dp[j] * brow[j];
        }
        da[x * s.r1 + k] += acc;
      }
    }
  }
  return "";
}

inline std::string CheckOffsets(const int32_t* offsets, int64_t num_bags, int64_t n) {
  for (int64_t b = 0; b < num_bags; ++b) {
    if (offsets[b] < 0 || offsets[b + 1] < offsets[b] || offsets[b + 1] > n) {
      return "bag offsets must be non-decreasing within [0, nnz]";
    }
  }
  return "";
}

// out[b] += weights[k] * rows[inverse[k] - u_begin] for k in bag b, in increasing k, over the
// positions whose inverse[k] lies in [u_begin, u_end) and whose weight is not 0 (the others
// are skipped, their rows never read: a zero weight gives 0 even for a non-finite row).
// rows holds the unique rows [u_begin, u_end); offsets are checked. Bag b's sum is row
// PoolOutRow(b, num_bags, batch) of out.
inline void PoolRange(const float* rows, int64_t d, const int32_t* inverse, const float* weights,
                      const int32_t* offsets, int64_t num_bags, int64_t u_begin, int64_t u_end,
                      int64_t batch, float* out) {
  for (int64_t b = 0; b < num_bags; ++b) {
    float* o = out + PoolOutRow(b, num_bags, batch) * d;
    for (int32_t k = offsets[b]; k < offsets[b + 1]; ++k) {
      const int64_t u = inverse[k];
      const float w = weights[k];
      if (u < u_begin || u >= u_end || w == 0.0f) continue;
      const float* r = rows + (u - u_begin) * d;
      for (int64_t j = 0; j < d; ++j) o[j] += w * r[j];
    }
  }
}

// The pooling ops' window of unique indices [lo, lo + m), capped at cap (the plan's
// num_unique) unless cap < 0: rows / d_rows [m, d] hold its uniques (row u - lo).
struct Window {
  int64_t lo, m, cap;
  int64_t hi() const { return cap < 0 ? lo + m : std::max(lo, std::min(lo + m, cap)); }
};

// out = prev (or 0 when prev is null; prev may be out itself) + the window's PoolRange.
inline std::string PoolFwd(const float* rows, int64_t n, int64_t d, const int32_t* inverse,
                           const float* weights, const int32_t* offsets, int64_t num_bags,
                           int64_t batch, Window w, const float* prev, float* out) {
  if (std::string e = CheckOffsets(offsets, num_bags, n); !e.empty()) return e;
  for (int64_t k = offsets[0]; k < offsets[num_bags]; ++k) {  // the positions in some bag
    if (inverse[k] < 0 || inverse[k] >= n) return "inverse index out of range";
  }
  if (prev == nullptr) {
    std::memset(out, 0, sizeof(float) * num_bags * d);
  } else if (prev != out) {
    std::memcpy(out, prev, sizeof(float) * num_bags * d);
  }
  PoolRange(rows, d, inverse, weights, offsets, num_bags, w.lo, w.hi(), batch, out);
  return "";
}

// flowtt_bag_fwd: PoolFwd(RowsFwd(...)) without the [n, D] rows. The unique rows are
// computed ceil64(chunk_rows) at a time into scratch and pooled right away (chunk-major,
// then increasing k); one chunk gives PoolFwd(RowsFwd(...)) bit for bit. chunk_rows >= 1
// (the handler checks it).
inline std::string BagFwd(const Shape& s, const float* g1, const float* g2, const float* g3,
                          const GroupPlan& p, const int32_t* inverse, const float* weights,
                          const int32_t* offsets, int64_t num_bags, int64_t chunk_rows,
                          float* out) {
  if (std::string e = CheckGroups(s, p); !e.empty()) return e;
  if (std::string e = CheckOffsets(offsets, num_bags, p.n); !e.empty()) return e;
  const int64_t d = s.dim();
  // ceil64(chunk_rows) rows a chunk, at most num_unique (chunk_rows >= n: one chunk).
  const int64_t c =
      std::min<int64_t>(p.num_unique, chunk_rows >= p.n ? p.n : (chunk_rows + 63) / 64 * 64);
  std::vector<float> prefix(s.q1 * s.q2 * s.r2), rows(c * d);
  std::memset(out, 0, sizeof(float) * num_bags * d);
  for (int64_t u0 = 0; u0 < p.num_unique; u0 += c) {
    const int64_t u1 = std::min<int64_t>(u0 + c, p.num_unique);
    RowsRange(s, g1, g2, g3, p, int32_t(u0), int32_t(u1), prefix.data(), rows.data());
    PoolRange(rows.data(), d, inverse, weights, offsets, num_bags, u0, u1, 0, out);
  }
  return "";
}

// d_rows [w.m, d] of the window's uniques (row u - w.lo; rows past its end 0) by the sorted
// runs; d_weights [n] (when not null) dout[bag] . rows[u - w.lo] for positions of the
// window's uniques, 0 for the others.
inline std::string PoolBwd(const float* dout, int64_t num_bags, const float* rows, int64_t n,
                           int64_t d, const float* weights, const int32_t* inverse,
                           const int32_t* bag_ids, const int32_t* perm, const int32_t* run_offsets,
                           int32_t num_unique, Window w, float* d_rows,
                           float* d_weights) {  // d_weights may be null: not computed
  if (num_unique < 0 || num_unique > n) return "plan counts out of range";
  for (int64_t k = 0; k < n; ++k) {
    if (inverse[k] < 0 || inverse[k] >= n || bag_ids[k] < 0 || bag_ids[k] >= num_bags ||
        perm[k] < 0 || perm[k] >= n) {
      return "inverse, bag_ids or perm out of range";
    }
  }
  for (int32_t u = 0; u <= num_unique; ++u) {
    if (run_offsets[u] < 0 || run_offsets[u] > n ||
        (u > 0 && run_offsets[u] < run_offsets[u - 1])) {
      return "run_offsets are not a valid partition";
    }
  }
  const int64_t hi = w.hi();
  std::memset(d_rows, 0, sizeof(float) * w.m * d);
  for (int64_t u = w.lo; u < hi; ++u) {
    float* dr = d_rows + (u - w.lo) * d;
    for (int32_t j = run_offsets[u]; j < run_offsets[u + 1]; ++j) {
      const int32_t k = perm[j];
      const float wk = weights[k];
      const float* g = dout + int64_t(bag_ids[k]) * d;
      for (int64_t c = 0; c < d; ++c) dr[c] += wk * g[c];
    }
  }
  for (int64_t k = 0; d_weights != nullptr && k < n; ++k) {
    d_weights[k] = 0.0f;
    if (inverse[k] < w.lo || inverse[k] >= hi) continue;
    const float* g = dout + int64_t(bag_ids[k]) * d;
    const float* r = rows + int64_t(inverse[k] - w.lo) * d;
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += g[c] * r[c];
    d_weights[k] = acc;
  }
  return "";
}

}  // namespace flowtt::cpu
