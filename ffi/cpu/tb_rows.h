// CPU implementation of the table-batched rows ops (docs/batched_contract.md): plain
// C++, no XLA types. The handlers (tb_handlers.cc) check shapes with tb_contract.h and
// call these; every function checks the plan's values first (an index outside its core
// is an error, never an out-of-bounds read) and returns "" on success, else why not.
// Fixed loop order: results are bitwise reproducible.
#pragma once

#include <cstdint>
#include <string>

#include "contract/tb_contract.h"

namespace flowtt::tb::cpu {

// The plan operands the rows ops read (counts already on the host).
struct TbPlan {
  const int32_t* u_i3;           // [n] packed g3 row of each unique index
  const int32_t* g_i1;           // [n] packed g1 row of each group
  const int32_t* g_i2;           // [n] packed g2 row of each group
  const int32_t* group_offsets;  // [n+1]
  int64_t n;
  int32_t num_unique, num_groups;
};

// The plan's values: 0 <= num_groups <= num_unique <= n, group_offsets a partition of
// [0, num_unique) (non-decreasing from 0 to num_unique), g_i1 non-decreasing, and every
// index of a live unique / group inside its core.
std::string TbCheckPlanValues(const TbShape& s, const TbPlan& p);

// rows [n, D]: row u < num_unique as the contract's op 1, rows past num_unique 0.
std::string TbRowsFwd(const TbShape& s, const float* g1, const float* g2, const float* g3,
                      const TbPlan& p, float* rows);

// dg1, dg2, dg3 (the packed cores' shapes): the contract's op 2, every element written.
// One pass over the groups in ascending g (their unique indices in ascending u), adding
// each term to its gradient row as soon as it is formed: every row receives its terms in
// the contract's order (ascending g for dg1 and dg2, ascending u for dg3). Inside a term:
// dP_g's over z, dg1's over (q2, r2), dg2's over q1, dg3's over q1*q2.
std::string TbRowsBwd(const TbShape& s, const float* g1, const float* g2, const float* g3,
                      const float* d_rows, const TbPlan& p, float* dg1, float* dg2, float* dg3);

}  // namespace flowtt::tb::cpu
