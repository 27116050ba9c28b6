// The steps the on-device plans share (flowtt_plan in cuda/plan/plan.cu, flowtt_tb_plan in
// cuda/plan/tb_plan.cu): a cub radix sort of (key, position) pairs on the key bits in use
// (stable, so the sorted positions are perm), then one cub inclusive sum of the
// (new key, new prefix group) flags of each sorted position (computed on the fly by an
// iterator), with the flags themselves carried along (PlanCounts: both counts and the
// position's own flags in one uint64). The scan is not stored: its output iterator
// (thrust's tabulate_output_iterator) hands each position's (unique index + 1, group
// index + 1, flags) to the plan's writer (FinalizeWriter), which writes that position's
// outputs at once; a last kernel (finish_kernel) writes the padding tails past
// (num_unique, num_groups) and what the plan looks up per unique key or group. Whether
// two keys are in different prefix groups comes from a functor (DivNewGroup: key /
// extent). Scratch comes from the caller, carved by plan_layout.
#pragma once

#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>

#include "common/common.cuh"  // num_sms

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

// A sorted position's scan element: bits [33, 64) and [2, 33) count new keys and new
// groups (each <= n < 2^31, so neither carries into the next), bits 1 and 0 are the last
// position's own (new key, new group) flags. PlanCounts (a + b: the counts added, b's
// flags) is associative.
struct PlanCounts {
  __host__ __device__ uint64_t operator()(uint64_t a, uint64_t b) const {
    return ((a & ~uint64_t{3}) + (b & ~uint64_t{3})) | (b & 3u);
  }
};
constexpr uint64_t kNewKey = (uint64_t{1} << 33) | 2u, kNewGroup = (uint64_t{1} << 2) | 1u;

// The scan element at sorted position s of the sorted keys; NewGroup(key, prev) says
// whether two different sorted keys are in different prefix groups.
template <typename K, typename NewGroup>
struct PlanFlags {
  const K* keys;
  NewGroup new_group;
  __host__ __device__ uint64_t operator()(int s) const {
    if (s == 0) return kNewKey | kNewGroup;
    const K k = keys[s], prev = keys[s - 1];
    if (k == prev) return 0;
    return kNewKey | (new_group(k, prev) ? kNewGroup : 0);
  }
};

// The outputs every plan shares.
struct CommonOut {
  int* inverse;        // [n]   position -> unique index
  int* run_offsets;    // [n+1] each unique key's first sorted position, then n
  int* group_offsets;  // [n+1] each group's first unique index, then num_unique
  int* counts;         // [2]   (num_unique, num_groups)
};

// The scan's output functor (n: the positions): at sorted position s with scan element
// c, writes inverse[perm[s]], a unique key's run offset and a group's first unique index
// where they start there, the plan's own (Emit::at(s, u, group, key_start, group_start))
// and, at the last position, counts. Every element below the counts is written once.
template <typename Emit>
struct FinalizeWriter {
  const int* perm;
  int n;
  CommonOut out;
  Emit emit;
  __device__ void operator()(ptrdiff_t s64, uint64_t c) const {
    const int s = static_cast<int>(s64);
    const int u = static_cast<int>(c >> 33) - 1;
    const int group = static_cast<int>((c >> 2) & 0x7fffffffu) - 1;
    const bool key_start = (c & 2u) != 0, group_start = (c & 1u) != 0;
    out.inverse[perm[s]] = u;
    if (key_start) out.run_offsets[u] = s;
    if (group_start) out.group_offsets[group] = u;
    emit.at(s, u, group, key_start, group_start);
    if (s == n - 1) {
      out.counts[0] = u + 1;
      out.counts[1] = group + 1;
    }
  }
};

