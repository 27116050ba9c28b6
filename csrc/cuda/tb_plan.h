// On-device plan of a shape group (target flowtt_tb_plan, docs/batched_contract.md):
// launcher, no XLA dependency. The FFI handler is in cuda/tb_handlers.cc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flowtt::tb {

// The plan's int32 device arrays (fields of flowtt_jax.batched_plan.GroupPlan).
struct TbPlanOutputs {
  int* perm;           // [n]   positions sorted by (table, id) (stable)
  int* inverse;        // [n]   position -> unique index
  int* run_offsets;    // [n+1] first sorted position of each unique (table, id), then n
  int* group_offsets;  // [n+1] first unique index of each (table, i1, i2) group, then num_unique
  int* u_i3;           // [n]   packed g3 row of each unique, then 0
  int* g_i1;           // [n]   packed g1 row of each group, then 0
  int* g_i2;           // [n]   packed g2 row of each group, then 0
  int* counts;         // [2]   (num_unique, num_groups)
};

// Scratch bytes build_tb_plan needs for n positions and keys in [0, num_keys) (0 for
// n == 0); any base alignment. Keys of at most 32 bits sort as uint32, others as uint64.
cudaError_t tb_plan_scratch_bytes(int n, int64_t num_keys, size_t* bytes);

// Plan of ids [n] of tables [n] (n + 1 < 2^31) under the table metadata meta [8, T]:
// each position's key TbKeyForm{meta, extent, row_keys}.key(table, id, num_keys - 1)
// (common/tb_plan_meta.h: prefix keys, or with row_keys the row keys), sorted stably;
// unique keys are the (table, id) uniques, the form's key groups the prefix groups. For in-range
// operands and GroupLayout's meta the plan equals flowtt_jax.batched_plan.make_group_plan bit for
// bit. All work is queued on `stream`; `scratch` holds tb_plan_scratch_bytes(n, num_keys) bytes.
cudaError_t build_tb_plan(const int* ids, const int* tables, int n, const int* meta, int T,
                          int extent, bool row_keys, int64_t num_keys, const TbPlanOutputs& out,
                          void* scratch, cudaStream_t stream);

}  // namespace flowtt::tb
