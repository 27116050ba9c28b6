// Table-batched rows kernels, backward: dg3 and its P cache (sm_90), launched by
// cuda/batched/tb_rows.cu after the kernels of cuda/batched/tb_bwd_kernels.cuh (and on the CPU by
// the emulation test tests/native/tb_rows_emu_test.cc); docs/batched_contract.md.
//
//   dg3[I]: a warp per g3 row over its ids in ascending u, in chunks: each id's P (from
//     the P cache tb_pcache_kernel filled, in passes of `cap` groups when they do not all
//     fit; without a cache formed by the warp) and d_rows row staged in the warp's slice,
//     then P^T . d_rows[u] (a sum over m ascending) added per output element in u order.
#pragma once

#include "batched/mma_tf32.cuh"
#include "batched/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

// ------------------------------- backward: the P cache -------------------------------

// P of a batch on tensor cores (tb_pcache_mma dims): A = the batch's g1 rows Am [rows][r1 + 4]
// (row (k, x1) = g1 row x1 of group s_g[k]; rows past nR are 0), B = the g2 row G2m
// [r1][K + 8]; warp w takes the items (16 rows, 32 columns) w, w + kTbWarps, ..., each
// element the sum over r1 in k-steps of 8 ascending, each k-step's 3xTF32 product added in
// float32 (tb_mma_3xtf32), stored as float2 to Pc[s_g[k] - glo][x1][col].
template <class DD>
__device__ __forceinline__ void tb_pcache_batch_mma(const DD& d, int nR, const float* Am,
                                                    const float* G2m, const int* s_g, int glo,
                                                    float* __restrict__ Pc) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int lda = d.r1 + 4, ldb = d.K + 8, nc = d.K / 32, items = (nR + 15) / 16 * nc;
  for (int item = warp; item < items; item += kTbWarps) {  // warp-uniform
    const int m0 = item / nc * 16, n0 = item % nc * 32;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    for (int k0 = 0; k0 < d.r1; k0 += 8) {
      const float* a = Am + (m0 + g) * lda + k0 + t;
      const TbTf32 af[4] = {tb_split_tf32(a[0]), tb_split_tf32(a[8 * lda]), tb_split_tf32(a[4]),
                            tb_split_tf32(a[8 * lda + 4])};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* b = G2m + (k0 + t) * ldb + n0 + 8 * j + g;
        const TbTf32 bf[2] = {tb_split_tf32(b[0]), tb_split_tf32(b[4 * ldb])};
        tb_mma_3xtf32(acc[j], af, bf);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + g + 8 * h;
      if (row >= nR) continue;
      const int k = row / d.q1, x1 = row - k * d.q1;
      float* dst = Pc + (size_t)(s_g[k] - glo) * d.PSZ + x1 * d.K + n0 + 2 * t;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
    }
  }
}

