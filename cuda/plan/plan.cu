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
//   (Steps 2-4: cuda/plan/plan_scan.cuh, shared with flowtt_tb_plan.)
// The forward-only plan (no perm, no run_offsets) needs no sort where the table's bitmap
// is small against the ids (cuda/contract/plan_bitmap.h): memset of the bitmap,
// bitmap_mark_kernel (an atomicOr per id whose bit is not set yet), one cub exclusive scan
// of the words' Spans into WordWriter (each word's unique ids, group starts and unique
// index), bitmap_rank_kernel (inverse and the tails). Otherwise it runs the steps above
// with perm and run_offsets in scratch.
// No device synchronisation, no allocation: scratch comes from the caller.
#include "include/plan.h"

#include <cstdint>

#include "contract/plan_bitmap.h"
#include "plan/plan_scan.cuh"
#include "single/scratch.h"  // Bump

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

// Scratch of the sort's plan: PlanScratch, and perm and run_offsets where the caller
// asked for the forward-only plan (sized for n ids; base null: sizes only).
struct SortedScratch {
  PlanScratch plan;
  int* perm;         // [n] or null
  int* run_offsets;  // [n + 1] or null
  size_t bytes;
};

// The caller's scratch realigned to 256 bytes (null: sizes only).
char* aligned_base(void* base) {
  return base ? reinterpret_cast<char*>(plan_scan::align_up(reinterpret_cast<uintptr_t>(base)))
              : nullptr;
}

cudaError_t sorted_layout(int n, int num_rows, bool forward_only, void* base, SortedScratch* s) {
  Bump bp{aligned_base(base)};
  s->perm = forward_only ? bp.take<int>(n) : nullptr;
  s->run_offsets = forward_only ? bp.take<int>(n + size_t{1}) : nullptr;
  cudaError_t err = plan_scan::plan_layout(n, plan_scan::end_bit_for(num_rows - 1), Group{1},
                                           UniqueIds{}, bp.take<char>(0) /* the rest */, &s->plan);
  s->bytes = plan_scan::kAlign - 1 + bp.off + s->plan.bytes;
  return err;
}

cudaError_t build_sorted_plan(const int* ids, int n, int last_extent, int num_rows, PlanOutputs out,
                              void* scratch, cudaStream_t stream) {
  SortedScratch s;
  cudaError_t err = sorted_layout(n, num_rows, out.perm == nullptr, scratch, &s);
  if (err != cudaSuccess) return err;
  if (out.perm == nullptr) {
    out.perm = s.perm;
    out.run_offsets = s.run_offsets;
  }
  const unsigned blocks = static_cast<unsigned>((n + kBlock - 1) / kBlock);
  clamp_kernel<<<blocks, kBlock, 0, stream>>>(ids, n, num_rows - 1, s.plan.keys, s.plan.positions);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return plan_scan::sort_scan_finalize(s.plan, n, plan_scan::end_bit_for(num_rows - 1),
                                       Group{last_extent}, out.perm, common_out(out),
                                       UniqueIds{s.plan.sorted_keys, out.unique_ids}, stream);
}

// ---- The forward-only plan by the bitmap of the table's rows (plan_bitmap::Applies).

namespace pb = plan_bitmap;

__global__ void bitmap_mark_kernel(const int* __restrict__ ids, int n, int max_id,
                                   uint32_t* __restrict__ bitmap) {
  const int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i >= n) return;
  const int id = min(max(ids[i], 0), max_id);
  const uint32_t bit = 1u << (id & 31);
  uint32_t* word = bitmap + (id >> 5);
  // Atomics on one address serialise in L2 (D128 B65536's hottest id: ~45k occurrences), so
  // an id whose bit is already set (every occurrence of a hot id but the first few) only
  // reads it; a stale 0 costs one more atomicOr, never a lost bit.
  if ((__ldcg(word) & bit) == 0) atomicOr(word, bit);
}

// The scan's input: word w's Span.
struct WordSpanOf {
  const uint32_t* bitmap;
  int last_extent;
  __host__ __device__ pb::Span operator()(int64_t w) const {
    return pb::WordSpan(bitmap[w], w, last_extent);
  }
};

struct JoinSpans {
  __host__ __device__ pb::Span operator()(const pb::Span& a, const pb::Span& b) const {
    return pb::Join(a, b);
  }
};

// The scan's output functor: word w after the words before it (`before`, their Span)
// writes its unique index, its unique ids and group starts, and (the last word) counts.
struct WordWriter {
  const uint32_t* bitmap;
  int64_t words;
  int last_extent;
  int* word_rank;
  PlanOutputs out;
  __device__ void operator()(ptrdiff_t w, const pb::Span& before) const {
    const uint32_t bits = bitmap[w];
    word_rank[w] = before.u;
    pb::EmitWord(bits, w, last_extent, before, out.unique_ids, out.group_offsets);
    if (w == words - 1) {
      const pb::Span all = pb::Join(before, pb::WordSpan(bits, w, last_extent));
      out.counts[0] = all.u;
      out.counts[1] = all.g;
    }
  }
};

