// A stable LSD radix sort of indices by a key looked up per index (key_src[i] clamped
// into [0, key_max]: g_i2 of a group, u_i3 of a unique index), over the first num_groups
// (which == 1) or num_unique (which == 0) indices: a count on the device, so the cost
// follows the live entries, not the plan's static size n, and no key buffers are kept.
// The entries form tiles of kTbSortTile; only the live tiles (those holding entries below
// the count, tb_sort_tiles(count)) are read or written, by grid-stride blocks. The key bits
// in use (tb_end_bit) go in the fewest passes of at most kTbRadixMaxBits bits each, the
// widest first, widths within one (tb_sort_pass: 17 bits in passes of 9 and 8, 15 in 8 and
// 7). Per pass (launched by cuda/batched/tb_rows.cu, emulated by tests/native/tb_rows_emu_test.cc;
// `vals` null means the identity, the first pass), over tb_sort_slots(bits) digit slots (256, or
// 512 for a 9-bit pass; thread t owns digits t and t + 256):
//   tb_radix_hist_kernel: a block per live tile counts its digits into hist[digit][tile];
//   tb_radix_scan_kernel: a block per digit turns its row into the exclusive prefix over
//     the live tiles, in place, and writes the digit's total;
//   tb_radix_scatter_kernel: a block per live tile writes its entries at their digit's
//     base (the exclusive prefix of the totals) plus the tile's prefix plus their rank
//     among the tile's entries of that digit, in index order (rounds of 256 entries;
//     inside a round, ranks from __match_any_sync and per-warp counts).
#pragma once

#include "batched/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

constexpr int kTbSortItems = 8;                         // entries per thread of a tile
constexpr int kTbSortTile = kTbThreads * kTbSortItems;  // entries per tile
constexpr int kTbRadixMaxBits = 9, kTbRadix = 1 << kTbRadixMaxBits;
static_assert(kTbRadix == 2 * kTbThreads, "two digits per thread");

// Tiles holding n entries (hist has kTbRadix rows of the static n's; the live ones are
// those of the count).
__host__ __device__ inline int tb_sort_tiles(int n) { return (n + kTbSortTile - 1) / kTbSortTile; }

// Bits that hold keys in [0, max_key] (at least 1).
inline int tb_end_bit(int max_key) {
  int b = 1;
  while (b < 31 && (1LL << b) <= max_key) ++b;
  return b;
}

// The passes over keys in [0, max_key]: `count` passes over bits [0, end).
struct TbSortPasses {
  int count, end;
};
inline TbSortPasses tb_sort_passes(int max_key) {
  const int end = tb_end_bit(max_key);
  return {(end + kTbRadixMaxBits - 1) / kTbRadixMaxBits, end};
}

// Pass p's bits [shift, shift + bits): the first end % count passes one bit wider.
struct TbSortPass {
  int shift, bits;
};
inline TbSortPass tb_sort_pass(TbSortPasses ps, int p) {
  const int base = ps.end / ps.count, extra = ps.end % ps.count;
  return {p * base + (p < extra ? p : extra), base + (p < extra ? 1 : 0)};
}

// Digit slots of a pass of `bits` bits: a multiple of the block (slot t + h * kTbThreads is
// thread t's, h < tb_sort_slots(bits) / kTbThreads).
__host__ __device__ inline int tb_sort_slots(int bits) { return bits > 8 ? kTbRadix : kTbThreads; }

// The number of entries to sort: num_groups (which == 1) or num_unique (which == 0).
__device__ __forceinline__ int tb_sort_count(const int* counts, int n, int which) {
  int U, G;
  tb_counts(counts, n, U, G);
  return which ? G : U;
}