// Pc[g - glo] = P_g = g1[g_i1[g]] . g2[g_i2[g]] as [q1][K] (= [M][r2]) for the groups g in
// [glo, glo + cap) below num_groups (one pass of tb_rows_bwd's dg3 loop), so that dg3 reads
// P_g (PSZ floats) instead of forming it per block; returns at once when glo >= num_groups. Phase 1
// of tb_fwd_tile_kernel without the rows (geometry tb_tile_geo, smem tb_pcache_smem): blocks steal
// packed g2 rows I (ctr), the g2 row staged once for all its groups (sorted_groups[bounds2[I] ..
// bounds2[I+1])), batches of up to geo.GB of them (groups outside the pass dropped), P of a batch
// by one GEMM, stored straight from the registers (float4, r2 % 4 == 0). On tensor cores
// for tb_pcache_mma dims (tb_pcache_batch_mma: deterministic, its bits independent of the
// batch size, not those of the FMA chain); else every element is fmaf(g1[x1][a], g2[a][j],
// acc) over a ascending from 0, the chain of tb_warp_prefix: the stored P is bitwise the P
// that tb_dg3_kernel forms when it recomputes.
template <class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_pcache_kernel(DD d, TbTileGeo geo, const float* __restrict__ g1,
                     const float* __restrict__ g2, const int* __restrict__ g_i1,
                     const int* __restrict__ counts, int n, const int* __restrict__ bounds2,
                     const int* __restrict__ sorted_groups, int glo, int cap, int* ctr,
                     float* __restrict__ Pc) {
  TB_DYNAMIC_SMEM(tb_smem4);
  float* smem = reinterpret_cast<float*>(tb_smem4);
  float* G2s = smem;                   // [r1][K] ([r1][K + 8] on the mma path)
  float* As = G2s + tb_align4(d.R1K);  // [r1][ldA] (the FMA path)
  __shared__ int s_item, s_nb;
  __shared__ int s_g[kTbTileGroups], s_i1[kTbTileGroups];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  if (glo >= G) return;
  const int ghi = (int)min((long long)glo + cap, (long long)G);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.p2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    bool staged = false;
    for (int j0 = lo; j0 < hi; j0 += geo.GB) {
      const int nc = min(geo.GB, hi - j0);
      __syncthreads();  // the previous batch's As is read
      if (warp == 0) {  // the batch's cached groups, compacted
        int g = 0;
        bool keep = false;
        if (lane < nc) {
          g = tb_clamp(__ldg(sorted_groups + j0 + lane), 0, gmax);
          keep = g >= glo && g < ghi;
        }
        const unsigned kept = __ballot_sync(0xffffffffu, keep);
        if (keep) {
          const int pos = __popc(kept & ((1u << lane) - 1u));
          s_g[pos] = g;
          s_i1[pos] = tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1);
        }
        if (lane == 0) s_nb = __popc(kept);
      }
      __syncthreads();
      const int nb = s_nb;
      if (nb == 0) continue;
      const bool mma = tb_pcache_mma(d);
      if (!staged) {
        const float4* src = reinterpret_cast<const float4*>(g2 + (size_t)I * d.R1K);
        for (int i = tid; i < d.R1K / 4; i += kTbThreads) {
          const int a = mma ? 4 * i / d.K : 0;  // [r1][K + 8] rows on the mma path
          reinterpret_cast<float4*>(G2s + 8 * a)[i] = __ldg(src + i);
        }
        staged = true;
      }
      if (mma) {
        float* Am = G2s + d.r1 * (d.K + 8);  // [rows][r1 + 4]
        const int nR = nb * d.q1, rows = (nR + 15) / 16 * 16;
        for (int e = tid; e < rows * d.r1; e += kTbThreads) {
          const int row = e / d.r1, a = e - row * d.r1;
          float v = 0.f;
          if (row < nR) {
            const int k = row / d.q1;
            v = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + (row - k * d.q1) * d.r1 + a);
          }
          Am[row * (d.r1 + 4) + a] = v;
        }
        __syncthreads();
        tb_pcache_batch_mma(d, nR, Am, G2s, s_g, glo, Pc);
        continue;
      }
      tb_batch_P(d, g1, s_i1, nb, geo.ldA, As, G2s,
                 [&](int row0, int c4, int nR, const float (&acc)[kTbRPT][4]) {
#pragma unroll
                   for (int i = 0; i < kTbRPT; ++i) {
                     const int row = row0 + i;
                     if (row < nR) {
                       const int k = row / d.q1, x1 = row - k * d.q1;
                       *reinterpret_cast<float4*>(Pc + (size_t)(s_g[k] - glo) * d.PSZ + x1 * d.K +
                                                  4 * c4) =
                           make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
                     }
                   }
                 });
    }
  }
}

// ------------------------------- backward: dg3 --------------------------------------

// sg[h] = the group of the unique index sorted_u[h] (h < num_unique), for dg3.
__global__ void tb_sorted_groups_kernel(const int* __restrict__ sorted_u,
                                        const int* __restrict__ ug, const int* __restrict__ counts,
                                        int n, int* __restrict__ sg) {
  int U, G;
  tb_counts(counts, n, U, G);
  for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < U; h += gridDim.x * blockDim.x)
    sg[h] = __ldg(ug + tb_clamp(__ldg(sorted_u + h), 0, n - 1));
}

// The first h in [lo, hi) with sg[h] >= key (hi if none), sg non-decreasing on [lo, hi)
// (one g3 row's groups: u ascending); every lane gets it. The warp probes 32 evenly spaced
// positions per step. Reads only inside [lo, hi) whatever sg holds.
__device__ __forceinline__ int tb_warp_lower_bound(const int* __restrict__ sg, int lo, int hi,
                                                   int key, int lane) {
  while (hi - lo > 32) {
    const int step = (hi - lo + 31) / 32, pos = lo + lane * step;
    const int c = __popc(__ballot_sync(0xffffffffu, pos < hi && __ldg(sg + pos) < key));
    if (c == 0) return lo;
    hi = min(hi, lo + c * step);
    lo += (c - 1) * step + 1;
  }
  const int pos = lo + lane;
  return lo + __popc(__ballot_sync(0xffffffffu, pos < hi && __ldg(sg + pos) < key));
}