// Over i in [Emit::finish_from(U, G), n] (grid-stride; U, G: the counts from the writer):
// run_offsets[i] = n past num_unique, group_offsets[i] = num_unique past num_groups, and
// the plan's own (Emit::finish(i, U, G, out), i < n).
template <typename Emit>
__global__ void finish_kernel(CommonOut out, int n, Emit emit) {
  const int U = out.counts[0], G = out.counts[1];
  for (int64_t i = emit.finish_from(U, G) + int64_t(blockIdx.x) * kBlock + threadIdx.x; i <= n;
       i += int64_t(gridDim.x) * kBlock) {
    if (i >= U) out.run_offsets[i] = n;
    if (i >= G) out.group_offsets[i] = U;
    if (i < n) emit.finish(static_cast<int>(i), U, G, out);
  }
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
  void* cub_tmp;   // shared by the sort and the scan (they run in turn)
  size_t cub_bytes, bytes;
};

// The scan of the flags of the sorted keys [w.n] into the writer (tmp null: its bytes only).
template <typename K, typename Group, typename Emit>
cudaError_t flag_scan(void* tmp, size_t& bytes, const K* sorted_keys, Group group,
                      const FinalizeWriter<Emit>& w, cudaStream_t stream) {
  return cub::DeviceScan::InclusiveScan(tmp, bytes, flag_iter<K>(sorted_keys, group),
                                        thrust::tabulate_output_iterator<FinalizeWriter<Emit>>(w),
                                        PlanCounts{}, w.n, stream);
}

// Carves `base` (nullptr: sizes only) into 256-byte aligned arrays; bytes includes the
// slack to align base itself.
template <typename K, typename Group, typename Emit>
cudaError_t plan_layout(int n, int end_bit, Group group, Emit emit, void* base, PlanScratch<K>* s) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cudaError_t err =
      cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const K*)nullptr, (K*)nullptr,
                                      (const int*)nullptr, (int*)nullptr, n, 0, end_bit);
  if (err != cudaSuccess) return err;
  err = flag_scan(nullptr, scan_bytes, (const K*)nullptr, group,
                  FinalizeWriter<Emit>{nullptr, n, {}, emit}, nullptr);
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
  s->cub_bytes = std::max(sort_bytes, scan_bytes);
  s->cub_tmp = take(s->cub_bytes);
  s->bytes = off + kAlign - 1;
  return cudaSuccess;
}

// The sort (s.keys, s.positions -> s.sorted_keys, out's perm), the scan of its flags into
// the writer, then finish_kernel, on `stream` (n >= 1).
template <typename K, typename Group, typename Emit>
cudaError_t sort_scan_finalize(const PlanScratch<K>& s, int n, int end_bit, Group group, int* perm,
                               const CommonOut& out, Emit emit, cudaStream_t stream) {
  size_t bytes = s.cub_bytes;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(s.cub_tmp, bytes, s.keys, s.sorted_keys,
                                                    s.positions, perm, n, 0, end_bit, stream);
  if (err != cudaSuccess) return err;
  bytes = s.cub_bytes;
  err = flag_scan(s.cub_tmp, bytes, (const K*)s.sorted_keys, group,
                  FinalizeWriter<Emit>{perm, n, out, emit}, stream);
  if (err != cudaSuccess) return err;
  const int blocks =
      static_cast<int>(std::min<int64_t>(int64_t(n) / kBlock + 1, int64_t(num_sms()) * 8));
  finish_kernel<<<blocks, kBlock, 0, stream>>>(out, n, emit);
  return cudaGetLastError();
}

// The plan of no positions: run_offsets (null: none) = group_offsets = [0], counts = (0, 0).
inline cudaError_t write_empty_plan(int* run_offsets, int* group_offsets, int* counts,
                                    cudaStream_t stream) {
  cudaError_t err;
  if ((run_offsets &&
       (err = cudaMemsetAsync(run_offsets, 0, sizeof(int), stream)) != cudaSuccess) ||
      (err = cudaMemsetAsync(group_offsets, 0, sizeof(int), stream)) != cudaSuccess)
    return err;
  return cudaMemsetAsync(counts, 0, 2 * sizeof(int), stream);
}

}  // namespace flowtt::plan_scan
