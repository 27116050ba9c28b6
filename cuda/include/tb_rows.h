// Table-batched rows ops on CUDA (docs/batched_contract.md): launchers, no XLA
// dependency (the FFI handlers in ffi/cuda/tb_handlers.cc and the standalone harness
// cuda/harness/tb_rows_harness.cu share them). Every launch goes on `stream`; no device
// synchronisation, no allocation: the caller passes `scratch` of the size the
// *_scratch_bytes function returns (any alignment, 16 bytes is enough).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "contract/core_shape.h"

namespace flowtt::tb {

// Packed cores g1 [p1,1,q1,r1], g2 [p2,r1,q2,r2], g3 [p3,r2,q3,1]: p_k the packed rows of
// core k over all tables of the group.
using TbDims = TTDims;

// Whether the kernels have compile-time instances for these column shapes and ranks
// (TB_FIXED_SHAPES in cuda/batched/tb_rows.cuh: index math and loop bounds folded).
bool tb_has_fixed_dims(const TbDims& d);

// nullptr when the kernels take these dims (q1 <= 8, q1*q2 <= 16, q3 <= 8, r1, r2 <= 64,
// every extent >= 1, shared memory in bounds), else why not.
const char* tb_check_dims(const TbDims& d);

// flowtt_tb_rows_fwd: rows [n, D] for the unique indices u < num_unique (rows past it are
// left unwritten). Dims with r2 % 4 == 0 and q3 in {4, 8} take the sorted-tile kernel
// (scratch: a radix sort of the group indices by g_i2, sized by n: about 9 bytes per plan
// entry, and the bucket bounds of the g2 rows), others the chunked one (two counters).
// `tiles` (profiling aid for the harness): false forces the chunked kernel.
// `fixed_dims` (for the harness's comparison): false runs the run-time dims instances of
// the kernels also for the column shapes and ranks compiled in (TB_FIXED_SHAPES in
// cuda/batched/tb_rows.cuh), bitwise the same results.
size_t tb_rows_fwd_scratch_bytes(const TbDims& d, int n);
cudaError_t tb_rows_fwd(const TbDims& d, const float* g1, const float* g2, const float* g3,
                        const int* u_i3, const int* g_i1, const int* g_i2, const int* group_offsets,
                        const int* counts, int n, float* rows, void* scratch, cudaStream_t stream,
                        bool tiles = true, bool fixed_dims = true);

// flowtt_tb_rows_bwd: dg1, dg2, dg3 (the packed cores' shapes), every element written, in
// the contract's summation order (bitwise reproducible). Scratch: about 17 bytes per plan
// entry (radix sorts of the group indices by g_i2 and of the unique indices by u_i3, the
// group of each unique index, then of each sorted one in a free sort buffer) plus the
// bucket bounds of every packed core row, plus one cache buffer of at most 2 GiB (kTbPCacheBytes in
// tb_rows.cu) used twice: first for the dg1 terms E of every group (q1*r1 floats each; when they do
// not all fit, dg1 runs the merge kernel instead), then, for dims of the sorted-tile
// forward, the P cache: P_g (q1*q2*r2 floats) of cap = min(n, 2 GiB / P) groups (2M
// groups of 1 KB) at a time, formed once so that dg3 reads it: dg3 runs in passes of cap
// groups (ceil(n / cap) launches of each kernel, those past num_groups return at once),
// in the same summation order as one pass.
// `stages` (profiling aid for the harness): bits 0, 1, 2 run dg1, dg2, dg3 (a gradient
// whose bit is clear is left unwritten; the dg2 kernel runs for dg1 too, since it writes
// E; the P cache runs with dg3); the sorts and bucket bounds always run. `fixed_dims`: as
// for tb_rows_fwd.
constexpr unsigned kTbAllStages = 0x7;
size_t tb_rows_bwd_scratch_bytes(const TbDims& d, int n);
cudaError_t tb_rows_bwd(const TbDims& d, const float* g1, const float* g2, const float* g3,
                        const float* d_rows, const int* u_i3, const int* g_i1, const int* g_i2,
                        const int* group_offsets, const int* counts, int n, float* dg1, float* dg2,
                        float* dg3, void* scratch, cudaStream_t stream,
                        unsigned stages = kTbAllStages, bool fixed_dims = true);

}  // namespace flowtt::tb