// The terms of a chunk's nc staged ids (slots of `slot` floats: P [M][ldP] then the d_rows
// row at poff) in order, added to lane b's accumulators acc[i][z] (b = lane + 32 i): each
// term sum_m P[m][b] d[m][z] over m ascending. Q3C: q3 when 4 or 8 (float4 reads of the
// d_rows row), else 0 (any q3).
template <int Q3C, class DD>
__device__ __forceinline__ void tb_dg3_chunk_terms(const DD& d, const float* S, int slot, int poff,
                                                   int nc, int lane, float (&acc)[2][kTbQ3Max]) {
  constexpr int NZ = Q3C ? Q3C : kTbQ3Max;
  for (int k = 0; k < nc; ++k) {
    const float* P = S + k * slot;
    const float* dr = P + poff;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
      if (b >= d.r2) continue;
      float c[NZ];
#pragma unroll
      for (int z = 0; z < NZ; ++z) c[z] = 0.f;
      for (int m = 0; m < d.M; ++m) {
        const float p = P[m * d.ldP + b];
        if (Q3C > 0) {
#pragma unroll
          for (int z4 = 0; z4 < NZ; z4 += 4) {
            const float4 v = *reinterpret_cast<const float4*>(dr + m * Q3C + z4);
            c[z4] = fmaf(p, v.x, c[z4]);
            c[z4 + 1] = fmaf(p, v.y, c[z4 + 1]);
            c[z4 + 2] = fmaf(p, v.z, c[z4 + 2]);
            c[z4 + 3] = fmaf(p, v.w, c[z4 + 3]);
          }
        } else {
#pragma unroll
          for (int z = 0; z < NZ; ++z)
            if (z < d.q3) c[z] = fmaf(p, dr[m * d.q3 + z], c[z]);
        }
      }
#pragma unroll
      for (int z = 0; z < NZ; ++z)
        if (Q3C || z < d.q3) acc[i][z] += c[z];
    }
  }
}