// The exclusive prefix of v over the block's threads (all call it); total: the block's sum.
// s_w: kTbWarps ints of shared memory.
__device__ __forceinline__ int tb_block_exclusive_scan(int v, int* s_w, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int incl = tb_warp_inclusive_scan(v, lane);
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

// The digit of entry j (its sort key's bits [shift, shift + bits)); v: the index it sorts.
__device__ __forceinline__ int tb_sort_digit(const int* __restrict__ vals,
                                             const int* __restrict__ key_src, int key_max, int j,
                                             int shift, int bits, int& v) {
  v = vals != nullptr ? __ldg(vals + j) : j;
  return (tb_clamp(__ldg(key_src + v), 0, key_max) >> shift) & ((1 << bits) - 1);
}

__global__ void __launch_bounds__(kTbThreads)
    tb_radix_hist_kernel(const int* __restrict__ vals, const int* __restrict__ key_src, int key_max,
                         const int* __restrict__ counts, int which, int n, int shift, int bits,
                         int tiles, int* __restrict__ hist) {
  __shared__ int s_cnt[kTbRadix];
  const int cnt = tb_sort_count(counts, n, which), live = tb_sort_tiles(cnt);
  const int tid = threadIdx.x, nh = tb_sort_slots(bits) / kTbThreads;
  for (int tile = blockIdx.x; tile < live; tile += gridDim.x) {
    for (int h = 0; h < nh; ++h) s_cnt[tid + h * kTbThreads] = 0;  // read by this thread before
    __syncthreads();
    for (int i = 0; i < kTbSortItems; ++i) {
      const int j = tile * kTbSortTile + i * kTbThreads + tid;
      int v;
      if (j < cnt) atomicAdd(&s_cnt[tb_sort_digit(vals, key_src, key_max, j, shift, bits, v)], 1);
    }
    __syncthreads();
    for (int h = 0; h < nh; ++h) {
      const int dg = tid + h * kTbThreads;
      hist[(size_t)dg * tiles + tile] = s_cnt[dg];
    }
  }
}

// Block `digit` (tb_sort_slots(bits) blocks): hist[digit][t] = the digit's entries in the live
// tiles before t, totals[digit] = its entries.
__global__ void __launch_bounds__(kTbThreads)
    tb_radix_scan_kernel(const int* __restrict__ counts, int which, int n, int tiles,
                         int* __restrict__ hist, int* __restrict__ totals) {
  __shared__ int s_w[kTbWarps];
  const int live = tb_sort_tiles(tb_sort_count(counts, n, which));
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
                            int shift, int bits, int tiles, const int* __restrict__ offsets,
                            const int* __restrict__ totals, int* __restrict__ vals_out) {
  __shared__ int s_next[kTbRadix];            // the digit's next output position
  __shared__ int s_warp[kTbWarps][kTbRadix];  // per round: entries per (warp, digit)
  __shared__ int s_w[kTbWarps];
  const int cnt = tb_sort_count(counts, n, which), live = tb_sort_tiles(cnt);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nh = tb_sort_slots(bits) / kTbThreads;  // block-uniform
  if ((int)blockIdx.x >= live) return;              // block-uniform
  int base_d[2] = {0, 0};                           // the base of digits tid, tid + kTbThreads
  for (int h = 0, below = 0; h < nh; ++h) {
    int all;
    base_d[h] = below + tb_block_exclusive_scan(totals[tid + h * kTbThreads], s_w, all);
    below += all;
  }
  for (int tile = blockIdx.x; tile < live; tile += gridDim.x) {
    const int base = tile * kTbSortTile;
    for (int h = 0; h < nh; ++h) {  // read and written by this thread only
      const int dg = tid + h * kTbThreads;
      s_next[dg] = base_d[h] + offsets[(size_t)dg * tiles + tile];
    }
    for (int i = 0; i < kTbSortItems; ++i) {
      for (int w = 0; w < kTbWarps; ++w)
        for (int h = 0; h < nh; ++h) s_warp[w][tid + h * kTbThreads] = 0;
      __syncthreads();
      const int j = base + i * kTbThreads + tid;
      const bool valid = j < cnt;
      int v = 0, digit = -1;
      if (valid) digit = tb_sort_digit(vals, key_src, key_max, j, shift, bits, v);
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      if (valid && rank == 0) s_warp[warp][digit] = __popc(peers);
      __syncthreads();
      for (int h = 0; h < nh; ++h) {  // digit tid + h * kTbThreads: prefix over the warps
        const int dg = tid + h * kTbThreads;
        int run = s_next[dg];
        for (int w = 0; w < kTbWarps; ++w) {
          const int c = s_warp[w][dg];
          s_warp[w][dg] = run;
          run += c;
        }
        s_next[dg] = run;
      }
      __syncthreads();
      if (valid) vals_out[s_warp[warp][digit] + rank] = v;
      __syncthreads();  // s_warp is read before the next round clears it
    }
  }
}

}  // namespace
}  // namespace flowtt::tb
