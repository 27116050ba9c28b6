// flowtt_plan on the CPU: the plan of flowtt_jax.plan.make_plan, bit for bit
// (docs/op_contract.md). Ids are clamped to [0, num_rows); the stable sort is a
// sort of the 64-bit keys (id << 32 | position), which are distinct, so the
// order is the stable order of the ids. One pass over the sorted keys then
// writes every output element once. The forward-only plan (MakeForwardPlan) takes the
// bitmap of cuda/contract/plan_bitmap.h where it applies.
#include "cpu/plan.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "contract/plan_bitmap.h"

namespace flowtt::cpu {

void MakePlan(const int32_t* ids, int64_t n, int64_t last_extent, int64_t num_rows, int32_t* perm,
              int32_t* inverse, int32_t* unique_ids, int32_t* run_offsets, int32_t* group_offsets,
              int32_t* counts) {
  std::vector<uint64_t> keys(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t id = static_cast<uint64_t>(std::clamp<int64_t>(ids[i], 0, num_rows - 1));
    keys[i] = id << 32 | static_cast<uint64_t>(i);
  }
  std::sort(keys.begin(), keys.end());
  int32_t u = -1, g = -1;  // unique and group index of the current sorted position
  int64_t prev = 0;        // previous sorted id
  for (int64_t s = 0; s < n; ++s) {
    const int64_t id = static_cast<int64_t>(keys[s] >> 32);
    const int32_t pos = static_cast<int32_t>(keys[s] & 0xffffffffu);
    if (s == 0 || id != prev) {
      run_offsets[++u] = static_cast<int32_t>(s);
      unique_ids[u] = static_cast<int32_t>(id);
      if (s == 0 || id / last_extent != prev / last_extent) group_offsets[++g] = u;
    }
    perm[s] = pos;
    inverse[pos] = u;
    prev = id;
  }
  const int32_t num_unique = u + 1, num_groups = g + 1;
  std::fill(run_offsets + num_unique, run_offsets + n + 1, static_cast<int32_t>(n));
  std::fill(unique_ids + num_unique, unique_ids + n, 0);
  std::fill(group_offsets + num_groups, group_offsets + n + 1, num_unique);
  counts[0] = num_unique;
  counts[1] = num_groups;
}

void MakeForwardPlan(const int32_t* ids, int64_t n, int64_t last_extent, int64_t num_rows,
                     int32_t* inverse, int32_t* unique_ids, int32_t* group_offsets,
                     int32_t* counts) {
  namespace pb = plan_bitmap;
  if (!pb::Applies(n, num_rows)) {
    std::vector<int32_t> perm(n), run_offsets(n + 1);
    MakePlan(ids, n, last_extent, num_rows, perm.data(), inverse, unique_ids, run_offsets.data(),
             group_offsets, counts);
    return;
  }
  const int32_t extent = static_cast<int32_t>(last_extent);
  std::vector<uint32_t> bitmap(pb::Words(num_rows), 0u);
  std::vector<int32_t> word_rank(bitmap.size());
  auto clamped = [&](int64_t i) {
    return static_cast<int32_t>(std::clamp<int64_t>(ids[i], 0, num_rows - 1));
  };
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = clamped(i);
    bitmap[id >> 5] |= 1u << (id & 31);
  }
  pb::Span all = pb::kEmpty;
  for (size_t w = 0; w < bitmap.size(); ++w) {
    word_rank[w] = all.u;
    pb::EmitWord(bitmap[w], static_cast<int64_t>(w), extent, all, unique_ids, group_offsets);
    all = pb::Join(all, pb::WordSpan(bitmap[w], static_cast<int64_t>(w), extent));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = clamped(i);
    inverse[i] = pb::Rank(bitmap[id >> 5], word_rank[id >> 5], id);
  }
  std::fill(unique_ids + all.u, unique_ids + n, 0);
  std::fill(group_offsets + all.g, group_offsets + n + 1, all.u);
  counts[0] = all.u;
  counts[1] = all.g;
}

}  // namespace flowtt::cpu
