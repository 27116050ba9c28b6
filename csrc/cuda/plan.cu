// On-device FlowTT plan (flowtt_plan), four steps on the caller's stream:
//   1. clamp_kernel: keys[i] = clamp(ids[i], 0, num_rows - 1), positions[i] = i.
//   2. cub radix sort of (keys, positions) on bits [0, bit length of
//      num_rows - 1) only: 10^7 rows -> 24 bits -> 3 onesweep passes of 8 bits
//      on sm_90 (plus cub's histogram and memsets). Radix sort is stable, so
//      the sorted positions are perm, as jax.lax.sort(is_stable=True) gives.
//   3. cub single-pass inclusive sum of the (new id, new prefix group) flags
//      of each sorted position, packed as new_id << 32 | new_group in one
//      uint64 (computed on the fly by an iterator; neither count can carry
//      into the other, both are <= n < 2^31): scan[s] = (unique index + 1,
//      group index + 1), scan[n-1] = (num_unique, num_groups).
//   4. finalize_kernel over i in [0, n]: every output element written once
//      (scatters at run / group starts, padding tails, counts).
// No device synchronisation, no allocation: scratch comes from the caller.
#include "cuda/plan.h"

#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>

namespace flowtt {
namespace {

constexpr int kBlock = 256;
constexpr size_t kAlign = 256;  // cub's temp storage and every scratch array

// (new unique id, new prefix group) at sorted position s of the sorted keys.
struct PlanFlags {
  const int* keys;
  int last_extent;
  __host__ __device__ int2 flags(int s) const {
    if (s == 0) return make_int2(1, 1);
    const int k = keys[s], prev = keys[s - 1];
    const int new_id = k != prev;
    return make_int2(new_id, new_id && k / last_extent != prev / last_extent);
  }
  __host__ __device__ uint64_t operator()(int s) const {  // packed for the scan
    const int2 f = flags(s);
    return (uint64_t(f.x) << 32) | uint64_t(f.y);
  }
};

using FlagIter = thrust::transform_iterator<PlanFlags, thrust::counting_iterator<int>>;

FlagIter flag_iter(const int* sorted_keys, int last_extent) {
  return FlagIter(thrust::counting_iterator<int>(0), PlanFlags{sorted_keys, last_extent});
}

__device__ __forceinline__ int2 unpack(uint64_t v) {
  return make_int2(int(v >> 32), int(v & 0xffffffffu));
}

// Bit length of max_key >= 0, at least 1: the radix sort's end_bit.
int end_bit_for(int max_key) {
  int bits = 1;
  while (bits < 31 && (1 << bits) <= max_key) ++bits;
  return bits;
}

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct PlanScratch {
  int* keys;         // [n] clamped ids
  int* sorted_keys;  // [n]
  int* positions;    // [n] 0..n-1
  uint64_t* scan;    // [n] inclusive (unique, group) counts, packed
  void* cub_tmp;     // shared by the sort and the scan (they run in turn)
  size_t cub_bytes, bytes;
};

// Carves `base` (nullptr: sizes only) into 256-byte aligned arrays; bytes
// includes the slack to align base itself.
cudaError_t plan_layout(int n, int end_bit, void* base, PlanScratch* s) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cudaError_t err =
      cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const int*)nullptr, (int*)nullptr,
                                      (const int*)nullptr, (int*)nullptr, n, 0, end_bit);
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, flag_iter(nullptr, 1),
                                      (uint64_t*)nullptr, n);
  if (err != cudaSuccess) return err;
  char* p = base ? reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(base))) : nullptr;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* r = p ? p + off : nullptr;
    off += align_up(bytes);
    return r;
  };
  s->keys = reinterpret_cast<int*>(take(sizeof(int) * n));
  s->sorted_keys = reinterpret_cast<int*>(take(sizeof(int) * n));
  s->positions = reinterpret_cast<int*>(take(sizeof(int) * n));
  s->scan = reinterpret_cast<uint64_t*>(take(sizeof(uint64_t) * n));
  s->cub_bytes = std::max(sort_bytes, scan_bytes);
  s->cub_tmp = take(s->cub_bytes);
  s->bytes = off + kAlign - 1;
  return cudaSuccess;
}

