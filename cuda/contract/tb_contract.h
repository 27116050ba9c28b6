// Shape and argument checks of the table-batched rows ops (docs/batched_contract.md),
// shared by the CPU and CUDA handlers. Plain C++: every check takes the operands'
// dimension lists (anything with size() and operator[], e.g. an XLA FFI buffer's
// dimensions() or a std::vector<int64_t>) and returns "" or why not.
#pragma once

#include <cstdint>
#include <string>

#include "contract/core_shape.h"
#include "contract/tb_plan_meta.h"

namespace flowtt::tb {

// Packed cores g1 [p1,1,q1,r1], g2 [p2,r1,q2,r2], g3 [p3,r2,q3,1]: p_k the packed rows of
// core k over all tables of the group.
using TbShape = CoreShape;

constexpr int64_t kTbInt32Limit = int64_t{1} << 31;

template <typename Dims>
std::string TbDimsString(const Dims& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// The three packed cores: 4-D, ranks chaining as (1, r1, r2, 1), every extent >= 1 and
// p1, p2, p3 < 2^31 (the plan's int32 row indices). Fills *s.
template <typename Dims>
std::string TbReadCores(const Dims& g1, const Dims& g2, const Dims& g3, TbShape* s) {
  if (g1.size() != 4 || g2.size() != 4 || g3.size() != 4) {
    return "flowtt_tb: packed cores must be 4-D [P, r_in, q, r_out], got " + TbDimsString(g1) +
           ", " + TbDimsString(g2) + ", " + TbDimsString(g3);
  }
  if (g1[1] != 1 || g3[3] != 1 || g1[3] != g2[1] || g2[3] != g3[1]) {
    return "flowtt_tb: core ranks do not chain as (1, r1, r2, 1): " + TbDimsString(g1) + ", " +
           TbDimsString(g2) + ", " + TbDimsString(g3);
  }
  *s = {g1[0], g2[0], g3[0], g1[2], g2[2], g3[2], g1[3], g2[3]};
  for (int64_t v : {s->p1, s->p2, s->p3, s->q1, s->q2, s->q3, s->r1, s->r2}) {
    if (v < 1) return "flowtt_tb: every core extent must be >= 1";
  }
  if (s->p1 >= kTbInt32Limit || s->p2 >= kTbInt32Limit || s->p3 >= kTbInt32Limit) {
    return "flowtt_tb: packed core rows must be < 2^31";
  }
  return "";
}

// n of a 1-D operand, else -1.
template <typename Dims>
int64_t TbLength(const Dims& d) {
  return d.size() == 1 ? d[0] : -1;
}

// The plan operands u_i3, g_i1, g_i2 [n], group_offsets [n+1], counts [2], with
// 1 <= n and n + 1 < 2^31. Sets *n.
template <typename Dims>
std::string TbCheckPlan(const Dims& u_i3, const Dims& g_i1, const Dims& g_i2,
                        const Dims& group_offsets, const Dims& counts, int64_t* n) {
  *n = TbLength(u_i3);
  if (*n < 1 || *n + 1 >= kTbInt32Limit || TbLength(g_i1) != *n || TbLength(g_i2) != *n ||
      TbLength(group_offsets) != *n + 1 || TbLength(counts) != 2) {
    return "flowtt_tb: plan operands must be u_i3, g_i1, g_i2 [n], group_offsets [n+1], "
           "counts [2] with 1 <= n < 2^31 - 1";
  }
  return "";
}

template <typename Dims>
std::string TbCheckMatrix(const Dims& x, int64_t rows, int64_t cols, const char* name) {
  if (x.size() != 2 || x[0] != rows || x[1] != cols) {
    return std::string("flowtt_tb: ") + name + " must be [" + std::to_string(rows) + ", " +
           std::to_string(cols) + "], got " + TbDimsString(x);
  }
  return "";
}

template <typename Dims>
bool TbSameDims(const Dims& a, const Dims& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// flowtt_tb_rows_fwd(g1, g2, g3, u_i3, g_i1, g_i2, group_offsets, counts) -> rows [n, D].
template <typename Dims>
std::string TbCheckFwd(const Dims& g1, const Dims& g2, const Dims& g3, const Dims& u_i3,
                       const Dims& g_i1, const Dims& g_i2, const Dims& group_offsets,
                       const Dims& counts, const Dims& rows, TbShape* s, int64_t* n) {
  if (std::string e = TbReadCores(g1, g2, g3, s); !e.empty()) return e;
  if (std::string e = TbCheckPlan(u_i3, g_i1, g_i2, group_offsets, counts, n); !e.empty()) {
    return e;
  }
  return TbCheckMatrix(rows, *n, s->dim(), "rows");
}

// flowtt_tb_rows_bwd(g1, g2, g3, d_rows [n, D], u_i3, g_i1, g_i2, group_offsets, counts)
//   -> (dg1, dg2, dg3), each with its core's shape.
template <typename Dims>
std::string TbCheckBwd(const Dims& g1, const Dims& g2, const Dims& g3, const Dims& d_rows,
                       const Dims& u_i3, const Dims& g_i1, const Dims& g_i2,
                       const Dims& group_offsets, const Dims& counts, const Dims& dg1,
                       const Dims& dg2, const Dims& dg3, TbShape* s, int64_t* n) {
  if (std::string e = TbReadCores(g1, g2, g3, s); !e.empty()) return e;
  if (std::string e = TbCheckPlan(u_i3, g_i1, g_i2, group_offsets, counts, n); !e.empty()) {
    return e;
  }
  if (std::string e = TbCheckMatrix(d_rows, *n, s->dim(), "d_rows"); !e.empty()) return e;
  if (!TbSameDims(dg1, g1) || !TbSameDims(dg2, g2) || !TbSameDims(dg3, g3)) {
    return "flowtt_tb: core gradients must have the packed cores' shapes";
  }
  return "";
}

// flowtt_tb_plan(ids [n], tables [n], meta [8, T]) -> perm, inverse [n], run_offsets,
// group_offsets [n+1], u_i3, g_i1, g_i2 [n], counts [2]; 0 <= n, n + 1 < 2^31, T >= 1;
// attrs 1 <= extent < 2^31, num_keys >= 1 (row keys: num_keys <= 2^32). Sets *n and *T.
template <typename Dims>
std::string TbCheckPlanOp(const Dims& ids, const Dims& tables, const Dims& meta, const Dims& perm,
                          const Dims& inverse, const Dims& run_offsets, const Dims& group_offsets,
                          const Dims& u_i3, const Dims& g_i1, const Dims& g_i2, const Dims& counts,
                          int64_t extent, bool row_keys, int64_t num_keys, int64_t* n, int64_t* T) {
  *n = TbLength(ids);
  if (*n < 0 || *n + 1 >= kTbInt32Limit || TbLength(tables) != *n) {
    return "flowtt_tb_plan: ids and tables must be 1-D [n] with n + 1 < 2^31, got " +
           TbDimsString(ids) + ", " + TbDimsString(tables);
  }
  if (meta.size() != 2 || meta[0] != kTbPlanMetaRows || meta[1] < 1 || meta[1] >= kTbInt32Limit) {
    return "flowtt_tb_plan: meta must be [8, T] with T >= 1, got " + TbDimsString(meta);
  }
  *T = meta[1];
  for (const Dims* d : {&perm, &inverse, &u_i3, &g_i1, &g_i2}) {
    if (TbLength(*d) != *n) return "flowtt_tb_plan: perm, inverse, u_i3, g_i1, g_i2 must be [n]";
  }
  if (TbLength(run_offsets) != *n + 1 || TbLength(group_offsets) != *n + 1 ||
      TbLength(counts) != 2) {
    return "flowtt_tb_plan: run_offsets, group_offsets must be [n+1] and counts [2]";
  }
  if (extent < 1 || extent >= kTbInt32Limit || num_keys < 1) {
    return "flowtt_tb_plan: need 1 <= extent < 2^31 and num_keys >= 1, got " +
           std::to_string(extent) + ", " + std::to_string(num_keys);
  }
  if (row_keys && num_keys > (int64_t{1} << 32)) {
    return "flowtt_tb_plan: row keys need num_keys <= 2^32, got " + std::to_string(num_keys);
  }
  return "";
}

// flowtt_tb_window: a plan's u_i3, g_i1, g_i2 [n], group_offsets [n+1], counts [2] (as
// TbCheckPlan) and the window's u_i3, g_i1, g_i2 [size], group_offsets [size+1], counts [2]
// with size >= 1; 0 <= lo and lo + size < 2^31. Sets *n and *size.
template <typename Dims>
std::string TbCheckWindow(const Dims& u_i3, const Dims& g_i1, const Dims& g_i2,
                          const Dims& group_offsets, const Dims& counts, const Dims& w_u_i3,
                          const Dims& w_g_i1, const Dims& w_g_i2, const Dims& w_group_offsets,
                          const Dims& w_counts, int64_t lo, int64_t* n, int64_t* size) {
  if (std::string e = TbCheckPlan(u_i3, g_i1, g_i2, group_offsets, counts, n); !e.empty()) {
    return "flowtt_tb_window: " + e;
  }
  *size = TbLength(w_u_i3);
  if (*size < 1 || TbLength(w_g_i1) != *size || TbLength(w_g_i2) != *size ||
      TbLength(w_group_offsets) != *size + 1 || TbLength(w_counts) != 2) {
    return "flowtt_tb_window: the window must be u_i3, g_i1, g_i2 [size], group_offsets "
           "[size+1], counts [2] with size >= 1";
  }
  if (lo < 0 || lo + *size >= kTbInt32Limit) {
    return "flowtt_tb_window: need 0 <= lo and lo + size < 2^31, got lo " + std::to_string(lo) +
           ", size " + std::to_string(*size);
  }
  return "";
}

}  // namespace flowtt::tb
