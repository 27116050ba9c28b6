// On-device plan of a shape group (flowtt_tb_plan), four steps on the caller's stream:
//   1. tb_plan_keys_kernel: keys[i] = the sort key of (tables[i], ids[i]) in the key form
//      the caller chose (cuda/contract/tb_plan_meta.h: prefix keys, or row keys where only those
//      fit 32 bits), positions[i] = i. Keys of at most 32 bits are uint32, else uint64.
//   2. cub radix sort of (keys, positions) on the key bits in use only, stable.
//   3. cub inclusive scan of the (new key, new group) flags, not stored: each sorted
//      position's counts go to the writer, which writes inverse, run and group offsets
//      and counts as flowtt_plan's (and marks the unique keys that start a group).
//   4. finish_kernel over i in [0, n]: each unique key's u_i3 and, where it starts a
//      group, the group's g_i1, g_i2 (TbRowsEmit), 0 past the counts, the offsets' tails.
//   (Steps 2-4: cuda/plan/plan_scan.cuh, shared with flowtt_plan.)
// No device synchronisation, no allocation: scratch comes from the caller.
#include "include/tb_plan.h"

#include <cstdint>

#include "contract/tb_plan_meta.h"
#include "plan/plan_scan.cuh"

namespace flowtt::tb {
namespace {

using plan_scan::kBlock;
using plan_scan::PlanScratch;

// The key form's group test for keys of type K (the scan's functor).
template <typename K>
struct FormGroup {
  TbKeyForm form;
  __host__ __device__ bool operator()(K key, K prev) const { return form.new_group(key, prev); }
};

template <typename K>
__global__ void tb_plan_keys_kernel(const int* __restrict__ ids, const int* __restrict__ tables,
                                    int n, TbKeyForm form, uint64_t max_key, K* __restrict__ keys,
                                    int* __restrict__ positions) {
  const int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i >= n) return;
  keys[i] = static_cast<K>(form.key(tables[i], ids[i], max_key));
  positions[i] = static_cast<int>(i);
}

// The tb plan's own outputs: the writer marks each unique key's u_i3 with the group it
// starts (-1 if none); finish_kernel over [0, n] then looks up the key's rows once (the
// key's table by a binary search of the meta's bases, at full parallelism rather than
// inside the scan) for its u_i3 and, where it starts a group, that group's g_i1, g_i2;
// 0 past the counts.
template <typename K>
struct TbRowsEmit {
  TbKeyForm form;
  const K* sorted_keys;
  int32_t *u_i3, *g_i1, *g_i2;
  __device__ void at(int, int u, int group, bool key_start, bool group_start) const {
    if (key_start) u_i3[u] = group_start ? group : -1;
  }
  __device__ int finish_from(int, int) const { return 0; }
  __device__ void finish(int i, int U, int G, const plan_scan::CommonOut& out) const {
    if (i < U) {
      const int starts = u_i3[i];
      const TbPlanRows r = form.rows(sorted_keys[out.run_offsets[i]]);
      u_i3[i] = r.i3;
      if (starts >= 0) {
        g_i1[starts] = r.i1;
        g_i2[starts] = r.i2;
      }
    } else {
      u_i3[i] = 0;
    }
    if (i >= G) g_i1[i] = g_i2[i] = 0;
  }
};

int end_bit_of(int64_t num_keys) {
  return plan_scan::end_bit_for(static_cast<uint64_t>(num_keys - 1));
}

template <typename K>
cudaError_t run(const int* ids, const int* tables, int n, const TbKeyForm& form, int64_t num_keys,
                const TbPlanOut& out, void* scratch, cudaStream_t stream) {
  const int end_bit = end_bit_of(num_keys);
  PlanScratch<K> s;
  cudaError_t err =
      plan_scan::plan_layout(n, end_bit, FormGroup<K>{form}, TbRowsEmit<K>{}, scratch, &s);
  if (err != cudaSuccess) return err;
  const unsigned blocks = static_cast<unsigned>((n + kBlock - 1) / kBlock);
  tb_plan_keys_kernel<K><<<blocks, kBlock, 0, stream>>>(
      ids, tables, n, form, static_cast<uint64_t>(num_keys - 1), s.keys, s.positions);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return plan_scan::sort_scan_finalize(
      s, n, end_bit, FormGroup<K>{form}, out.perm,
      {out.inverse, out.run_offsets, out.group_offsets, out.counts},
      TbRowsEmit<K>{form, s.sorted_keys, out.u_i3, out.g_i1, out.g_i2}, stream);
}

bool narrow_keys(int64_t num_keys) { return num_keys <= (int64_t{1} << 32); }

template <typename K>
size_t layout_bytes(int n, int64_t num_keys, cudaError_t* err) {
  PlanScratch<K> s;
  *err =
      plan_scan::plan_layout(n, end_bit_of(num_keys), FormGroup<K>{}, TbRowsEmit<K>{}, nullptr, &s);
  return *err == cudaSuccess ? s.bytes : 0;
}

}  // namespace

cudaError_t tb_plan_scratch_bytes(int n, int64_t num_keys, size_t* bytes) {
  *bytes = 0;
  if (n == 0) return cudaSuccess;
  cudaError_t err;
  *bytes = narrow_keys(num_keys) ? layout_bytes<uint32_t>(n, num_keys, &err)
                                 : layout_bytes<uint64_t>(n, num_keys, &err);
  return err;
}

cudaError_t build_tb_plan(const int* ids, const int* tables, int n, const TbKeyForm& form,
                          int64_t num_keys, const TbPlanOut& out, void* scratch,
                          cudaStream_t stream) {
  if (n == 0)
    return plan_scan::write_empty_plan(out.run_offsets, out.group_offsets, out.counts, stream);
  if (narrow_keys(num_keys))
    return run<uint32_t>(ids, tables, n, form, num_keys, out, scratch, stream);
  return run<uint64_t>(ids, tables, n, form, num_keys, out, scratch, stream);
}

}  // namespace flowtt::tb