// dg3[I] = sum over the unique indices u of I in ascending u (sorted_u[bounds3[I] ..
// bounds3[I+1]), a stable sort by u_i3) of P_{g(u)}^T . d_rows[u]. A warp per g3 row
// (work stealing by warps): the row's ids in chunks of tb_dg3_chunk(d), the next chunk's
// ids and groups (sg, tb_sorted_groups_kernel) read ahead; per chunk each id's d_rows row
// and P (from the P cache Pc, float4 loads in flight together; without a cache formed by
// the warp, tb_warp_prefix) are staged in the warp's slice; then the ids in order, lane b
// (and b + 32) owning the outputs (b, z): each term a sum over m ascending, added to the
// accumulator. With a cache (cap > 0) one launch is one pass of tb_rows_bwd's loop over
// the groups [glo, glo + cap), whose P the cache holds: a row's ids of those groups are a
// contiguous part of its list (u ascending, so g too: tb_warp_lower_bound finds it), the
// first pass (glo = 0) writes every row, a later one adds its part to the row it reads
// back (the same additions in the same order as one pass over the whole list); a later
// pass at glo >= num_groups returns at once. Without (cap == 0) one launch does every id.
template <int Q1C, int VEC, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg3_kernel(DD d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ d_rows, const int* __restrict__ g_i1,
                  const int* __restrict__ g_i2, const int* __restrict__ counts, int n,
                  const int* __restrict__ bounds3, const int* __restrict__ sorted_u,
                  const int* __restrict__ sg, const float* __restrict__ Pc, int glo, int cap,
                  int dvec, int* ctr, float* __restrict__ dg3) {
  TB_DYNAMIC_SMEM(tb_smem4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int CH = tb_dg3_chunk(d), slot = tb_dg3_slot(d), poff = tb_align4(d.M * d.ldP);
  float* G1s = reinterpret_cast<float*>(tb_smem4) + warp * tb_dg3_slice(d);
  float* S = G1s + tb_align4(d.Q1R1);  // [CH][slot]: P [M][ldP], then the d_rows row [D]
  __shared__ int s_u[kTbWarps][kTbDg3MaxChunk], s_g[kTbWarps][kTbDg3MaxChunk];
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  // every id of the pass: P from Pc (tb_pcache_kernel); no groups (a bad plan): P formed
  const bool cached = cap > 0 && G > 0;
  if (glo > 0 && glo >= G) return;  // a pass past the groups (the first writes every row)
  const int ghi = cached ? (int)min((long long)glo + cap, (long long)G) : G;
  const bool split = glo > 0 || ghi < G;  // the pass takes part of the groups
  const int P4 = d.PSZ / 4;               // float4s of a cached P (r2 % 4 == 0 when cap > 0)
  for (;;) {
    const int I = tb_warp_claim(ctr, lane);
    if (I >= d.p3) break;
    int lo = tb_clamp(bounds3[I], 0, n), hi = tb_clamp(bounds3[I + 1], lo, n);
    if (split) {
      lo = tb_warp_lower_bound(sg, lo, hi, glo, lane);
      hi = tb_warp_lower_bound(sg, lo, hi, ghi, lane);
      if (glo > 0 && lo == hi) continue;  // no id of this pass: the row stays
    }
    float acc[2][kTbQ3Max];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
#pragma unroll
      for (int z = 0; z < kTbQ3Max; ++z)
        acc[i][z] = glo > 0 && b < d.r2 && z < d.q3 ? dg3[(size_t)I * d.S3 + b * d.q3 + z] : 0.f;
    }
    int un = 0, gn = 0;  // lane < CH: the next chunk's id and group
    if (lane < min(CH, hi - lo)) {
      un = __ldg(sorted_u + lo + lane);
      gn = __ldg(sg + lo + lane);
    }
    for (int h0 = lo; h0 < hi; h0 += CH) {
      const int nc = min(CH, hi - h0);
      if (lane < nc) {
        s_u[warp][lane] = tb_clamp(un, 0, n - 1);
        s_g[warp][lane] = tb_clamp(gn, 0, gmax);
      }
      if (lane < min(CH, hi - h0 - CH)) {
        un = __ldg(sorted_u + h0 + CH + lane);
        gn = __ldg(sg + h0 + CH + lane);
      }
      __syncwarp();
      // the cached P (float4 items [0, nc*P4)) and, when dvec, the d_rows rows (float4
      // items after them), eight loads in flight per lane
      const int nP = nc * P4, nI = nP + (dvec ? nc * (d.D / 4) : 0);
      for (int base = lane; base < nI; base += 8 * 32) {
        float4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int e4 = base + 32 * j;
          if (e4 < nP) {
            const int k = e4 / P4, slot_g = tb_clamp(s_g[warp][k] - glo, 0, cap - 1);
            if (cached)
              v[j] = __ldg(reinterpret_cast<const float4*>(Pc + (size_t)slot_g * d.PSZ) +
                           (e4 - k * P4));
          } else if (e4 < nI) {
            const int k = (e4 - nP) / (d.D / 4), q = e4 - nP - k * (d.D / 4);
            v[j] = __ldg(reinterpret_cast<const float4*>(d_rows + (size_t)s_u[warp][k] * d.D) + q);
          }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int e4 = base + 32 * j;
          if (e4 < nP) {
            const int k = e4 / P4, q = e4 - k * P4;
            if (cached) {
              const int m = (4 * q) / d.r2, b = 4 * q - m * d.r2;
              float* dst = S + k * slot + m * d.ldP + b;
              dst[0] = v[j].x;
              dst[1] = v[j].y;
              dst[2] = v[j].z;
              dst[3] = v[j].w;
            }
          } else if (e4 < nI) {
            const int k = (e4 - nP) / (d.D / 4), q = e4 - nP - k * (d.D / 4);
            *reinterpret_cast<float4*>(S + k * slot + poff + 4 * q) = v[j];
          }
        }
      }
      if (!dvec) {
        for (int e = lane; e < nc * d.D; e += 32) {  // the d_rows rows, one float at a time
          const int k = e / d.D, o = e - k * d.D;
          S[k * slot + poff + o] = __ldg(d_rows + (size_t)s_u[warp][k] * d.D + o);
        }
      }
      for (int k = 0; k < nc; ++k) {  // the P not cached, formed by the warp
        const int g = s_g[warp][k];
        if (cached) break;
        __syncwarp();
        tb_warp_load_g1(d, g1, tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1), G1s, lane);
        __syncwarp();
        tb_warp_prefix<Q1C, VEC>(d, G1s,
                                 g2 + (size_t)tb_clamp(__ldg(g_i2 + g), 0, d.p2 - 1) * d.R1K,
                                 S + k * slot, lane);
      }
      __syncwarp();
      TB_BY_Q3(d.q3, tb_dg3_chunk_terms, d, S, slot, poff, nc, lane, acc);
      __syncwarp();  // the chunk's slots are read
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
      if (b < d.r2)
#pragma unroll
        for (int z = 0; z < kTbQ3Max; ++z)
          if (z < d.q3) dg3[(size_t)I * d.S3 + b * d.q3 + z] = acc[i][z];
    }
  }
}

}  // namespace
}  // namespace flowtt::tb
