// The prefix product P = G1[i1] . G2[i2] ([q1*q2, r2] per prefix group), shared by the
// forward and backward tile kernels: warp_compute_P (a warp per group, the warp
// kernels) and tile_gemm_P (a batch of groups as one shared-memory GEMM, the GEMM
// tile kernels).
#pragma once

#include "common/common.cuh"

namespace flowtt {

constexpr int kJ = 4;  // columns per lane in warp_compute_P

// One warp forms P for one group: lanes own columns j = (q2, b) (kJ per
// lane) and all q1 rows, so each G2 element read from shared memory feeds
// q1 FMAs and each (broadcast) G1 element kJ FMAs.
template <int Q1C>
__device__ __forceinline__ void warp_compute_P(const Dev& d, const float* G1w, const float* G2s,
                                               int ld2, float* Pw, int lane) {
  const int Q2R2 = d.q2 * d.r2;
  for (int j0 = 0; j0 < Q2R2; j0 += 32 * kJ) {
    constexpr int NQ1 = Q1C ? Q1C : kQ1Max;
    float acc[kJ][NQ1];
    zero_fill(acc);
#pragma unroll 2
    for (int a = 0; a < d.r1; ++a) {
      float g2v[kJ];
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj) {
        const int j = j0 + jj * 32 + lane;
        g2v[jj] = (j < Q2R2) ? G2s[a * ld2 + j] : 0.f;
      }
#pragma unroll
      for (int q1 = 0; q1 < NQ1; ++q1) {
        if (Q1C || q1 < d.q1) {
          const float g1v = G1w[q1 * d.r1 + a];
#pragma unroll
          for (int jj = 0; jj < kJ; ++jj) acc[jj][q1] = fmaf(g1v, g2v[jj], acc[jj][q1]);
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj) {
      const int j = j0 + jj * 32 + lane;
      if (j < Q2R2) {
        const int q2 = j / d.r2, b = j - q2 * d.r2;
#pragma unroll
        for (int q1 = 0; q1 < NQ1; ++q1)
          if (Q1C || q1 < d.q1) Pw[(q1 * d.q2 + q2) * d.R2p + b] = acc[jj][q1];
      }
    }
  }
}

// A warp's P of a group of row i1: G1[i1] staged in the warp's slice G1w, then
// warp_compute_P into Pw (G2s: G2[i2] with row stride ld2).
template <int Q1C>
__device__ __forceinline__ void warp_group_P(const Dev& d, const float* __restrict__ g1, int i1,
                                             float* G1w, const float* G2s, int ld2, float* Pw,
                                             int lane) {
  const float* g1s = g1 + (size_t)i1 * d.Q1R1;
  for (int i = lane; i < d.Q1R1; i += 32) G1w[i] = __ldg(g1s + i);
  __syncwarp();
  warp_compute_P<Q1C>(d, G1w, G2s, ld2, Pw, lane);
  __syncwarp();
}

// P of the nR rows (group k, q1) of a batch = A . G2, R x 4 outputs per thread
// (float4 loads of A^T and G2 from shared memory), stored as Ps[k][m][b] (m = q1*q2
// index, group stride PT) when ldm == 0, else transposed as Ps[k][b][m] with row stride
// ldm (the forward's layout). As: [r1][ldA] (ldA a multiple of 8), G2s: [r1][ldB].
template <int R, int NT>
__device__ __forceinline__ void tile_gemm_P_rows(const Dev& d, const float* As, int ldA,
                                                 const float* G2s, int ldB, int nR, float* Ps,
                                                 int PT, int ldm) {
  const int NC4 = d.q2 * d.r2 / 4;
  const int nRB = (nR + R - 1) / R;
  for (int it = threadIdx.x; it < NC4 * nRB; it += NT) {
    const int rb = it / NC4, c4 = it - rb * NC4;
    float acc[R][4];
    tile_fma_rows<R>(As + rb * R, ldA, G2s + c4 * 4, ldB, d.r1, acc);
    const int q2 = (c4 * 4) / d.r2, b0 = c4 * 4 - q2 * d.r2;  // r2 % 4 == 0
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = rb * R + i;
      if (row < nR) {
        const int k = row / d.q1, m = (row - k * d.q1) * d.q2 + q2;
        if (ldm == 0) {
          *reinterpret_cast<float4*>(Ps + k * PT + m * d.r2 + b0) =
              make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) Ps[k * PT + (b0 + j) * ldm + m] = acc[i][j];
        }
      }
    }
  }
}

// tile_gemm_P_rows with R rows a thread: kRPT, or 4 where kRPT gives fewer items than
// threads; then 6 where that takes fewer row steps a thread (rounds of NT items times R)
// and the rows it reads stay within ldA. D128 r64's forward batch (24 rows x 64 column
// quads) takes 256 items of 6 rows for 256 threads, where 8 rows left 64 threads idle and
// 4 took two rounds on half of them. Every output is the same fmaf chain for any R: same
// bits.
#ifndef FLOWTT_P_ROWS4  // tuning knobs: 0 = never 4 / 6 rows a thread
#define FLOWTT_P_ROWS4 1
#endif
#ifndef FLOWTT_P_ROWS6
#define FLOWTT_P_ROWS6 1
#endif
template <int NT = kGT>
__device__ __forceinline__ void tile_gemm_P(const Dev& d, const float* As, int ldA,
                                            const float* G2s, int ldB, int nR, float* Ps, int PT,
                                            int ldm = 0) {
  const int NC4 = d.q2 * d.r2 / 4;
  auto items = [&](int R) { return NC4 * ((nR + R - 1) / R); };
  auto steps = [&](int R) { return (items(R) + NT - 1) / NT * R; };
  const int R = FLOWTT_P_ROWS4 && items(kRPT) < NT ? 4 : kRPT;
  if (FLOWTT_P_ROWS6 && (nR + 5) / 6 * 6 <= ldA && steps(6) < steps(R))
    tile_gemm_P_rows<6, NT>(d, As, ldA, G2s, ldB, nR, Ps, PT, ldm);
  else if (R == 4)
    tile_gemm_P_rows<4, NT>(d, As, ldA, G2s, ldB, nR, Ps, PT, ldm);
  else
    tile_gemm_P_rows<kRPT, NT>(d, As, ldA, G2s, ldB, nR, Ps, PT, ldm);
}

}  // namespace flowtt