// Over i in [0, n]: inverse[i] (the rank of position i's id), unique_ids[i] = 0 past
// num_unique, group_offsets[i] = num_unique past num_groups.
__global__ void bitmap_rank_kernel(const int* __restrict__ ids, int n, int max_id,
                                   const uint32_t* __restrict__ bitmap,
                                   const int* __restrict__ word_rank, PlanOutputs out) {
  const int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  if (i > n) return;
  const int U = out.counts[0], G = out.counts[1];
  if (i < n) {
    const int id = min(max(ids[i], 0), max_id);
    out.inverse[i] = pb::Rank(bitmap[id >> 5], word_rank[id >> 5], id);
    if (i >= U) out.unique_ids[i] = 0;
  }
  if (i >= G) out.group_offsets[i] = U;
}

// The exclusive scan of the words' Spans into the writer (tmp null: its bytes only).
cudaError_t word_scan(void* tmp, size_t& bytes, const WordWriter& w, cudaStream_t stream) {
  const auto spans = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0),
                                                     WordSpanOf{w.bitmap, w.last_extent});
  return cub::DeviceScan::ExclusiveScan(tmp, bytes, spans,
                                        thrust::tabulate_output_iterator<WordWriter>(w),
                                        JoinSpans{}, pb::kEmpty, static_cast<int>(w.words), stream);
}

struct BitmapScratch {
  int64_t words;
  uint32_t* bitmap;  // [words]
  int* word_rank;    // [words]
  void* cub_tmp;
  size_t cub_bytes, bytes;
};

cudaError_t bitmap_layout(int num_rows, void* base, BitmapScratch* s) {
  s->words = pb::Words(num_rows);
  s->cub_bytes = 0;
  cudaError_t err = word_scan(nullptr, s->cub_bytes, WordWriter{nullptr, s->words}, nullptr);
  Bump bp{aligned_base(base)};
  s->bitmap = bp.take<uint32_t>(s->words);
  s->word_rank = bp.take<int>(s->words);
  s->cub_tmp = bp.take<char>(s->cub_bytes);
  s->bytes = plan_scan::kAlign - 1 + bp.off;
  return err;
}

cudaError_t build_bitmap_plan(const int* ids, int n, int last_extent, int num_rows,
                              const PlanOutputs& out, void* scratch, cudaStream_t stream) {
  BitmapScratch s;
  cudaError_t err = bitmap_layout(num_rows, scratch, &s);
  if (err != cudaSuccess) return err;
  if ((err = cudaMemsetAsync(s.bitmap, 0, sizeof(uint32_t) * s.words, stream)) != cudaSuccess)
    return err;
  bitmap_mark_kernel<<<static_cast<unsigned>((n + kBlock - 1) / kBlock), kBlock, 0, stream>>>(
      ids, n, num_rows - 1, s.bitmap);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  size_t bytes = s.cub_bytes;
  err = word_scan(s.cub_tmp, bytes, WordWriter{s.bitmap, s.words, last_extent, s.word_rank, out},
                  stream);
  if (err != cudaSuccess) return err;
  bitmap_rank_kernel<<<static_cast<unsigned>(n / kBlock + 1), kBlock, 0, stream>>>(
      ids, n, num_rows - 1, s.bitmap, s.word_rank, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t plan_scratch_bytes(int n, int num_rows, bool forward_only, size_t* bytes) {
  *bytes = 0;
  if (n == 0) return cudaSuccess;
  cudaError_t err;
  if (forward_only && pb::Applies(n, num_rows)) {
    BitmapScratch s;
    err = bitmap_layout(num_rows, nullptr, &s);
    if (err == cudaSuccess) *bytes = s.bytes;
    return err;
  }
  SortedScratch s;
  err = sorted_layout(n, num_rows, forward_only, nullptr, &s);
  if (err == cudaSuccess) *bytes = s.bytes;
  return err;
}

cudaError_t build_plan(const int* ids, int n, int last_extent, int num_rows, const PlanOutputs& out,
                       void* scratch, cudaStream_t stream) {
  if (n == 0)
    return plan_scan::write_empty_plan(out.run_offsets, out.group_offsets, out.counts, stream);
  if (out.perm == nullptr && pb::Applies(n, num_rows))
    return build_bitmap_plan(ids, n, last_extent, num_rows, out, scratch, stream);
  return build_sorted_plan(ids, n, last_extent, num_rows, out, scratch, stream);
}

}  // namespace flowtt
