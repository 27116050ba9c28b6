// Table-batched backward, dg2 and the dg1 terms E on tensor cores (cuda/batched/mma_tf32.cuh:
// 3xTF32 mma.sync, float32 accuracy), launched by cuda/batched/tb_rows.cu for the dims
// tb_dg2_mma_tiles accepts (r1 and K = q2*r2 multiples of 16, the [r1][K] row at most
// kTbMmaMaxTiles 16x8 tiles per warp; the Meta-like (2, 4, 4) r32 and DLRM's (2, 2, 4) r16
// shapes), else tb_dg2_kernel (cuda/batched/tb_bwd_kernels.cuh) does the same work on the FMA
// pipes. The same blocks and batches as tb_dg2_kernel: a block per g2 row I over its
// groups (sorted by g_i2, stable: ascending g) in batches of up to nbatch; per batch dP of
// each group (tb_block_dP_staged, rows (group, x1) at stride K + 8; the terms of each
// staging round on tensor cores too, tb_mma_dP_round, when q3 is 4 or 8 and r2 % 16 == 0),
// then
//   dg2[I] += G1^T . dP: A = the batch's g1 rows transposed ([r1][nb*q1], G1t rows
//     (group, x1) at stride r1 + 8), B = dP ([nb*q1][K]); each warp keeps its tiles of
//     the row in registers across batches (k-steps of 8 rows (group, x1) ascending);
//   E[g] = dP_g . g2[I]^T (when 0 <= num_groups <= e_cap): M = the rows (group, x1), N =
//     r1, the K = q2*r2 products in k-steps of 8 ascending.
// Each k-step's 3xTF32 product is added to its accumulator in float32 (tb_mma_3xtf32).
// The strides put the fragments' shared-memory reads at distinct banks. Deterministic
// (a fixed sequence of products, no atomics), not bitwise tb_dg2_kernel's.
#pragma once

#include "batched/mma_tf32.cuh"
#include "batched/tb_rows.cuh"

