// On-device FlowTT plan (flowtt_plan), four steps on the caller's stream:
//   1. clamp_kernel: keys[i] = clamp(ids[i], 0, num_rows - 1), positions[i] = i.
//   2. cub radix sort of (keys, positions) on bits [0, bit length of
//      num_rows - 1) only: 10^7 rows -> 24 bits -> 3 onesweep passes of 8 bits
//      on sm_90 (plus cub's histogram and memsets). Radix sort is stable, so
//      the sorted positions are perm, as jax.lax.sort(is_stable=True) gives.
//   3. cub single-pass inclusive scan of the (new id, new prefix group) flags, not stored:
//      each sorted position's counts go to the writer, which writes every output element
//      of that position once (the shared ones, then the unique id at a run start).
//   4. the padding tails past the counts (the unique ids': 0).
//   (Steps 2-4: cuda/plan_scan.cuh, shared with flowtt_tb_plan.)
// No device synchronisation, no allocation: scratch comes from the caller.
#include "cuda/plan.h"

#include <cstdint>

#include "cuda/plan_scan.cuh"

namespace flowtt {
namespace {

using plan_scan::kBlock;
using Group = plan_scan::DivNewGroup<int>;
using PlanScratch = plan_scan::PlanScratch<int>;

__global__ void clamp_kernel(const int* __restrict__ ids, int n, int max_id, int* __restrict__ keys,
                             int* __restrict__ positions) {
  const int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i >= n) return;
  keys[i] = min(max(ids[i], 0), max_id);
  positions[i] = static_cast<int>(i);
}

// The unique ids: at a run start (the writer), then 0 past num_unique (finish_kernel).
struct UniqueIds {
  const int* sorted_keys;
  int* unique_ids;
  __device__ void at(int s, int u, int, bool key_start, bool) const {
    if (key_start) unique_ids[u] = sorted_keys[s];
  }
  __device__ int finish_from(int U, int G) const { return min(U, G); }
  __device__ void finish(int i, int U, int, const plan_scan::CommonOut&) const {
    if (i >= U) unique_ids[i] = 0;
  }
};

plan_scan::CommonOut common_out(const PlanOutputs& out) {
  return {out.inverse, out.run_offsets, out.group_offsets, out.counts};
}

}  // namespace

cudaError_t plan_scratch_bytes(int n, int num_rows, size_t* bytes) {
  *bytes = 0;
  if (n == 0) return cudaSuccess;
  PlanScratch s;
  cudaError_t err = plan_scan::plan_layout(n, plan_scan::end_bit_for(num_rows - 1), Group{1},
                                           UniqueIds{}, nullptr, &s);
  if (err == cudaSuccess) *bytes = s.bytes;
  return err;
}

cudaError_t build_plan(const int* ids, int n, int last_extent, int num_rows, const PlanOutputs& out,
                       void* scratch, cudaStream_t stream) {
  if (n == 0)
    return plan_scan::write_empty_plan(out.run_offsets, out.group_offsets, out.counts, stream);
  cudaError_t err;
  const int end_bit = plan_scan::end_bit_for(num_rows - 1);
  PlanScratch s;
  if ((err = plan_scan::plan_layout(n, end_bit, Group{last_extent}, UniqueIds{}, scratch, &s)) !=
      cudaSuccess)
    return err;
  const unsigned blocks = static_cast<unsigned>((n + kBlock - 1) / kBlock);
  clamp_kernel<<<blocks, kBlock, 0, stream>>>(ids, n, num_rows - 1, s.keys, s.positions);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return plan_scan::sort_scan_finalize(s, n, end_bit, Group{last_extent}, out.perm, common_out(out),
                                       UniqueIds{s.sorted_keys, out.unique_ids}, stream);
}

}  // namespace flowtt
