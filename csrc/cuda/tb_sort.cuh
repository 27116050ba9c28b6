// A stable LSD radix sort of indices by a key looked up per index (key_src[i] clamped
// into [0, key_max]: g_i2 of a group, u_i3 of a unique index), over the first num_groups
// (which == 1) or num_unique (which == 0) indices: a count on the device, so the cost
// follows the live entries, not the plan's static size n, and no key buffers are kept.
// One pass per 8-bit digit (launched by cuda/tb_rows.cu, emulated by
// cuda/tb_rows_emu_test.cc); `vals` null means the identity (the first pass):
//   tb_radix_hist_kernel: a block per tile of kTbSortTile entries counts its digits into
//     hist[digit][tile] (zeros for the tiles past the count);
//   an exclusive scan of hist (digit-major, then tile: each digit's tiles in order);
//   tb_radix_scatter_kernel: a block per tile writes its entries at their digit's offset
//     plus their rank among the tile's entries of that digit, in index order (rounds of
//     256 entries; inside a round, ranks from __match_any_sync and per-warp counts).
#pragma once

#include "cuda/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

constexpr int kTbSortItems = 8;                         // entries per thread of a tile
constexpr int kTbSortTile = kTbThreads * kTbSortItems;  // entries per tile
constexpr int kTbRadixBits = 8, kTbRadix = 1 << kTbRadixBits;
static_assert(kTbRadix == kTbThreads, "a thread per digit");

// Tiles of the sort for n entries (the grid of both kernels; hist has kTbRadix rows of it).
inline int tb_sort_tiles(int n) { return (n + kTbSortTile - 1) / kTbSortTile; }

// The number of entries to sort: num_groups (which == 1) or num_unique (which == 0).
__device__ __forceinline__ int tb_sort_count(const int* counts, int n, int which) {
  int U, G;
  tb_counts(counts, n, U, G);
  return which ? G : U;
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
  const int cnt = tb_sort_count(counts, n, which);
  const int tid = threadIdx.x, base = blockIdx.x * kTbSortTile;
  s_cnt[tid] = 0;
  __syncthreads();
  for (int i = 0; i < kTbSortItems; ++i) {
    const int j = base + i * kTbThreads + tid;
    int v;
    if (j < cnt)
      atomicAdd(&s_cnt[(tb_sort_key(vals, key_src, key_max, j, v) >> shift) & (kTbRadix - 1)], 1);
  }
  __syncthreads();
  hist[(size_t)tid * tiles + blockIdx.x] = s_cnt[tid];
}

__global__ void __launch_bounds__(kTbThreads)
    tb_radix_scatter_kernel(const int* __restrict__ vals, const int* __restrict__ key_src,
                            int key_max, const int* __restrict__ counts, int which, int n,
                            int shift, int tiles, const int* __restrict__ offsets,
                            int* __restrict__ vals_out) {
  __shared__ int s_next[kTbRadix];            // the digit's next output position
  __shared__ int s_warp[kTbWarps][kTbRadix];  // per round: entries per (warp, digit)
  const int cnt = tb_sort_count(counts, n, which);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int base = blockIdx.x * kTbSortTile;
  if (base >= cnt) return;
  s_next[tid] = offsets[(size_t)tid * tiles + blockIdx.x];
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

}  // namespace
}  // namespace flowtt::tb
