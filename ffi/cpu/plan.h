// flowtt_plan on the CPU (docs/op_contract.md, "The plan op"), no XLA types: the
// handler in ffi/cpu/handlers.cc checks shapes and attributes, then calls MakePlan.
#pragma once

#include <cstdint>

namespace flowtt::cpu {

// ids [n] -> perm, inverse, unique_ids [n], run_offsets, group_offsets [n+1], counts [2]:
// the plan of flowtt_jax.plan.make_plan bit for bit, ids clamped to [0, num_rows) first.
void MakePlan(const int32_t* ids, int64_t n, int64_t last_extent, int64_t num_rows, int32_t* perm,
              int32_t* inverse, int32_t* unique_ids, int32_t* run_offsets, int32_t* group_offsets,
              int32_t* counts);

// The forward-only plan (perm and run_offsets not computed): inverse, unique_ids [n],
// group_offsets [n+1], counts [2] equal to MakePlan's, by the bitmap of
// cuda/contract/plan_bitmap.h where it applies, else by MakePlan.
void MakeForwardPlan(const int32_t* ids, int64_t n, int64_t last_extent, int64_t num_rows,
                     int32_t* inverse, int32_t* unique_ids, int32_t* group_offsets,
                     int32_t* counts);

}  // namespace flowtt::cpu