__global__ void clamp_kernel(const int* __restrict__ ids, int n, int max_id, int* __restrict__ keys,
                             int* __restrict__ positions) {
  const int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i >= n) return;
  keys[i] = min(max(ids[i], 0), max_id);
  positions[i] = static_cast<int>(i);
}

// One thread per i in [0, n]; sorted_keys, perm, scan are [n].
__global__ void finalize_kernel(const int* __restrict__ sorted_keys, const int* __restrict__ perm,
                                const uint64_t* __restrict__ scan, int n, int last_extent,
                                PlanOutputs out) {
  const int64_t i64 = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i64 > n) return;
  const int i = static_cast<int>(i64);
  const int2 total = unpack(scan[n - 1]);  // (num_unique, num_groups)
  if (i < n) {
    const int2 c = unpack(scan[i]);
    const int2 f = PlanFlags{sorted_keys, last_extent}.flags(i);
    const int u = c.x - 1;
    out.inverse[perm[i]] = u;
    if (f.x) {
      out.run_offsets[u] = i;
      out.unique_ids[u] = sorted_keys[i];
    }
    if (f.y) out.group_offsets[c.y - 1] = u;
    if (i >= total.x) out.unique_ids[i] = 0;
  }
  if (i >= total.x) out.run_offsets[i] = n;
  if (i >= total.y) out.group_offsets[i] = total.x;
  if (i == 0) {
    out.counts[0] = total.x;
    out.counts[1] = total.y;
  }
}

}  // namespace

cudaError_t plan_scratch_bytes(int n, int num_rows, size_t* bytes) {
  *bytes = 0;
  if (n == 0) return cudaSuccess;
  PlanScratch s;
  cudaError_t err = plan_layout(n, end_bit_for(num_rows - 1), nullptr, &s);
  if (err == cudaSuccess) *bytes = s.bytes;
  return err;
}

cudaError_t build_plan(const int* ids, int n, int last_extent, int num_rows, const PlanOutputs& out,
                       void* scratch, cudaStream_t stream) {
  cudaError_t err;
  if (n == 0) {  // no ids: run_offsets = group_offsets = [0], counts = (0, 0)
    if ((err = cudaMemsetAsync(out.run_offsets, 0, sizeof(int), stream)) != cudaSuccess ||
        (err = cudaMemsetAsync(out.group_offsets, 0, sizeof(int), stream)) != cudaSuccess)
      return err;
    return cudaMemsetAsync(out.counts, 0, 2 * sizeof(int), stream);
  }
  const int end_bit = end_bit_for(num_rows - 1);
  PlanScratch s;
  if ((err = plan_layout(n, end_bit, scratch, &s)) != cudaSuccess) return err;
  const unsigned blocks = static_cast<unsigned>(n / kBlock + 1);  // threads cover [0, n]
  clamp_kernel<<<blocks, kBlock, 0, stream>>>(ids, n, num_rows - 1, s.keys, s.positions);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  size_t bytes = s.cub_bytes;
  if ((err = cub::DeviceRadixSort::SortPairs(s.cub_tmp, bytes, s.keys, s.sorted_keys, s.positions,
                                             out.perm, n, 0, end_bit, stream)) != cudaSuccess)
    return err;
  bytes = s.cub_bytes;
  if ((err = cub::DeviceScan::InclusiveSum(s.cub_tmp, bytes, flag_iter(s.sorted_keys, last_extent),
                                           s.scan, n, stream)) != cudaSuccess)
    return err;
  finalize_kernel<<<blocks, kBlock, 0, stream>>>(s.sorted_keys, out.perm, s.scan, n, last_extent,
                                                 out);
  return cudaGetLastError();
}

}  // namespace flowtt
