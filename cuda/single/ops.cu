// The CUDA ops of cuda/include/ops.h (the pooling ops are in cuda/single/pool.cu): each queues its
// stages (cuda/single/stages.h) on the caller's stream, in the caller's scratch
// (cuda/single/scratch.h). docs/kernels.md describes the stages.
#include "include/ops.h"

#include <cuda_runtime.h>

#include "common/common.cuh"
#include "single/scratch.h"
#include "single/stages.h"

namespace flowtt {
namespace {

// The prefix map and the zeroed work counters of every pass, for the forward passes (map
// and counters are adjacent: one memset).
cudaError_t prepare_fwd(const Dev& d, const int* unique_ids, const int* group_offsets,
                        const int* counts, int n, const FwdScratch& s, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(s.map, 0, s.zeroed_bytes(), stream);
  if (err != cudaSuccess) return err;
  return launch_build_map(d, unique_ids, group_offsets, counts, n, s.map, stream);
}

// Whether rows_bwd runs backward stage `bit` (FLOWTT_STAGE_MASK, cuda/include/ops.h).
constexpr bool run_stage(int bit) { return (FLOWTT_STAGE_MASK & bit) != 0; }

}  // namespace

const char* check_dims(const TTDims& t) {
  if (t.p1 <= 0 || t.p2 <= 0 || t.p3 <= 0 || t.q1 <= 0 || t.q2 <= 0 || t.q3 <= 0 || t.r1 <= 0 ||
      t.r2 <= 0)
    return "flowtt CUDA: core dimensions must be positive";
  if ((long long)t.p1 * t.p2 > (1LL << 26))
    return "flowtt CUDA: p1*p2 too large for the dense prefix map (max 2^26)";
  if (t.p2 > 65535) return "flowtt CUDA: p2 > 65535 unsupported";
  if (t.q1 > kQ1Max || t.q1 * t.q2 > kMMax || t.q3 > kQ3Max || t.r2 > 32 * kBB || t.r1 > kAMax)
    return "flowtt CUDA: unsupported core shape (need q1<=8, q1*q2<=16, "
           "q3<=8, r1<=64, r2<=64); use impl='reference'";
  const Dev d = make_dev(t);
  if (bwd_smem(d) > 200 * 1024 || fwd_smem(d) > 200 * 1024)
    return "flowtt CUDA: cores too large for the shared-memory kernels "
           "(r1*q2*r2 must be <= ~24k); use impl='reference'";
  return nullptr;
}

cudaError_t rows_fwd(const TTDims& t, const float* g1, const float* g2, const float* g3,
                     const int* unique_ids, const int* group_offsets, const int* counts, int n,
                     float* rows, void* scratch, cudaStream_t stream) {
  const Dev d = make_dev(t);
  const FwdScratch s = fwd_layout(d, n, 1, 0, scratch);
  cudaError_t err = prepare_fwd(d, unique_ids, group_offsets, counts, n, s, stream);
  if (err != cudaSuccess) return err;
  return launch_rows_fwd_range(d, g1, g2, g3, unique_ids, group_offsets, counts, n, 0, n, s, 0,
                               rows, stream);
}

cudaError_t bag_fwd(const TTDims& t, const float* g1, const float* g2, const float* g3,
                    const int* unique_ids, const int* group_offsets, const int* counts,
                    const int* inverse, const float* weights, const int* bag_offsets, int n, int B,
                    long long chunk_rows, float* out, void* scratch, cudaStream_t stream) {
  if (B <= 0) return cudaSuccess;
  const Dev d = make_dev(t);
  const int C = bag_chunk(n, chunk_rows);
  const FwdScratch s = fwd_layout(d, C, (n + C - 1) / C, C, scratch);
  cudaError_t err = prepare_fwd(d, unique_ids, group_offsets, counts, n, s, stream);
  if (err != cudaSuccess) return err;
  // static chunk count (U <= n is on the device): chunks past U exit at once
  for (int lo = 0; lo < n; lo += C) {
    if ((err = launch_rows_fwd_range(d, g1, g2, g3, unique_ids, group_offsets, counts, n, lo, C, s,
                                     lo / C, s.rows, stream)) != cudaSuccess)
      return err;
    if ((err = launch_pool_fwd(s.rows, inverse, weights, bag_offsets, n, B, d.D, lo, lo + C, counts,
                               lo > 0, 0, out, stream)) != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

cudaError_t rows_bwd(const TTDims& t, const float* g1, const float* g2, const float* g3,
                     const float* d_rows, const int* unique_ids, const int* group_offsets,
                     const int* counts, int n, float* dg1, float* dg2, float* dg3, void* scratch,
                     cudaStream_t stream) {
  const Dev d = make_dev(t);
  const BwdScratch s = bwd_layout(d, n, scratch);
  cudaError_t err;
  if ((err = cudaMemsetAsync(s.map, 0, s.zeroed_bytes(d), stream)) != cudaSuccess) return err;
  if ((err = launch_build_map(d, unique_ids, group_offsets, counts, n, s.map, stream)) !=
      cudaSuccess)
    return err;
  if (!run_stage(1)) return cudaGetLastError();
  if ((err = launch_rows_bwd_tiles(d, g1, g2, g3, d_rows, unique_ids, group_offsets, counts, n, dg2,
                                   s, stream)) != cudaSuccess)
    return err;
  if (!run_stage(2)) return cudaGetLastError();
  if ((err = launch_dg1_reduce(d, s, counts, n, dg1, stream)) != cudaSuccess) return err;
  if (!run_stage(4)) return cudaGetLastError();
  if ((err = launch_dg3_keys(d, unique_ids, counts, n, s, stream)) != cudaSuccess) return err;
  if (!run_stage(8)) return cudaGetLastError();
  if ((err = launch_dg3_sort(d, n, s, stream)) != cudaSuccess) return err;
  if (!run_stage(16)) return cudaGetLastError();
  return launch_dg3(d, d_rows, n, s, dg3, stream);
}

}  // namespace flowtt