namespace flowtt::tb {

constexpr int kTbMmaMaxTiles = 4;  // dg2 accumulator tiles per warp (16 floats per lane)

// The dg2 row's 16x8 tiles per warp (r1/16 * K/8 tiles over kTbWarps warps, a warp's
// tiles consecutive in one tile row), 0 when the dims do not take the tensor-core path.
template <class DD>
__host__ __device__ inline int tb_dg2_mma_tiles(const DD& d) {
#ifdef FLOWTT_TB_DG2_NO_MMA  // harness A/B: tb_dg2_kernel for every shape
  return 0;
#endif
  if (d.r1 % 16 != 0 || d.K % 16 != 0) return 0;
  const int nn = d.K / 8, tiles = (d.r1 / 16) * nn;
  const int per = (tiles + kTbWarps - 1) / kTbWarps;
  return per <= kTbMmaMaxTiles && nn % per == 0 ? per : 0;
}

// Whether the dP rounds run on tensor cores too (tb_mma_dP_round), else the FMA round.
template <class DD>
__host__ __device__ inline bool tb_dg2_mma_dp(const DD& d) {
  return (d.q3 == 4 || d.q3 == 8) && d.r2 % 16 == 0;
}

// Rows (group, x1) of the batch buffers: nbatch * q1 rounded up to E's 16-row tiles.
template <class DD>
__host__ __device__ inline int tb_dg2_mma_rows(const DD& d, int nbatch) {
  return (nbatch * d.q1 + 15) / 16 * 16;
}

// Shared memory: the g2 row [r1][K + 8] (with E), G1t [rows][r1 + 8], dP [rows][K + 8],
// then tb_block_dP_staged's staging.
template <class DD>
inline size_t tb_dg2_mma_smem(const DD& d, bool with_e, int nbatch) {
  const size_t rows = (size_t)tb_dg2_mma_rows(d, nbatch);
  return sizeof(float) *
             ((with_e ? (size_t)d.r1 * (d.K + 8) : 0) + rows * (d.r1 + 8) + rows * (d.K + 8)) +
         tb_stage_bytes(d);
}

// Groups per batch: kTbBatch when that leaves room for three blocks per SM (74 KB), else 8.
template <class DD>
inline int tb_dg2_mma_batch(const DD& d, bool with_e) {
  return tb_dg2_mma_smem(d, with_e, kTbBatch) <= size_t{74} * 1024 ? kTbBatch : 8;
}

namespace {  // internal linkage: one copy per including file

// One round of tb_block_dP_staged on tensor cores (q3 = Q3 in {4, 8}, r2 % 16 == 0):
// warp w takes the groups k = w, w + kTbWarps, ...; dP_k^T [r2][M] += A . B over the
// round's ids of k, A[b][(i, z)] = g3 row of id i at (b, z), B[(i, z)][m] = its d_rows row
// at (m, z), in k-steps of 8 / Q3 ids (ascending; past the group's last id 0), each tile
// read from and written back to dPs (rows (k, x1) at stride ldq) between the rounds.
template <int Q3, class DD>
__device__ __forceinline__ void tb_mma_dP_round(const DD& d, int nb, int p0, int nr,
                                                const int* s_pre, const float* Stg, int ldq,
                                                float* dPs) {
  constexpr int IPS = 8 / Q3;  // ids per k-step
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int ld = tb_stage_ld(d), ldD = tb_align4(d.D);
  auto at = [&](int k, int b, int m) {  // dP_k element (m, b) in dPs
    const int x1 = m / d.q2;
    return (k * d.q1 + x1) * ldq + (m - x1 * d.q2) * d.r2 + b;
  };
  for (int k = warp; k < nb; k += kTbWarps) {
    const int lo = max(s_pre[k], p0) - p0, hi = min(s_pre[k + 1], p0 + nr) - p0;
    if (lo >= hi) continue;  // warp-uniform
    for (int b0 = 0; b0 < d.r2; b0 += 16) {
      for (int m0 = 0; m0 < d.M; m0 += 8) {
        float c[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = m0 + 2 * t + i % 2;
          c[i] = m < d.M ? dPs[at(k, b0 + g + 8 * (i / 2), m)] : 0.f;
        }
        const int mB = m0 + g;
        for (int i0 = lo; i0 < hi; i0 += IPS) {
          auto A = [&](int b, int kk) {
            const int i = i0 + kk / Q3;
            return i < hi ? Stg[i * ld + ldD + b * Q3 + kk % Q3] : 0.f;
          };
          auto B = [&](int kk) {
            const int i = i0 + kk / Q3;
            return i < hi && mB < d.M ? Stg[i * ld + mB * Q3 + kk % Q3] : 0.f;
          };
          const TbTf32 a[4] = {tb_split_tf32(A(b0 + g, t)), tb_split_tf32(A(b0 + g + 8, t)),
                               tb_split_tf32(A(b0 + g, t + 4)),
                               tb_split_tf32(A(b0 + g + 8, t + 4))};
          const TbTf32 bf[2] = {tb_split_tf32(B(t)), tb_split_tf32(B(t + 4))};
          tb_mma_3xtf32(c, a, bf);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = m0 + 2 * t + i % 2;
          if (m < d.M) dPs[at(k, b0 + g + 8 * (i / 2), m)] = c[i];
        }
      }
    }
  }
}

template <class DD>
__global__ void __launch_bounds__(kTbThreads, 3)
    tb_dg2_mma_kernel(DD d, const float* __restrict__ g1, const float* __restrict__ g2,
                      const float* __restrict__ g3, const float* __restrict__ d_rows,
                      const int* __restrict__ u_i3, const int* __restrict__ g_i1,
                      const int* __restrict__ goffs, const int* __restrict__ counts, int n,
                      const int* __restrict__ bounds2, const int* __restrict__ sorted_groups,
                      int e_cap, int stage_vec, int nbatch, int* ctr, float* __restrict__ dg2,
                      float* __restrict__ E) {
  TB_DYNAMIC_SMEM(tb_smem4);
  int U, G;
  tb_counts(counts, n, U, G);
  const bool with_e = E != nullptr && G <= e_cap;
  const int ldq = d.K + 8, ldA = d.r1 + 8, kr = tb_dg2_mma_rows(d, nbatch);
  float* G2s = reinterpret_cast<float*>(tb_smem4);  // [r1][ldq] (with_e)
  float* G1t = G2s + (with_e ? d.r1 * ldq : 0);     // [kr][ldA]: row (k, x1) = g1 row x1 of k
  float* dPs = G1t + kr * ldA;                      // [kr][ldq]: row (k, x1) of dP_k
  float* Stg = dPs + kr * ldq;                      // tb_block_dP_staged's
  __shared__ int s_item, s_gs[kTbBatch], s_ge[kTbBatch], s_i1[kTbBatch], s_g[kTbBatch];
  __shared__ int s_pre[kTbBatch + 1], s_u[kTbStageMaxIds], s_i3[kTbStageMaxIds];
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
  const int per = tb_dg2_mma_tiles(d), nn = d.K / 8, tile0 = warp * per;
  const bool has_tiles = tile0 < (d.r1 / 16) * nn;  // warp-uniform
  const int m0 = (tile0 / nn) * 16, n0 = (tile0 % nn) * 8;
  const int gmax = max(G - 1, 0);
  const bool mma_dp = tb_dg2_mma_dp(d);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.p2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    float c[kTbMmaMaxTiles][4];
    zero_fill(c);
    if (with_e && lo < hi) tb_stage_g2_row(d, g2, I, ldq, G2s);
    for (int j0 = lo; j0 < hi; j0 += nbatch) {
      const int nb = min(nbatch, hi - j0), rows = nb * d.q1;
      __syncthreads();  // the previous batch's G1t / dPs are read
      tb_load_batch_groups(d, sorted_groups, goffs, g_i1, j0, nb, gmax, U, s_gs, s_ge, s_i1, s_g);
      __syncthreads();
      for (int e = tid; e < kr * d.r1; e += kTbThreads) {  // G1t, rows past the batch's 0
        const int row = e / d.r1, a = e - row * d.r1;
        float v = 0.f;
        if (row < rows) {
          const int k = row / d.q1;
          v = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + (row - k * d.q1) * d.r1 + a);
        }
        G1t[row * ldA + a] = v;
      }
      for (int e = tid; e < (kr - rows) * ldq; e += kTbThreads) dPs[rows * ldq + e] = 0.f;
      // dP (ends with a barrier: G1t and dPs complete)
      tb_block_dP_staged(d, nb, s_gs, s_ge, s_pre, s_u, s_i3, Stg, stage_vec != 0, u_i3, g3, d_rows,
                         dPs, ldq, [&](int p0, int nr) {
                           if (mma_dp && d.q3 == 4)
                             tb_mma_dP_round<4>(d, nb, p0, nr, s_pre, Stg, ldq, dPs);
                           else if (mma_dp)
                             tb_mma_dP_round<8>(d, nb, p0, nr, s_pre, Stg, ldq, dPs);
                           else
                             TB_BY_Q3(d.q3, tb_stage_dP_round, d, nb, p0, nr, s_pre, Stg, ldq, dPs);
                         });
      if (has_tiles) {
        for (int s0 = 0; s0 < rows; s0 += 8) {  // dg2 += A . B, A[a][row] = G1t[row][a]
          const float* ap = G1t + (s0 + t) * ldA + m0 + g;
          const TbTf32 a[4] = {tb_split_tf32(ap[0]), tb_split_tf32(ap[8]),
                               tb_split_tf32(ap[4 * ldA]), tb_split_tf32(ap[4 * ldA + 8])};
          const float* bp = dPs + (s0 + t) * ldq + n0 + g;
#pragma unroll
          for (int i = 0; i < kTbMmaMaxTiles; ++i) {
            if (i < per) {
              const TbTf32 b[2] = {tb_split_tf32(bp[8 * i]), tb_split_tf32(bp[4 * ldq + 8 * i])};
              tb_mma_3xtf32(c[i], a, b);
            }
          }
        }
      }
      if (with_e) {  // E rows (k, x1) < rows; k-step positions t, t + 4 = columns 2t, 2t + 1
        const int ntn = d.r1 / 8, tiles = (rows + 15) / 16 * ntn;
        for (int te = warp; te < tiles; te += kTbWarps) {
          const int em0 = (te / ntn) * 16, en0 = (te % ntn) * 8;
          float ce[4] = {0.f, 0.f, 0.f, 0.f};
          const float* ap = dPs + (em0 + g) * ldq + 2 * t;
          const float* bp = G2s + (en0 + g) * ldq + 2 * t;
          for (int j = 0; j < d.K; j += 8) {
            const float2 x0 = *reinterpret_cast<const float2*>(ap + j);
            const float2 x1 = *reinterpret_cast<const float2*>(ap + 8 * ldq + j);
            const float2 y = *reinterpret_cast<const float2*>(bp + j);
            const TbTf32 a[4] = {tb_split_tf32(x0.x), tb_split_tf32(x1.x), tb_split_tf32(x0.y),
                                 tb_split_tf32(x1.y)};
            const TbTf32 b[2] = {tb_split_tf32(y.x), tb_split_tf32(y.y)};
            tb_mma_3xtf32(ce, a, b);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = em0 + g + 8 * h;
            if (row < rows) {
              const int k = row / d.q1;
              float* o = E + (size_t)s_g[k] * d.Q1R1 + (row - k * d.q1) * d.r1 + en0 + 2 * t;
              *reinterpret_cast<float2*>(o) = make_float2(ce[2 * h], ce[2 * h + 1]);
            }
          }
        }
      }
    }
    if (has_tiles) {
#pragma unroll
      for (int i = 0; i < kTbMmaMaxTiles; ++i) {
        if (i < per) {
          float* o = dg2 + (size_t)I * d.R1K + (m0 + g) * d.K + n0 + 8 * i + 2 * t;
          *reinterpret_cast<float2*>(o) = make_float2(c[i][0], c[i][1]);
          *reinterpret_cast<float2*>(o + 8 * d.K) = make_float2(c[i][2], c[i][3]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace flowtt::tb
