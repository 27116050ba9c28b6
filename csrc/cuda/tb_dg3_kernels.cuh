// Table-batched rows kernels, backward: dg3 (sm_90), launched by cuda/tb_rows.cu after the
// kernels of cuda/tb_bwd_kernels.cuh (and on the CPU by the emulation test
// cuda/tb_rows_emu_test.cc); docs/batched_contract.md.
//
//   dg3[I] = sum over the unique indices u of I in ascending u of the term
//     P_{g(u)}^T . d_rows[u] ([r2][q3], each element a sum over m ascending). Where the dims
//     take the tile GEMM (tb_tile_geo): tb_dg3_terms_kernel writes every id's term in the
//     order of the groups (P of a batch of groups once, in shared memory), in passes of
//     `cap` ids when they do not all fit, and tb_dg3_sum_kernel adds them per g3 row in u
//     order; else tb_dg3_kernel, a warp per g3 row, forms each id's P itself.
#pragma once

#include "cuda/mma_tf32.cuh"
#include "cuda/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

// ------------------------------- backward: the dg3 terms ---------------------------

// P of a batch on tensor cores (tb_p_mma dims): A = the batch's g1 rows Am [rows][r1 + 4]
// (row (k, x1) = g1 row x1 of the batch's group k; rows past nR are 0), B = the g2 row G2m
// [r1][K + 8]; warp w takes the items (16 rows, 32 columns) w, w + kTbWarps, ..., each
// element the sum over r1 in k-steps of 8 ascending, each k-step's 3xTF32 product added in
// float32 (tb_mma_3xtf32; a row's bits do not depend on the batch around it), stored as
// float2 to Ps[k][x1][col] (PSZ floats per group).
template <class DD>
__device__ __forceinline__ void tb_batch_P_mma(const DD& d, int nR, const float* Am,
                                               const float* G2m, float* Ps) {
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
      float* dst = Ps + k * d.PSZ + x1 * d.K + n0 + 2 * t;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
    }
  }
}

