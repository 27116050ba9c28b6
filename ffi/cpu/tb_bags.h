// flowtt_tb_bags on the CPU (cuda/contract/tb_bags.h): the valid CSR by a running maximum, each
// position's bag by a binary search of it, then the dropped positions parked on the first
// live one.
#pragma once

#include <algorithm>
#include <cstdint>

#include "contract/tb_bags.h"

namespace flowtt::cpu {

inline void MakeTbBags(const tb::TbBagsIn& a, const tb::TbBagsOut& o) {
  int32_t m = 0;
  for (int64_t k = 0; k <= a.num_bags; ++k) {
    m = std::max(m, tb::TbCsrClamp(a.offsets[k], a.n));
    o.offsets[k] = m;
  }
  int64_t first = -1;
  for (int64_t p = 0; p < a.n; ++p) {
    const int64_t k = tb::TbUpperBound(o.offsets, 0, a.num_bags + 1, p);
    if (tb::TbBagsPosition(a, p, k, o) && first < 0) first = p;
  }
  const int64_t src = first < 0 ? 0 : first;  // nothing live: every output is 0 anyway
  for (int64_t p = 0; p < a.n; ++p) {
    if (o.live[p] == 0.f) {
      o.ids[p] = o.ids[src];
      o.tables[p] = o.tables[src];
    }
  }
}

}  // namespace flowtt::cpu
