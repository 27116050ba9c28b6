// flowtt_tb_plan on the CPU: the plan of flowtt_jax.batched_plan.make_group_plan, bit for
// bit (docs/batched_contract.md). Each position's key (cuda/contract/tb_plan_meta.h); the
// stable sort is a sort of (key, position) pairs, which are distinct, packed in one
// uint64 as key << 32 | position where the key has at most 32 bits. One pass over the
// sorted pairs then writes every output element once.
#include "cpu/tb_plan.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace flowtt::cpu {
namespace {

// (key, position) of every position in (key, position) order.
std::vector<std::pair<uint64_t, int32_t>> SortedKeys(const int32_t* ids, const int32_t* tables,
                                                     int64_t n, const tb::TbKeyForm& form,
                                                     uint64_t max_key) {
  std::vector<std::pair<uint64_t, int32_t>> sorted(n);
  if (max_key >> 32 == 0) {
    std::vector<uint64_t> packed(n);
    for (int64_t i = 0; i < n; ++i) {
      packed[i] = form.key(tables[i], ids[i], max_key) << 32 | uint64_t(i);
    }
    std::sort(packed.begin(), packed.end());
    for (int64_t s = 0; s < n; ++s) sorted[s] = {packed[s] >> 32, int32_t(packed[s] & 0xffffffffu)};
    return sorted;
  }
  for (int64_t i = 0; i < n; ++i) {
    sorted[i] = {form.key(tables[i], ids[i], max_key), int32_t(i)};
  }
  std::sort(sorted.begin(), sorted.end());
  return sorted;
}

}  // namespace

void MakeTbPlan(const int32_t* ids, const int32_t* tables, int64_t n, const tb::TbKeyForm& form,
                int64_t num_keys, const tb::TbPlanOut& out) {
  const auto sorted = SortedKeys(ids, tables, n, form, uint64_t(num_keys - 1));
  int32_t u = -1, g = -1;  // unique and group index of the current sorted position
  for (int64_t s = 0; s < n; ++s) {
    const auto [key, pos] = sorted[s];
    if (s == 0 || key != sorted[s - 1].first) {
      const tb::TbPlanRows r = form.rows(key);
      out.run_offsets[++u] = int32_t(s);
      out.u_i3[u] = r.i3;
      if (s == 0 || form.new_group(key, sorted[s - 1].first)) {
        out.group_offsets[++g] = u;
        out.g_i1[g] = r.i1;
        out.g_i2[g] = r.i2;
      }
    }
    out.perm[s] = pos;
    out.inverse[pos] = u;
  }
  const int32_t num_unique = u + 1, num_groups = g + 1;
  std::fill(out.run_offsets + num_unique, out.run_offsets + n + 1, int32_t(n));
  std::fill(out.u_i3 + num_unique, out.u_i3 + n, 0);
  std::fill(out.group_offsets + num_groups, out.group_offsets + n + 1, num_unique);
  std::fill(out.g_i1 + num_groups, out.g_i1 + n, 0);
  std::fill(out.g_i2 + num_groups, out.g_i2 + n, 0);
  out.counts[0] = num_unique;
  out.counts[1] = num_groups;
}

}  // namespace flowtt::cpu