// E[u - ulo] = the dg3 term of unique index u, P_{g(u)}^T . d_rows[u] as [r2][Q3] (element
// (b, z) = sum_m P[m][b] d_rows[u][m][z] by fmaf over m ascending from 0, the chain of
// tb_dg3_chunk_terms), for the u in [ulo, ulo + cap) below num_unique: one pass of
// tb_rows_bwd's dg3 loop; returns at once when ulo >= num_unique. Blocks steal packed g2
// rows I (ctr); the g2 row is staged once for the groups of I (sorted_groups[bounds2[I] ..
// bounds2[I+1])) holding ids of the pass, in batches of up to geo.GB: P of a batch by one
// GEMM into Ps [GB][M][r2] (smem tb_dg3_terms_smem), on tensor cores for tb_p_mma dims
// (tb_batch_P_mma: deterministic, not the bits of the FMA chain), else by the FMA tiles of
// tb_batch_P (every element fmaf(g1[x1][a], g2[a][j], acc) over a ascending: bitwise the
// P of tb_dg3_kernel), then a thread per (id of the batch, b) writes E[u][b][0..Q3).
// Q3 = q3, 4 or 8; d_rows and E 16-byte aligned.
template <int Q3, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg3_terms_kernel(DD d, TbTileGeo geo, const float* __restrict__ g1,
                        const float* __restrict__ g2, const float* __restrict__ d_rows,
                        const int* __restrict__ g_i1, const int* __restrict__ goffs,
                        const int* __restrict__ counts, int n, const int* __restrict__ bounds2,
                        const int* __restrict__ sorted_groups, int ulo, int cap, int* ctr,
                        float* __restrict__ E) {
  TB_DYNAMIC_SMEM(tb_smem4);
  float* smem = reinterpret_cast<float*>(tb_smem4);
  const bool mma = tb_p_mma(d);
  float* G2s = smem;  // [r1][K] ([r1][K + 8] on the mma path)
  float* As = G2s + (mma ? d.r1 * (d.K + 8) : tb_align4(d.R1K));  // As [r1][ldA] or Am
  float* Ps = smem + tb_dg3_terms_ps(d, geo);                     // [GB][M][r2]
  __shared__ int s_item, s_nb, s_w;
  __shared__ int s_a[kTbTileGroups], s_pref[kTbTileGroups], s_i1[kTbTileGroups];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int U, G;
  tb_counts(counts, n, U, G);
  if (ulo >= U) return;
  const int uhi = (int)min((long long)ulo + cap, (long long)U), gmax = max(G - 1, 0);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.p2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    bool staged = false;
    for (int j0 = lo; j0 < hi; j0 += geo.GB) {
      const int nc = min(geo.GB, hi - j0);
      __syncthreads();  // the previous batch's As / Ps are read
      if (warp == 0) {  // the batch's groups with ids in the pass, compacted; their ids' scan
        int cnt = 0, a = 0, g = 0;
        if (lane < nc) {
          g = tb_clamp(__ldg(sorted_groups + j0 + lane), 0, gmax);
          int gs, ge;
          tb_group_range(goffs, g, U, gs, ge);
          a = max(gs, ulo);
          cnt = max(min(ge, uhi) - a, 0);
        }
        const unsigned kept = __ballot_sync(0xffffffffu, cnt > 0);
        int incl = cnt;
        for (int off = 1; off < 32; off <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, off);
          if (lane >= off) incl += v;
        }
        if (cnt > 0) {
          const int pos = __popc(kept & ((1u << lane) - 1u));
          s_a[pos] = a;
          s_pref[pos] = incl - cnt;
          s_i1[pos] = tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1);
        }
        if (lane == 31) s_w = incl;
        if (lane == 0) s_nb = __popc(kept);
      }
      __syncthreads();
      const int nb = s_nb;
      if (nb == 0) continue;
      if (!staged) {
        const float4* src = reinterpret_cast<const float4*>(g2 + (size_t)I * d.R1K);
        for (int i = tid; i < d.R1K / 4; i += kTbThreads) {
          const int a = mma ? 4 * i / d.K : 0;  // [r1][K + 8] rows on the mma path
          reinterpret_cast<float4*>(G2s + 8 * a)[i] = __ldg(src + i);
        }
        staged = true;
      }
      if (mma) {
        const int nR = nb * d.q1, rows = (nR + 15) / 16 * 16;
        for (int e = tid; e < rows * d.r1; e += kTbThreads) {  // Am [rows][r1 + 4]
          const int row = e / d.r1, a = e - row * d.r1;
          float v = 0.f;
          if (row < nR) {
            const int k = row / d.q1;
            v = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + (row - k * d.q1) * d.r1 + a);
          }
          As[row * (d.r1 + 4) + a] = v;
        }
        __syncthreads();
        tb_batch_P_mma(d, nR, As, G2s, Ps);
      } else {
        tb_batch_P(d, g1, s_i1, nb, geo.ldA, As, G2s,
                   [&](int row0, int c4, int nR, const float (&acc)[kTbRPT][4]) {
#pragma unroll
                     for (int i = 0; i < kTbRPT; ++i) {
                       const int row = row0 + i;
                       if (row < nR)
                         *reinterpret_cast<float4*>(Ps + row * d.K + 4 * c4) =
                             make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
                     }
                   });
      }
      __syncthreads();
      const int W = s_w;
      for (int it = tid; it < W * d.r2; it += kTbThreads) {  // E[u][b][0..Q3) of one id
        const int uq = it / d.r2, b = it - uq * d.r2;
        int k = 0;  // the last group of the batch with s_pref[k] <= uq
        for (int step = kTbTileGroups / 2; step > 0; step >>= 1)
          if (k + step < nb && s_pref[k + step] <= uq) k += step;
        const int u = s_a[k] + (uq - s_pref[k]);
        const float* P = Ps + k * d.PSZ + b;
        const float4* dr = reinterpret_cast<const float4*>(d_rows + (size_t)u * d.D);
        float c[Q3];
#pragma unroll
        for (int z = 0; z < Q3; ++z) c[z] = 0.f;
        for (int m = 0; m < d.M; ++m) {
          const float p = P[m * d.r2];
#pragma unroll
          for (int h = 0; h < Q3 / 4; ++h) {
            const float4 v = __ldg(dr + m * (Q3 / 4) + h);
            c[4 * h] = fmaf(p, v.x, c[4 * h]);
            c[4 * h + 1] = fmaf(p, v.y, c[4 * h + 1]);
            c[4 * h + 2] = fmaf(p, v.z, c[4 * h + 2]);
            c[4 * h + 3] = fmaf(p, v.w, c[4 * h + 3]);
          }
        }
        float4* out = reinterpret_cast<float4*>(E + (size_t)(u - ulo) * d.S3 + b * Q3);
#pragma unroll
        for (int h = 0; h < Q3 / 4; ++h)
          out[h] = make_float4(c[4 * h], c[4 * h + 1], c[4 * h + 2], c[4 * h + 3]);
      }
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

// float4s of a g3 row per lane in tb_dg3_sum_kernel: ceil(S3 / 128), at most 4.
template <class DD>
__host__ __device__ constexpr int tb_dg3_sum_nj() {
  if constexpr (DD::kFixed)
    return (DD::S3 / 4 + 31) / 32;
  else
    return kTbRMax * kTbQ3Max / 128;
}

