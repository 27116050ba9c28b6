// On-device plan of a shape group (target flowtt_tb_plan, docs/batched_contract.md):
// launcher, no XLA dependency. The FFI handler is in ffi/cuda/tb_handlers.cc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "contract/tb_plan_meta.h"
#include "contract/tb_window.h"

namespace flowtt::tb {

// Scratch bytes build_tb_plan needs for n positions and keys in [0, num_keys) (0 for
// n == 0); any base alignment. Keys of at most 32 bits sort as uint32, others as uint64.
cudaError_t tb_plan_scratch_bytes(int n, int64_t num_keys, size_t* bytes);

// Plan of ids [n] of tables [n] (n + 1 < 2^31) in key form `form` (cuda/contract/tb_plan_meta.h:
// prefix keys, or row keys): each position's key form.key(table, id, num_keys - 1), sorted
// stably; unique keys are the (table, id) uniques, the form's key groups the prefix groups.
// For in-range operands and GroupLayout's meta the plan equals
// flowtt_jax.batched_plan.make_group_plan bit for bit. All work is queued on `stream`; `scratch`
// holds tb_plan_scratch_bytes(n, num_keys) bytes.
cudaError_t build_tb_plan(const int* ids, const int* tables, int n, const TbKeyForm& form,
                          int64_t num_keys, const TbPlanOut& out, void* scratch,
                          cudaStream_t stream);

// The window of a plan (target flowtt_tb_window, cuda/contract/tb_window.h): every output
// element of TbWindowWrite, on `stream`; in's pointers are device memory.
cudaError_t tb_window(const TbWindowIn& in, const TbWindowOut& out, cudaStream_t stream);

}  // namespace flowtt::tb
