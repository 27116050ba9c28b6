// Table-batched rows kernels, forward (sm_90), docs/batched_contract.md, launched by
// cuda/batched/tb_rows.cu (and on the CPU by the emulation test tests/native/tb_rows_emu_test.cc).
// The kernels see packed core rows only (u_i3, g_i1, g_i2 from the plan), never tables: one launch
// per stage serves every table of a shape group.
//
// Forward (flowtt_tb_rows_fwd), two designs, each one persistent kernel:
//   tb_fwd_tile_kernel (r2 % 4 == 0, q3 4 or 8): the groups sorted by g_i2 (radix sort),
//     a block per packed g2 row keeps it in shared memory for all its groups (the groups
//     sharing a g2 row are the same table's (i1, i2) for every i1), P of up to GB groups
//     at a time by one GEMM (kTbTileGroups; kTbFwdFixedGroups in the compile-time dims
//     instances); groups longer than kTbChunk ids finish in a chunk phase;
//   tb_fwd_kernel (any supported dims): warps steal chunks of kTbChunk consecutive unique
//     indices from an atomic counter; a warp walks the groups overlapping its chunk (the
//     first by binary search in group_offsets), forms each group's prefix product
//     P = g1[g_i1] . g2[g_i2] in its shared-memory slice and writes the rows of the
//     chunk's unique indices of that group. A group longer than a chunk is split across
//     chunks (its P recomputed per chunk), so any skew balances.
#pragma once

#include "batched/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

// ------------------------------- forward -------------------------------------------

template <int Q1C, int VEC, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_fwd_kernel(DD d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ g3, const int* __restrict__ u_i3,
                  const int* __restrict__ g_i1, const int* __restrict__ g_i2,
                  const int* __restrict__ goffs, const int* __restrict__ counts, int n, int* ctr,
                  float* __restrict__ rows) {
  TB_DYNAMIC_SMEM(tb_smem4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* G1s =
      reinterpret_cast<float*>(tb_smem4) + warp * (tb_align4(d.Q1R1) + tb_align4(d.M * d.ldP));
  float* Pw = G1s + tb_align4(d.Q1R1);
  int U, G;
  tb_counts(counts, n, U, G);
  for (;;) {
    int c = 0;
    if (lane == 0) c = atomicAdd(ctr, 1);
    c = __shfl_sync(0xffffffffu, c, 0);
    if ((long long)c * kTbChunk >= U) break;
    const int u0 = c * kTbChunk, u1 = min(u0 + kTbChunk, U);
    for (int g = tb_find_group(goffs, G, u0); g < G; ++g) {
      int gs, ge;
      tb_group_range(goffs, g, U, gs, ge);
      if (gs >= u1) break;
      const int a = max(gs, u0), b = min(ge, u1);
      if (a >= b) continue;
      tb_warp_load_g1(d, g1, tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1), G1s, lane);
      __syncwarp();
      tb_warp_prefix<Q1C, VEC>(d, G1s, g2 + (size_t)tb_clamp(__ldg(g_i2 + g), 0, d.p2 - 1) * d.R1K,
                               Pw, lane);
      __syncwarp();
      tb_warp_apply(d, Pw, g3, u_i3, a, b, rows, lane);
      __syncwarp();
    }
  }
}