// dg3[I] (+)= sum over the ids u of I in [ulo, ulo + cap) below num_unique, in ascending u,
// of their terms E[u - ulo] (tb_dg3_terms_kernel): a warp per g3 row (work stealing by
// warps), the row's ids of the pass a contiguous part of its list (sorted_u[bounds3[I] ..
// bounds3[I+1]), u ascending: tb_warp_lower_bound), lane l owning the float4s l, l + 32, ...
// of the row's S3 outputs, four ids' terms in flight. The first pass (ulo = 0) writes every
// row, a later one adds its part to the row it reads back: the additions of tb_dg3_kernel
// over the whole list, in its order. A pass at ulo >= num_unique returns at once.
template <class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg3_sum_kernel(DD d, const float* __restrict__ E, const int* __restrict__ counts, int n,
                      const int* __restrict__ bounds3, const int* __restrict__ sorted_u, int ulo,
                      int cap, int* ctr, float* __restrict__ dg3) {
  constexpr int NJ = tb_dg3_sum_nj<DD>();
  const int lane = threadIdx.x & 31, S4 = d.S3 / 4;
  int U, G;
  tb_counts(counts, n, U, G);
  if (ulo > 0 && ulo >= U) return;
  const int uhi = (int)min((long long)ulo + cap, (long long)U);
  for (;;) {
    const int I = tb_warp_claim(ctr, lane);
    if (I >= d.p3) break;
    int lo = tb_clamp(bounds3[I], 0, n), hi = tb_clamp(bounds3[I + 1], lo, n);
    lo = tb_warp_lower_bound(sorted_u, lo, hi, ulo, lane);
    hi = tb_warp_lower_bound(sorted_u, lo, hi, uhi, lane);
    if (ulo > 0 && lo == hi) continue;  // no id of this pass: the row stays
    float4* row = reinterpret_cast<float4*>(dg3 + (size_t)I * d.S3);
    float4 acc[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int e = lane + 32 * j;
      acc[j] = ulo > 0 && e < S4 ? row[e] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int h0 = lo; h0 < hi; h0 += 32) {
      const int nh = min(32, hi - h0);
      const int mine = lane < nh ? tb_clamp(__ldg(sorted_u + h0 + lane), ulo, uhi - 1) - ulo : 0;
      for (int k0 = 0; k0 < nh; k0 += 4) {
        float4 v[4][NJ];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int u = __shfl_sync(0xffffffffu, mine, (k0 + k) & 31);
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            const int e = lane + 32 * j;
            if (k0 + k < nh && e < S4)
              v[k][j] = __ldg(reinterpret_cast<const float4*>(E + (size_t)u * d.S3) + e);
          }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int j = 0; j < NJ; ++j)
            if (k0 + k < nh) {
              acc[j].x += v[k][j].x;
              acc[j].y += v[k][j].y;
              acc[j].z += v[k][j].z;
              acc[j].w += v[k][j].w;
            }
      }
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j < S4) row[lane + 32 * j] = acc[j];
  }
}

// dg3[I] = sum over the unique indices u of I in ascending u (sorted_u[bounds3[I] ..
// bounds3[I+1]), a stable sort by u_i3) of P_{g(u)}^T . d_rows[u], for dims without the
// terms path (one launch does every id). A warp per g3 row (work stealing by warps): the
// row's ids in chunks of tb_dg3_chunk(d), the next chunk's ids and groups (sg,
// tb_sorted_groups_kernel) read ahead; per chunk each id's d_rows row is staged in the
// warp's slice and its P formed there by the warp (tb_warp_prefix); then the ids in order,
// lane b (and b + 32) owning the outputs (b, z): each term a sum over m ascending, added
// to the accumulator.
template <int Q1C, int VEC, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg3_kernel(DD d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ d_rows, const int* __restrict__ g_i1,
                  const int* __restrict__ g_i2, const int* __restrict__ counts, int n,
                  const int* __restrict__ bounds3, const int* __restrict__ sorted_u,
                  const int* __restrict__ sg, int dvec, int* ctr, float* __restrict__ dg3) {
  TB_DYNAMIC_SMEM(tb_smem4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int CH = tb_dg3_chunk(d), slot = tb_dg3_slot(d), poff = tb_align4(d.M * d.ldP);
  float* G1s = reinterpret_cast<float*>(tb_smem4) + warp * tb_dg3_slice(d);
  float* S = G1s + tb_align4(d.Q1R1);  // [CH][slot]: P [M][ldP], then the d_rows row [D]
  __shared__ int s_u[kTbWarps][kTbDg3MaxChunk], s_g[kTbWarps][kTbDg3MaxChunk];
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  for (;;) {
    const int I = tb_warp_claim(ctr, lane);
    if (I >= d.p3) break;
    const int lo = tb_clamp(bounds3[I], 0, n), hi = tb_clamp(bounds3[I + 1], lo, n);
    float acc[2][kTbQ3Max];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int z = 0; z < kTbQ3Max; ++z) acc[i][z] = 0.f;
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
      if (dvec) {  // the d_rows rows, float4s
        for (int e4 = lane; e4 < nc * (d.D / 4); e4 += 32) {
          const int k = e4 / (d.D / 4), q = e4 - k * (d.D / 4);
          *reinterpret_cast<float4*>(S + k * slot + poff + 4 * q) =
              __ldg(reinterpret_cast<const float4*>(d_rows + (size_t)s_u[warp][k] * d.D) + q);
        }
      } else {
        for (int e = lane; e < nc * d.D; e += 32) {  // one float at a time
          const int k = e / d.D, o = e - k * d.D;
          S[k * slot + poff + o] = __ldg(d_rows + (size_t)s_u[warp][k] * d.D + o);
        }
      }
      for (int k = 0; k < nc; ++k) {  // each id's P, formed by the warp
        const int g = s_g[warp][k];
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
