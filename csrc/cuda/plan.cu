// On-device FlowTT plan (flowtt_plan), four steps on the caller's stream:
//   1. clamp_kernel: keys[i] = clamp(ids[i], 0, num_rows - 1), positions[i] = i.
//   2. cub radix sort of (keys, positions) on bits [0, bit length of
//      num_rows - 1) only: 10^7 rows -> 24 bits -> 3 onesweep passes of 8 bits
//      on sm_90 (plus cub's histogram and memsets). Radix sort is stable, so
//      the sorted positions are perm, as jax.lax.sort(is_stable=True) gives.
//   3. cub single-pass inclusive sum of the (new id, new prefix group) flags
//      (steps 2 and 3: cuda/plan_scan.cuh, shared with flowtt_tb_plan).
//   4. finalize_kernel over i in [0, n] (the flags from the scan): every output element
//      written once (plan_scan::finalize_common, shared with flowtt_tb_plan, then the
//      unique ids at run starts and their padding tail).
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

// One thread per i in [0, n]; sorted_keys, perm, scan are [n].
__global__ void finalize_kernel(const int* __restrict__ sorted_keys, const int* __restrict__ perm,
                                const uint64_t* __restrict__ scan, int n, PlanOutputs out) {
  const int64_t i64 = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i64 > n) return;
  const int i = static_cast<int>(i64);
  const plan_scan::FinalizeAt a = plan_scan::finalize_common(
      scan, perm, n, i, out.inverse, out.run_offsets, out.group_offsets, out.counts);
  if (a.key_start) out.unique_ids[a.u] = sorted_keys[i];
  if (i < n && i >= a.total.x) out.unique_ids[i] = 0;
}

}  // namespace

cudaError_t plan_scratch_bytes(int n, int num_rows, size_t* bytes) {
  *bytes = 0;
  if (n == 0) return cudaSuccess;
  PlanScratch s;
  cudaError_t err =
      plan_scan::plan_layout(n, plan_scan::end_bit_for(num_rows - 1), Group{1}, nullptr, &s);
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
  if ((err = plan_scan::plan_layout(n, end_bit, Group{last_extent}, scratch, &s)) != cudaSuccess)
    return err;
  const unsigned blocks = static_cast<unsigned>(n / kBlock + 1);  // threads cover [0, n]
  clamp_kernel<<<blocks, kBlock, 0, stream>>>(ids, n, num_rows - 1, s.keys, s.positions);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = plan_scan::sort_and_scan(s, n, end_bit, Group{last_extent}, out.perm, stream)) !=
      cudaSuccess)
    return err;
  finalize_kernel<<<blocks, kBlock, 0, stream>>>(s.sorted_keys, out.perm, s.scan, n, out);
  return cudaGetLastError();
}

}  // namespace flowtt
