// A stable LSD radix sort of indices by a key looked up per index (key_src[i] clamped
// into [0, key_max]: g_i2 of a group, u_i3 of a unique index), over the first num_groups
// (which == 1) or num_unique (which == 0) indices: a count on the device, so the cost
// follows the live entries, not the plan's static size n, and no key buffers are kept.
// The entries form tiles of kTbSortTile; only the live tiles (those holding entries below
// the count, tb_sort_live_tiles) are read or written, by grid-stride blocks. One pass per
// 8-bit digit (launched by cuda/tb_rows.cu, emulated by cuda/tb_rows_emu_test.cc); `vals`
// null means the identity (the first pass):
//   tb_radix_hist_kernel: a block per live tile counts its digits into hist[digit][tile];
//   tb_radix_scan_kernel: a block per digit turns its row into the exclusive prefix over
//     the live tiles, in place, and writes the digit's total;
//   tb_radix_scatter_kernel: a block per live tile writes its entries at their digit's
//     base (the exclusive prefix of the totals) plus the tile's prefix plus their rank
//     among the tile's entries of that digit, in index order (rounds of 256 entries;
//     inside a round, ranks from __match_any_sync and per-warp counts).
#pragma once

#include "cuda/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

constexpr int kTbSortItems = 8;                         // entries per thread of a tile
constexpr int kTbSortTile = kTbThreads * kTbSortItems;  // entries per tile
constexpr int kTbRadixBits = 8, kTbRadix = 1 << kTbRadixBits;
static_assert(kTbRadix == kTbThreads, "a thread per digit");

// Tiles of the sort for n entries (hist has kTbRadix rows of them).
inline int tb_sort_tiles(int n) { return (n + kTbSortTile - 1) / kTbSortTile; }

// The number of entries to sort: num_groups (which == 1) or num_unique (which == 0).
__device__ __forceinline__ int tb_sort_count(const int* counts, int n, int which) {
  int U, G;
  tb_counts(counts, n, U, G);
  return which ? G : U;
}

// The tiles holding the first `count` entries.
__device__ __forceinline__ int tb_sort_live_tiles(const int* counts, int n, int which) {
  return (tb_sort_count(counts, n, which) + kTbSortTile - 1) / kTbSortTile;
}

// The exclusive prefix of v over the block's threads (all call it); total: the block's sum.
// s_w: kTbWarps ints of shared memory.
__device__ __forceinline__ int tb_block_exclusive_scan(int v, int* s_w, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
  for (int off = 1; off < 32; off <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += x;
  }
  if (lane == 31) s_w[warp] = incl;
  __syncthreads();
  int below = 0;
  total = 0;
  for (int w = 0; w < kTbWarps; ++w) {
    const int c = s_w[w];
    if (w < warp) below += c;
    total += c;
  }
  __syncthreads();  // s_w is read before the next call writes it
  return below + incl - v;
}

// The sort key of entry j.
__device__ __forceinline__ int tb_sort_key(const int* __restrict__ vals,
                                           const int* __restrict__ key_src, int key_max, int j,
                                           int& v) {
  v = vals != nullptr ? __ldg(vals + j) : j;
  return tb_clamp(__ldg(key_src + v), 0, key_max);
}

__global__ void __launch_bounds__(kTbThreads)
    tb_radix_hist_kernel(const int* __restrict__ vals, const int* __restrict__ key_src, int key_max,
                         const int* __restrict__ counts, int which, int n, int shift, int tiles,
                         int* __restrict__ hist) {
  __shared__ int s_cnt[kTbRadix];
  const int cnt = tb_sort_count(counts, n, which), live = tb_sort_live_tiles(counts, n, which);
  const int tid = threadIdx.x;
  for (int tile = blockIdx.x; tile < live; tile += gridDim.x) {
    s_cnt[tid] = 0;  // this thread read its count of the previous tile
    __syncthreads();
    for (int i = 0; i < kTbSortItems; ++i) {
      const int j = tile * kTbSortTile + i * kTbThreads + tid;
      int v;
      if (j < cnt)
        atomicAdd(&s_cnt[(tb_sort_key(vals, key_src, key_max, j, v) >> shift) & (kTbRadix - 1)], 1);
    }
    __syncthreads();
    hist[(size_t)tid * tiles + tile] = s_cnt[tid];
  }
}

// Block `digit` (kTbRadix blocks): hist[digit][t] = the digit's entries in the live tiles
// before t, totals[digit] = its entries.
__global__ void __launch_bounds__(kTbThreads)
    tb_radix_scan_kernel(const int* __restrict__ counts, int which, int n, int tiles,
                         int* __restrict__ hist, int* __restrict__ totals) {
  __shared__ int s_w[kTbWarps];
  const int live = tb_sort_live_tiles(counts, n, which);
  int* row = hist + (size_t)blockIdx.x * tiles;
  int carry = 0;
  for (int t0 = 0; t0 < live; t0 += kTbThreads) {  // block-uniform
    const int t = t0 + threadIdx.x;
    const int v = t < live ? row[t] : 0;
    int total;
    const int ex = tb_block_exclusive_scan(v, s_w, total);
    if (t < live) row[t] = carry + ex;
    carry += total;
  }
  if (threadIdx.x == 0) totals[blockIdx.x] = carry;
}

__global__ void __launch_bounds__(kTbThreads)
    tb_radix_scatter_kernel(const int* __restrict__ vals, const int* __restrict__ key_src,
                            int key_max, const int* __restrict__ counts, int which, int n,
                            int shift, int tiles, const int* __restrict__ offsets,
                            const int* __restrict__ totals, int* __restrict__ vals_out) {
  __shared__ int s_next[kTbRadix];            // the digit's next output position
  __shared__ int s_warp[kTbWarps][kTbRadix];  // per round: entries per (warp, digit)
  __shared__ int s_w[kTbWarps];
  const int cnt = tb_sort_count(counts, n, which), live = tb_sort_live_tiles(counts, n, which);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if ((int)blockIdx.x >= live) return;  // block-uniform
  int all;
  const int digit_base = tb_block_exclusive_scan(totals[tid], s_w, all);
  for (int tile = blockIdx.x; tile < live; tile += gridDim.x) {
    const int base = tile * kTbSortTile;
    s_next[tid] = digit_base + offsets[(size_t)tid * tiles + tile];  // read by this thread only
    for (int i = 0; i < kTbSortItems; ++i) {
      for (int w = 0; w < kTbWarps; ++w) s_warp[w][tid] = 0;
      __syncthreads();
      const int j = base + i * kTbThreads + tid;
      const bool valid = j < cnt;
      int v = 0, digit = -1;
      if (valid) digit = (tb_sort_key(vals, key_src, key_max, j, v) >> shift) & (kTbRadix - 1);
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      if (valid && rank == 0) s_warp[warp][digit] = __popc(peers);
      __syncthreads();
      {  // thread tid = digit: exclusive prefix over the warps, from the digit's next position
        int run = s_next[tid];
        for (int w = 0; w < kTbWarps; ++w) {
          const int c = s_warp[w][tid];
          s_warp[w][tid] = run;
          run += c;
        }
        s_next[tid] = run;
      }
      __syncthreads();
      if (valid) vals_out[s_warp[warp][digit] + rank] = v;
      __syncthreads();  // s_warp is read before the next round clears it
    }
  }
}

}  // namespace
}  // namespace flowtt::tb
