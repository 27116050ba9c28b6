// The CUDA ops (host API): launchers and their scratch sizes. No XLA dependency, so
// the standalone harness (cuda/harness/harness.cu) and the FFI handlers (ffi/cuda/handlers.cc)
// share them; both link the kernel library flowtt_cuda_kernels. Contract:
// docs/op_contract.md; kernels: docs/kernels.md. Defined in cuda/single/ops.cu (rows ops,
// check_dims), cuda/single/pool.cu (pooling ops), cuda/single/scratch.cu (scratch sizes).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "contract/core_shape.h"

// The backward stages rows_bwd runs, bit i for stage i: 1 tile kernel (with dG2), 2 dG1
// reduce, 4 dG3 keys, 8 i3 sort, 16 dG3. A profiling build of the harness
// (scripts/tune_harness.sh "-DFLOWTT_STAGE_MASK=3" ...) runs a prefix of them to time
// it; the outputs of the stages left out are not written.
#ifndef FLOWTT_STAGE_MASK
#define FLOWTT_STAGE_MASK 31
#endif

namespace flowtt {

// nullptr when the CUDA kernels support these dims, else a message.
const char* check_dims(const TTDims& d);

// ---- op 1: flowtt_tt_rows_fwd ----
size_t rows_fwd_scratch_bytes(const TTDims& d, int n);
cudaError_t rows_fwd(const TTDims& d, const float* g1, const float* g2, const float* g3,
                     const int* unique_ids, const int* group_offsets, const int* counts, int n,
                     float* rows, void* scratch, cudaStream_t stream);

// ---- op 6: flowtt_bag_fwd (rows + pooling in chunks of chunk_rows unique
// rows, rounded up to 64; the rows buffer lives in scratch) ----
size_t bag_fwd_scratch_bytes(const TTDims& d, int n, long long chunk_rows);
cudaError_t bag_fwd(const TTDims& d, const float* g1, const float* g2, const float* g3,
                    const int* unique_ids, const int* group_offsets, const int* counts,
                    const int* inverse, const float* weights, const int* bag_offsets, int n, int B,
                    long long chunk_rows, float* out, void* scratch, cudaStream_t stream);

// ---- op 4: flowtt_tt_rows_bwd ----
size_t rows_bwd_scratch_bytes(const TTDims& d, int n);
cudaError_t rows_bwd(const TTDims& d, const float* g1, const float* g2, const float* g3,
                     const float* d_rows, const int* unique_ids, const int* group_offsets,
                     const int* counts, int n, float* dg1, float* dg2, float* dg3, void* scratch,
                     cudaStream_t stream);

// The pooling ops' window of unique indices [lo, lo + m) (capped at num_unique where the
// plan's counts are given): rows / d_rows [m, D] hold those uniques, row u - lo for unique u;
// positions of other uniques add nothing (docs/op_contract.md). {0, n}: every unique.
struct PoolWindow {
  int lo;
  int m;
};

// ---- op 2: flowtt_bag_pool_fwd ----
// batch: the output layout (cuda/contract/pool_layout.h; 0: row b is bag b). counts: the
// plan's (nullptr: the window is not capped); prev: nullptr, or [B, D] to add onto (may be
// out itself: an aliased accumulation; a later window of an empty window returns at once).
cudaError_t bag_pool_fwd(const float* rows, const int* inverse, const float* weights,
                         const int* bag_offsets, int n, int B, int D, int batch, PoolWindow w,
                         const int* counts, const float* prev, float* out, cudaStream_t stream);

// ---- op 3: flowtt_bag_pool_bwd ----
// d_rows [w.m, D] of the window's uniques; d_weights of positions outside it are 0.
size_t bag_pool_bwd_scratch_bytes(int n, int D);
cudaError_t bag_pool_bwd(const float* dout, const float* rows, const float* weights,
                         const int* inverse, const int* bag_ids, const int* perm,
                         const int* run_offsets, const int* counts, int n, int B, int D,
                         PoolWindow w, float* d_rows,
                         float* d_weights,  // nullptr: not computed
                         void* scratch, cudaStream_t stream);

}  // namespace flowtt
