// The stages of the CUDA ops, each a launcher (host) in the file of its kernels; the
// ops (cuda/single/ops.cu) queue them on the caller's stream. Every launcher returns the
// launch's status and never synchronises.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/common.cuh"
#include "single/scratch.h"

namespace flowtt {

// ---- cuda/single/prefix_map.cu ----
// map[i1*p2 + i2] = 1 + the prefix group of (i1, i2) (map: p1*p2 ints, zeroed by the
// caller; 0 stays where the plan has no group; read by map_group).
cudaError_t launch_build_map(const Dev& d, const int* unique_ids, const int* group_offsets,
                             const int* counts, int n, int* map, cudaStream_t stream);

// ---- cuda/single/rows_fwd.cu ----
// Shared memory of the forward warp kernel.
size_t fwd_smem(const Dev& d);
// Rows of the unique range [lo, lo + range) into rows[u - lo] (after
// launch_build_map), with pass p's counters and flags: one launch.
cudaError_t launch_rows_fwd_range(const Dev& d, const float* g1, const float* g2, const float* g3,
                                  const int* unique_ids, const int* group_offsets,
                                  const int* counts, int n, int lo, int range, const FwdScratch& s,
                                  int p, float* rows, cudaStream_t stream);

// ---- cuda/single/rows_bwd.cu ----
// Shared memory of the backward warp tile kernel.
size_t bwd_smem(const Dev& d);
// Groups per batch of the backward GEMM tile kernel, 0 when it does not take these
// dims (then the warp tile kernel runs and the dG3 pass is not blocked).
int gemm_bwd_batch_groups(const Dev& d);
// Tile kernel: P of every group (s.Pbuf), its dG1 partial (s.dG1p), and dg2: each
// tile's dG2 partial added in its column's turn (s.col_turn(), zeroed), i1 blocks in order.
cudaError_t launch_rows_bwd_tiles(const Dev& d, const float* g1, const float* g2, const float* g3,
                                  const float* d_rows, const int* unique_ids,
                                  const int* group_offsets, const int* counts, int n, float* dg2,
                                  const BwdScratch& s, cudaStream_t stream);
// dG1[i1] = sum of the group partials of i1, i2 ascending.
cudaError_t launch_dg1_reduce(const Dev& d, const BwdScratch& s, const int* counts, int n,
                              float* dg1, cudaStream_t stream);

// ---- cuda/single/dg3.cu ----
// cub's temporary storage for the i3 sort of n unique ids.
size_t dg3_sort_bytes(int n);
// Sort keys (i3) and values (u) of the unique ids, and each one's group (s.ug).
cudaError_t launch_dg3_keys(const Dev& d, const int* unique_ids, const int* counts, int n,
                            const BwdScratch& s, cudaStream_t stream);
// Stable radix sort of the keys (cub).
cudaError_t launch_dg3_sort(const Dev& d, int n, const BwdScratch& s, cudaStream_t stream);
// dG3 from the sorted ids: bucket bounds, per (i3, part) partials, parts summed in order.
cudaError_t launch_dg3(const Dev& d, const float* d_rows, int n, const BwdScratch& s, float* dg3,
                       cudaStream_t stream);

// ---- cuda/single/pool.cu ----
// Pooling of the unique rows [lo, hi) (hi capped at num_unique when counts is given)
// held in rows[idx - lo]; accumulate: add to out (later chunks of flowtt_bag_fwd);
// batch: the output layout (cuda/contract/pool_layout.h).
cudaError_t launch_pool_fwd(const float* rows, const int* inverse, const float* weights,
                            const int* bag_offsets, int n, int B, int D, int lo, int hi,
                            const int* counts, bool accumulate, int batch, float* out,
                            cudaStream_t stream);

}  // namespace flowtt