// The sorted-tile forward (r2 % 4 == 0, q3 = Q3 in {4, 8}; geometry tb_tile_geo), after
// the groups are sorted by g_i2 (a radix sort, tb_bounds_kernel):
// phase 1, blocks steal packed g2 rows I (ctr[0]); the g2 row goes to shared memory once
// and serves every group of I, in batches of GB: the batch's g1 rows transposed, P of the
// whole batch as one GEMM [GB*q1, r1] x [r1, K] (kTbRPT rows x 4 columns per thread),
// then a thread per (unique index, m) writes row[m][0..Q3) for the first kTbChunk unique
// indices of each group. Phase 2, warps steal chunks of kTbChunk unique indices (ctr[1]):
// the only work left in chunk [u0, u0 + kTbChunk) is the tail of the group holding u0
// past its first kTbChunk ids, done as in tb_fwd_kernel (P recomputed by the warp).
template <int Q3, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_fwd_tile_kernel(DD d, TbTileGeo geo, const float* __restrict__ g1,
                       const float* __restrict__ g2, const float* __restrict__ g3,
                       const int* __restrict__ u_i3, const int* __restrict__ g_i1,
                       const int* __restrict__ g_i2, const int* __restrict__ goffs,
                       const int* __restrict__ counts, int n, const int* __restrict__ bounds2,
                       const int* __restrict__ sorted_groups, int* ctr, float* __restrict__ rows) {
  TB_DYNAMIC_SMEM(tb_smem4);
  float* smem = reinterpret_cast<float*>(tb_smem4);
  float* G2s = smem;                   // [r1][K]
  float* As = G2s + tb_align4(d.R1K);  // [r1][ldA]
  float* Ps = As + d.r1 * geo.ldA;     // [GB][r2][ldm]
  __shared__ int s_item, s_w;
  __shared__ int s_gs[kTbTileGroups], s_pref[kTbTileGroups], s_i1[kTbTileGroups];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  for (;;) {  // phase 1
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.p2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    if (lo == hi) continue;
    {
      const float4* src = reinterpret_cast<const float4*>(g2 + (size_t)I * d.R1K);
      for (int i = tid; i < d.R1K / 4; i += kTbThreads)
        reinterpret_cast<float4*>(G2s)[i] = __ldg(src + i);
    }
    for (int j0 = lo; j0 < hi; j0 += geo.GB) {
      const int nb = min(geo.GB, hi - j0);
      __syncthreads();  // the previous batch's As / Ps are read
      if (warp == 0) {  // the batch's groups, their first kTbChunk ids, a scan of the counts
        int cnt = 0;
        if (lane < nb) {
          const int g = tb_clamp(__ldg(sorted_groups + j0 + lane), 0, gmax);
          int gs, ge;
          tb_group_range(goffs, g, U, gs, ge);
          cnt = min(ge - gs, kTbChunk);
          s_gs[lane] = gs;
          s_i1[lane] = tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1);
        }
        const int incl = tb_warp_inclusive_scan(cnt, lane);
        if (lane < nb) s_pref[lane] = incl - cnt;
        if (lane == 31) s_w = incl;
      }
      __syncthreads();
      tb_batch_P(d, g1, s_i1, nb, geo.ldA, As, G2s,
                 [&](int row0, int c4, int nR, const float (&acc)[kTbRPT][4]) {
                   const int x2 = (4 * c4) / d.r2, b0 = 4 * c4 - x2 * d.r2;  // r2 % 4 == 0
#pragma unroll
                   for (int i = 0; i < kTbRPT; ++i) {
                     const int row = row0 + i;
                     if (row < nR) {
                       const int k = row / d.q1, m = (row - k * d.q1) * d.q2 + x2;
#pragma unroll
                       for (int c = 0; c < 4; ++c)
                         Ps[k * geo.PT + (b0 + c) * geo.ldm + m] = acc[i][c];
                     }
                   }
                 });
      __syncthreads();
      const int W = s_w;
      for (int it = tid; it < W * d.M; it += kTbThreads) {  // row[m][0..Q3) of one id
        const int uq = it / d.M, m = it - uq * d.M;
        int k = 0;  // the last group of the batch with s_pref[k] <= uq
        for (int step = kTbTileGroups / 2; step > 0; step >>= 1)
          if (k + step < nb && s_pref[k + step] <= uq) k += step;
        const int u = s_gs[k] + (uq - s_pref[k]);
        const int i3 = tb_clamp(__ldg(u_i3 + u), 0, d.p3 - 1);
        const float* P = Ps + k * geo.PT + m;
        const float4* c = reinterpret_cast<const float4*>(g3 + (size_t)i3 * d.S3);
        float acc[Q3];
#pragma unroll
        for (int z = 0; z < Q3; ++z) acc[z] = 0.f;
#pragma unroll 4
        for (int b = 0; b < d.r2; ++b) {
          const float pv = P[b * geo.ldm];
#pragma unroll
          for (int h = 0; h < Q3 / 4; ++h) {
            const float4 cv = __ldg(c + b * (Q3 / 4) + h);
            acc[4 * h] = fmaf(pv, cv.x, acc[4 * h]);
            acc[4 * h + 1] = fmaf(pv, cv.y, acc[4 * h + 1]);
            acc[4 * h + 2] = fmaf(pv, cv.z, acc[4 * h + 2]);
            acc[4 * h + 3] = fmaf(pv, cv.w, acc[4 * h + 3]);
          }
        }
        float4* out = reinterpret_cast<float4*>(rows + (size_t)u * d.D + m * Q3);
#pragma unroll
        for (int h = 0; h < Q3 / 4; ++h)
          out[h] = make_float4(acc[4 * h], acc[4 * h + 1], acc[4 * h + 2], acc[4 * h + 3]);
      }
    }
  }
  // phase 2: the tails; the block's shared memory is free (tb_claim synchronised it)
  float* G1s = smem + warp * (tb_align4(d.Q1R1) + tb_align4(d.M * d.ldP));
  float* Pw = G1s + tb_align4(d.Q1R1);
  for (;;) {
    int c = 0;
    if (lane == 0) c = atomicAdd(ctr + 1, 1);
    c = __shfl_sync(0xffffffffu, c, 0);
    if ((long long)c * kTbChunk >= U) break;
    const int u0 = c * kTbChunk, u1 = min(u0 + kTbChunk, U);
    const int g = tb_find_group(goffs, G, u0);
    if (g >= G) continue;
    int gs, ge;
    tb_group_range(goffs, g, U, gs, ge);
    const int a = max(u0, gs + kTbChunk), b = min(ge, u1);
    if (a >= b) continue;
    tb_warp_load_g1(d, g1, tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1), G1s, lane);
    __syncwarp();
    tb_warp_prefix<0, 4>(d, G1s, g2 + (size_t)tb_clamp(__ldg(g_i2 + g), 0, d.p2 - 1) * d.R1K, Pw,
                         lane);
    __syncwarp();
    tb_warp_apply(d, Pw, g3, u_i3, a, b, rows, lane);
    __syncwarp();
  }
}

}  // namespace
}  // namespace flowtt::tb
