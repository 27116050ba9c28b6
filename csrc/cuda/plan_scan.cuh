// The steps the on-device plans share (flowtt_plan in cuda/plan.cu, flowtt_tb_plan in
// cuda/tb_plan.cu): a cub radix sort of (key, position) pairs on the key bits in use
// (stable, so the sorted positions are perm), then one cub inclusive sum of the
// (new key, new prefix group) flags of each sorted position, packed as
// new_key << 32 | new_group in one uint64 (computed on the fly by an iterator; neither
// count can carry into the other, both are <= n < 2^31): scan[s] = (unique index + 1,
// group index + 1), scan[n-1] = (num_unique, num_groups). Whether two keys are in
// different prefix groups comes from a functor (DivNewGroup: key / extent). Scratch comes from the
// caller, carved by plan_layout.
#pragma once

#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>

namespace flowtt::plan_scan {

constexpr int kBlock = 256;
constexpr size_t kAlign = 256;  // cub's temp storage and every scratch array

// Whether sorted keys prev < key are in different prefix groups key / extent (flowtt_plan,
// the prefix keys of flowtt_tb_plan).
template <typename K>
struct DivNewGroup {
  K extent;
  __host__ __device__ bool operator()(K key, K prev) const { return key / extent != prev / extent; }
};

// (new key, new prefix group) at sorted position s of the sorted keys; NewGroup(key, prev)
// says whether two different sorted keys are in different prefix groups.
template <typename K, typename NewGroup>
struct PlanFlags {
  const K* keys;
  NewGroup new_group;
  __host__ __device__ uint64_t operator()(int s) const {  // packed for the scan
    if (s == 0) return (uint64_t(1) << 32) | 1u;
    const K k = keys[s], prev = keys[s - 1];
    if (k == prev) return 0;
    return (uint64_t(1) << 32) | uint64_t(new_group(k, prev) ? 1 : 0);
  }
};

__device__ __forceinline__ int2 unpack(uint64_t v) {
  return make_int2(int(v >> 32), int(v & 0xffffffffu));
}

// The flags of sorted position s from the scan (s's counts against s - 1's): what
// PlanFlags gave there, without the keys.
__device__ __forceinline__ int2 flags_from_scan(const uint64_t* scan, int s, int2 c) {
  if (s == 0) return make_int2(1, 1);
  const int2 p = unpack(scan[s - 1]);
  return make_int2(c.x != p.x, c.y != p.y);
}

// Sorted position i in [0, n] of a plan's finalize: its unique index u and group (i < n),
// whether a unique key / a group starts there (never at i == n), and (num_unique,
// num_groups).
struct FinalizeAt {
  int u, group;
  bool key_start, group_start;
  int2 total;
};

// What every plan's finalize writes at sorted position i in [0, n] (one thread per i, each
// element written once): inverse[perm[i]], run_offsets (a unique key's first position, n
// past num_unique), group_offsets (a group's first unique index, num_unique past
// num_groups) and counts; the op's own outputs are the caller's, from the result.
__device__ __forceinline__ FinalizeAt finalize_common(const uint64_t* __restrict__ scan,
                                                      const int* __restrict__ perm, int n, int i,
                                                      int* inverse, int* run_offsets,
                                                      int* group_offsets, int* counts) {
  FinalizeAt a{0, 0, false, false, unpack(scan[n - 1])};
  if (i < n) {
    const int2 c = unpack(scan[i]);
    const int2 f = flags_from_scan(scan, i, c);
    a = {c.x - 1, c.y - 1, f.x != 0, f.y != 0, a.total};
    inverse[perm[i]] = a.u;
    if (a.key_start) run_offsets[a.u] = i;
    if (a.group_start) group_offsets[a.group] = a.u;
  }
  if (i >= a.total.x) run_offsets[i] = n;
  if (i >= a.total.y) group_offsets[i] = a.total.x;
  if (i == 0) {
    counts[0] = a.total.x;
    counts[1] = a.total.y;
  }
  return a;
}

template <typename K, typename Group>
using FlagIter = thrust::transform_iterator<PlanFlags<K, Group>, thrust::counting_iterator<int>>;

template <typename K, typename Group>
FlagIter<K, Group> flag_iter(const K* sorted_keys, Group group) {
  return FlagIter<K, Group>(thrust::counting_iterator<int>(0),
                            PlanFlags<K, Group>{sorted_keys, group});
}

// Bit length of max_key, at least 1: the radix sort's end_bit.
inline int end_bit_for(uint64_t max_key) {
  int bits = 1;
  while (bits < 64 && (max_key >> bits) != 0) ++bits;
  return bits;
}

inline size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

template <typename K>
struct PlanScratch {
  K* keys;         // [n]
  K* sorted_keys;  // [n]
  int* positions;  // [n] 0..n-1
  uint64_t* scan;  // [n] inclusive (unique, group) counts, packed
  void* cub_tmp;   // shared by the sort and the scan (they run in turn)
  size_t cub_bytes, bytes;
};

// Carves `base` (nullptr: sizes only) into 256-byte aligned arrays; bytes includes the
// slack to align base itself.
template <typename K, typename Group>
cudaError_t plan_layout(int n, int end_bit, Group group, void* base, PlanScratch<K>* s) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cudaError_t err =
      cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const K*)nullptr, (K*)nullptr,
                                      (const int*)nullptr, (int*)nullptr, n, 0, end_bit);
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, flag_iter<K>(nullptr, group),
                                      (uint64_t*)nullptr, n);
  if (err != cudaSuccess) return err;
  char* p = base ? reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(base))) : nullptr;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* r = p ? p + off : nullptr;
    off += align_up(bytes);
    return r;
  };
  s->keys = reinterpret_cast<K*>(take(sizeof(K) * n));
  s->sorted_keys = reinterpret_cast<K*>(take(sizeof(K) * n));
  s->positions = reinterpret_cast<int*>(take(sizeof(int) * n));
  s->scan = reinterpret_cast<uint64_t*>(take(sizeof(uint64_t) * n));
  s->cub_bytes = std::max(sort_bytes, scan_bytes);
  s->cub_tmp = take(s->cub_bytes);
  s->bytes = off + kAlign - 1;
  return cudaSuccess;
}

// The sort (s.keys, s.positions -> s.sorted_keys, perm) and the scan of its flags into
// s.scan, on `stream`.
template <typename K, typename Group>
cudaError_t sort_and_scan(const PlanScratch<K>& s, int n, int end_bit, Group group, int* perm,
                          cudaStream_t stream) {
  size_t bytes = s.cub_bytes;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(s.cub_tmp, bytes, s.keys, s.sorted_keys,
                                                    s.positions, perm, n, 0, end_bit, stream);
  if (err != cudaSuccess) return err;
  bytes = s.cub_bytes;
  return cub::DeviceScan::InclusiveSum(s.cub_tmp, bytes, flag_iter<K>(s.sorted_keys, group), s.scan,
                                       n, stream);
}

// The plan of no positions: run_offsets = group_offsets = [0], counts = (0, 0).
inline cudaError_t write_empty_plan(int* run_offsets, int* group_offsets, int* counts,
                                    cudaStream_t stream) {
  cudaError_t err;
  if ((err = cudaMemsetAsync(run_offsets, 0, sizeof(int), stream)) != cudaSuccess ||
      (err = cudaMemsetAsync(group_offsets, 0, sizeof(int), stream)) != cudaSuccess)
    return err;
  return cudaMemsetAsync(counts, 0, 2 * sizeof(int), stream);
}

}  // namespace flowtt::plan_scan
