// On-device FlowTT plan (target flowtt_plan, docs/op_contract.md): launcher,
// no XLA dependency. The FFI handler is in ffi/cuda/handlers.cc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flowtt {

// The plan's int32 device arrays (fields of flowtt_jax.plan.Plan). perm and run_offsets
// both null: the forward-only plan (the other fields, the same values).
struct PlanOutputs {
  int* perm;           // [n]   positions sorted by id (stable)
  int* inverse;        // [n]   position -> unique index
  int* unique_ids;     // [n]   ascending unique ids, then 0
  int* run_offsets;    // [n+1] first sorted position of each unique id, then n
  int* group_offsets;  // [n+1] first unique index of each prefix group, then num_unique
  int* counts;         // [2]   (num_unique, num_groups)
};

// Scratch bytes build_plan needs for n ids (0 for n == 0), the forward-only plan if
// forward_only; any base alignment.
cudaError_t plan_scratch_bytes(int n, int num_rows, bool forward_only, size_t* bytes);

// Plan of ids [n] (n + 1 < 2^31), the prefix of an id being id / last_extent.
// Ids are clamped to [0, num_rows - 1] first (num_rows >= 1), so for in-range
// ids the plan equals flowtt_jax.plan.make_plan bit for bit. The forward-only plan
// (out.perm and out.run_offsets null) takes the bitmap of cuda/contract/plan_bitmap.h where
// plan_bitmap::Applies(n, num_rows), else the sort with perm and run_offsets in scratch.
// All work is queued on `stream`; `scratch` holds plan_scratch_bytes(n, num_rows,
// forward_only) bytes.
cudaError_t build_plan(const int* ids, int n, int last_extent, int num_rows, const PlanOutputs& out,
                       void* scratch, cudaStream_t stream);

}  // namespace flowtt
