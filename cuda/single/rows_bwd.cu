// Backward rows (flowtt_tt_rows_bwd), the tile stage and the dG1 / dG2 reductions;
// every reduction in a fixed order (bitwise reproducible, no float atomics):
//   tile kernel (i2 column x kT1B i1 values, G2[i2] in shared memory): per group P
//     (kept for the dG3 pass), dP = sum_u dRow_u G3[i3_u]^T and the group's dG1
//     partial dP.G2^T; then the tile's dG2 partial sum_k G1[i1_k]^T dP_k (groups in
//     i1 order), added into dG2[i2] in its column's turn (dg2_in_turn): dG2[i2]
//     is the sum from 0.f of the column's tile partials, i1 blocks in order.
//     rows_bwd_gemm_kernel is the fast path (shapes of the GEMM table in
//     cuda/single/shape_dispatch.cuh), rows_bwd_tile_kernel (a warp per group) the fallback.
//   dg1_reduce: dG1[i1] = sum of the group partials of i1, i2 ascending.
// dG3 is the next stage (cuda/single/dg3.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "common/common.cuh"
#include "single/prefix_product.cuh"
#include "single/scratch.h"
#include "single/shape_dispatch.cuh"
#include "single/snake_slots.cuh"
#include "single/stages.h"

// The dP loop of the GEMM tile kernel asks L2 for the d_rows line of the id this many ahead
// (d_rows is mostly in HBM): harness rows backward S1 0.295 -> 0.286 ms (2 ahead: the same).
#ifndef FLOWTT_BWD_PREFETCH  // tuning knob; 0: no prefetch
#define FLOWTT_BWD_PREFETCH 1
#endif
#ifndef FLOWTT_BWD_MINB  // tuning knob: CTAs per SM the compiler targets
#define FLOWTT_BWD_MINB 3
#endif
#ifndef FLOWTT_BWD_SMEM_KB  // shared-memory cap of the GEMM kernel's batch past 110 KB
#define FLOWTT_BWD_SMEM_KB 224
#endif
#ifndef FLOWTT_BWD_WIDE  // threads of the GEMM kernel's CTA where shared memory fits one per SM
#define FLOWTT_BWD_WIDE 512
#endif

namespace flowtt {
namespace {

constexpr int kKC = 16;  // K rows per dG2 staging chunk of the warp tile kernel
// Shared memory of a GEMM kernel CTA that leaves room for more than one per SM; past it
// (a batch of one group does not fit) the CTA runs alone on its SM, FLOWTT_BWD_WIDE threads.
constexpr int kBwdSharedSmem = 110 * 1024;

// The turns of dG2[i2]: tile (k, i2) (t = k*p2 + i2, i1 block k) adds its partial when
// turn[i2] == k, then passes the turn on, so dG2[i2] = ((0.f + part_0) + part_1) + ...
// (an empty tile adds nothing; tile 0 writes 0.f + its part, or zeros). Tiles are claimed
// in increasing t, and a CTA claims only past the tile it works on, so the smallest
// unfinished tile is always being worked on and its column's turn has come: no deadlock.
// Every thread of the block calls these.
__device__ __forceinline__ void await_turn(const int* turn, int k) {
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<const volatile int*>(turn) != k) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}
__device__ __forceinline__ void pass_turn(int* turn, int k) {
  __threadfence();  // this thread's dG2 stores before the next tile's loads
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(turn, k + 1);
}
// dG2 element(s) `at` plus part (tile k of its column, in its turn; an L2 load: another SM
// wrote it).
__device__ __forceinline__ float dg2_in_turn(const float* at, int k, float part) {
  return (k > 0 ? __ldcg(at) : 0.f) + part;
}
__device__ __forceinline__ float4 dg2_in_turn(const float4* at, int k, float4 part) {
  const float4 c = k > 0 ? __ldcg(at) : make_float4(0.f, 0.f, 0.f, 0.f);
  return make_float4(c.x + part.x, c.y + part.y, c.z + part.z, c.w + part.w);
}
// An empty tile's turn: tile 0 of the column writes its zeros.
__device__ __forceinline__ void empty_tile_turn(const Dev& d, int* turn, int k, int i2,
                                                float* __restrict__ dg2) {
  await_turn(turn, k);
  if (k == 0)
    for (int i = threadIdx.x; i < d.R1Q2R2; i += blockDim.x) dg2[(size_t)i2 * d.R1Q2R2 + i] = 0.f;
  pass_turn(turn, k);
}

// Backward tile: i2 column x kT1B i1 values. G2[i2] stays in shared memory
// (rows padded to ld = q2*r2+1). Each warp takes whole groups: P (stored for
// the dG3 pass), dP = sum_u dRow_u G3[i3_u]^T (stored), the group's dG1
// partial dP.G2^T. Then the CTA forms this tile's dG2 partial
// sum_k G1[i1_k]^T dP_k (groups in i1 order) with register accumulators.
template <int Q1C, int MC, int Q3C, int BBC>
__global__ void __launch_bounds__(kThreads)
    rows_bwd_tile_kernel(Dev d, const float* __restrict__ g1, const float* __restrict__ g2,
                         const float* __restrict__ g3, const float* __restrict__ d_rows,
                         const int* __restrict__ uids, const int* __restrict__ goffs,
                         const int* __restrict__ counts, int n, const int* __restrict__ map,
                         int* ctrl, int* col_turn, float* __restrict__ Pbuf,
                         float* __restrict__ dPbuf, float* __restrict__ dG1p,
                         float* __restrict__ dg2, int slots) {
  extern __shared__ float4 smem4[];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int NJ = d.q2 * d.r2;
  const int LS = NJ + 1;
  float* G2s = reinterpret_cast<float*>(smem4);
  float* WR = G2s + align4(d.r1 * LS);  // warp regions, aliased by As/Bs
  float* G1w = WR + warp * (align4(d.Q1R1) + align4(d.M * d.R2p));
  float* Pw = G1w + align4(d.Q1R1);
  float* As = WR;
  float* Bs = WR + align4(kKC * d.r1);
  __shared__ int s_item;
  __shared__ int s_g[kT1B];
  __shared__ int s_lg[kT1B];
  __shared__ int s_lk[kT1B];
  __shared__ int s_cnt;

  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int nT1 = (d.p1 + kT1B - 1) / kT1B;
  const int nTiles = nT1 * d.p2;

  for (;;) {
    const int t = claim_tile_block(ctrl, 0, s_item);
    if (t >= nTiles) break;
    int i1b, i2;
    const int gk =
        tile_prefix_group<kT1B>(d, map, t, i1b, i2, [&](int x) { return x < G && x < slots; });
    if (tid < kT1B) s_g[tid] = gk;
    if (tid < 32) {  // ordered list of present groups
      const bool v = (tid < kT1B) && gk >= 0;
      const unsigned bal = __ballot_sync(0xffffffffu, v);
      if (v) {
        const int pos = __popc(bal & ((1u << tid) - 1u));
        s_lg[pos] = gk;
        s_lk[pos] = tid;
      }
      if (tid == 0) s_cnt = __popc(bal);
    }
    if (!__syncthreads_or(gk >= 0)) {
      empty_tile_turn(d, col_turn + i2, t / d.p2, i2, dg2);
      continue;
    }
    {
      const float* src = g2 + (size_t)i2 * d.R1Q2R2;
      for (int i = tid; i < d.R1Q2R2; i += blockDim.x) {
        const int a = i / NJ;
        G2s[a * LS + (i - a * NJ)] = __ldg(src + i);
      }
    }
    __syncthreads();
    // ---- warp per group ----
    for (int k = warp; k < kT1B; k += nwarps) {
      const int g = s_g[k];
      if (g < 0) continue;
      int gs, ge;
      group_ids(goffs, g, U, gs, ge);
      warp_group_P<Q1C>(d, g1, i1b + k, G1w, G2s, LS, Pw, lane);
      {
        float* pb = Pbuf + (size_t)g * d.PSZ;
        for (int w = lane; w < d.PSZ; w += 32) {
          const int m = w / d.r2, b = w - m * d.r2;
          pb[w] = Pw[m * d.R2p + b];
        }
      }
      // dP[m, b] = sum_u sum_q dRow_u[m*q3+q] G3[i3_u, b, q]; lanes own b
      constexpr int NBB = BBC ? BBC : kBB;
      constexpr int NM = MC ? MC : kMMax;
      constexpr int NQ3 = Q3C ? Q3C : kQ3Max;
      constexpr int NQ1 = Q1C ? Q1C : kQ1Max;
      float acc[NBB][NM];
      zero_fill(acc);
      for (int u = gs; u < ge; ++u) {
        int i1x, i2x, i3;
        split_id(d, __ldg(uids + u), i1x, i2x, i3);
        const float* dr = d_rows + (size_t)u * d.D;
        float g3v[NBB][NQ3];
#pragma unroll
        for (int bb = 0; bb < NBB; ++bb) {
          const int b = lane + 32 * bb;
#pragma unroll
          for (int q = 0; q < NQ3; ++q)
            g3v[bb][q] = (b < d.r2 && (Q3C || q < d.q3))
                             ? __ldg(g3 + ((size_t)i3 * d.r2 + b) * d.q3 + q)
                             : 0.f;
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          if (MC || m < d.M) {
#pragma unroll
            for (int q = 0; q < NQ3; ++q) {
              if (Q3C || q < d.q3) {
                const float dv = __ldg(dr + m * (Q3C ? Q3C : d.q3) + q);
#pragma unroll
                for (int bb = 0; bb < NBB; ++bb) acc[bb][m] = fmaf(dv, g3v[bb][q], acc[bb][m]);
              }
            }
          }
        }
      }
      __syncwarp();  // Pw (P) fully read
      {
        float* dpb = dPbuf + (size_t)g * d.PSZ;
#pragma unroll
        for (int bb = 0; bb < NBB; ++bb) {
          const int b = lane + 32 * bb;
          if (b < d.r2) {
#pragma unroll
            for (int m = 0; m < NM; ++m) {
              if (MC || m < d.M) {
                Pw[m * d.R2p + b] = acc[bb][m];
                dpb[m * d.r2 + b] = acc[bb][m];
              }
            }
          }
        }
      }
      __syncwarp();
      // dG1 partial[g][q1, a] = sum_{q2, b} dP[q1*q2+q2, b] G2[a, q2, b]
      for (int a0 = 0; a0 < d.r1; a0 += 32) {
        const int a = a0 + lane;
        if (a < d.r1) {
          float s1[NQ1];
#pragma unroll
          for (int q1 = 0; q1 < NQ1; ++q1) s1[q1] = 0.f;
          const float* g2r = G2s + a * LS;
          for (int q2 = 0; q2 < d.q2; ++q2) {
#pragma unroll 4
            for (int b = 0; b < d.r2; ++b) {
              const float gv = g2r[q2 * d.r2 + b];
#pragma unroll
              for (int q1 = 0; q1 < NQ1; ++q1)
                if (Q1C || q1 < d.q1) s1[q1] = fmaf(Pw[(q1 * d.q2 + q2) * d.R2p + b], gv, s1[q1]);
            }
          }
          float* o = dG1p + (size_t)g * d.Q1R1;
#pragma unroll
          for (int q1 = 0; q1 < NQ1; ++q1)
            if (Q1C || q1 < d.q1) o[q1 * d.r1 + a] = s1[q1];
        }
      }
      __syncwarp();
    }
    __syncthreads();  // dPbuf writes visible to the block; warp regions free
    // ---- tile dG2 partial: C[a, j] = sum_{k, q1} G1[i1_k, q1, a] dP_k[q1, j], into dG2
    const int kt = t / d.p2;
    await_turn(col_turn + i2, kt);
    {
      const int cnt = s_cnt;
      const int K = cnt * d.q1;
      const int TPJ = max(1, min((int)blockDim.x / NJ, d.r1));
      const int NA = (d.r1 + TPJ - 1) / TPJ;
      for (int j0 = 0; j0 < NJ; j0 += (int)blockDim.x) {
        const int jl = (NJ >= (int)blockDim.x) ? tid : (tid % NJ);
        const int h = (NJ >= (int)blockDim.x) ? 0 : (tid / NJ);
        const int j = j0 + jl;
        const bool act = (j < NJ) && (h < TPJ);
        const int a0 = h * NA;
        float c[kAMax];
#pragma unroll
        for (int i = 0; i < kAMax; ++i) c[i] = 0.f;
        for (int kc = 0; kc < K; kc += kKC) {
          const int kn = min(kKC, K - kc);
          __syncthreads();
          for (int i = tid; i < kn * d.r1; i += blockDim.x) {
            const int kk = kc + i / d.r1, a = i % d.r1;
            const int gi = kk / d.q1, q1 = kk - gi * d.q1;
            As[(i / d.r1) * d.r1 + a] =
                __ldg(g1 + (size_t)(i1b + s_lk[gi]) * d.Q1R1 + q1 * d.r1 + a);
          }
          for (int i = tid; i < kn * NJ; i += blockDim.x) {
            const int r = i / NJ, jj = i - r * NJ;
            const int kk = kc + r;
            const int gi = kk / d.q1, q1 = kk - gi * d.q1;
            Bs[r * NJ + jj] = dPbuf[(size_t)s_lg[gi] * d.PSZ + q1 * NJ + jj];
          }
          __syncthreads();
          if (act) {
            for (int r = 0; r < kn; ++r) {
              const float bv = Bs[r * NJ + j];
              const float* ar = As + r * d.r1 + a0;
#pragma unroll
              for (int ib = 0; ib < kAMax / 16; ++ib) {
                if (ib * 16 + 16 <= NA && a0 + ib * 16 + 16 <= d.r1) {
#pragma unroll
                  for (int i = ib * 16; i < ib * 16 + 16; ++i) c[i] = fmaf(ar[i], bv, c[i]);
                } else if (ib * 16 < NA) {
#pragma unroll
                  for (int i = ib * 16; i < ib * 16 + 16; ++i)
                    if (i < NA && a0 + i < d.r1) c[i] = fmaf(ar[i], bv, c[i]);
                }
              }
            }
          }
        }
        if (act) {
          float* out = dg2 + (size_t)i2 * d.R1Q2R2;
#pragma unroll
          for (int i = 0; i < kAMax; ++i)
            if (i < NA && a0 + i < d.r1) {
              float* o = out + (size_t)(a0 + i) * NJ + j;
              *o = dg2_in_turn(o, kt, c[i]);
            }
        }
        __syncthreads();
      }
    }
    pass_turn(col_turn + i2, kt);
  }
}

// ---- backward, GEMM tile kernel (the fast path) ----------------------------
// Same tiles as the forward GEMM kernel (i2 column x kT1B i1 values) and the
// same outputs as rows_bwd_tile_kernel: Pbuf[g] (P, [m][b]), dG1p[g], the tile's
// dG2 partial added into dg2 in its turn. Per batch of up to GB groups:
//   P by the GEMM of the forward (-> Pbuf for the dG3 pass);
//   dP_k = sum_u dRow_u G3[i3_u]^T, items (group, MB2 rows m, 4 columns b),
//     the group's unique ids in order;
//   the groups' dG1 partials dP_k . G2^T, items (group, 4 strided a);
//   the tile's dG2 partial A^T . dP added to shared memory, items (4 a, 4 j),
//     batches in order.
// Every output element has one owner thread and a fixed summation order:
// bitwise reproducible.
struct BwdGeo {
  int GB, ldA, ldG2, PT, smem_bytes;
};

__host__ __device__ inline BwdGeo bwd_geo(const Dev& d, int GB) {
  BwdGeo g;
  const int NC = d.q2 * d.r2;
  g.GB = GB;
  g.ldA = (GB * d.q1 + kRPT - 1) / kRPT * kRPT;
  g.ldG2 = NC + 4;  // a-strided reads of the dG1 pass hit different banks
  g.PT = d.M * d.r2 + 4;
  g.smem_bytes = (int)sizeof(float) * (d.r1 * g.ldG2 + d.r1 * NC + d.r1 * g.ldA + GB * g.PT);
  return g;
}

template <int M, int Q3, int NT>
__global__ void __launch_bounds__(NT, NT == kGT ? FLOWTT_BWD_MINB : 1)
    rows_bwd_gemm_kernel(Dev d, BwdGeo geo, const float* __restrict__ g1,
                         const float* __restrict__ g2, const float* __restrict__ g3,
                         const float* __restrict__ d_rows, const int* __restrict__ uids,
                         const int* __restrict__ goffs, const int* __restrict__ counts, int n,
                         const int* __restrict__ map, int* ctrl, int* col_turn,
                         float* __restrict__ Pbuf, float* __restrict__ dG1p,
                         float* __restrict__ dg2, int slots) {
  constexpr int MB2 = (32 / Q3) < M ? (32 / Q3) : M;  // rows m per dP item
  constexpr int NMB2 = M / MB2;
  extern __shared__ float4 smem4[];
  const int NC = d.q2 * d.r2;
  float* G2s = reinterpret_cast<float*>(smem4);  // [r1][ldG2]
  float* dG2s = G2s + d.r1 * geo.ldG2;           // [r1][NC], the tile's dG2
  float* As = dG2s + d.r1 * NC;                  // [r1][ldA], G1 transposed
  float* PD = As + d.r1 * geo.ldA;               // [GB][PT]: P, then dP
  __shared__ int s_next, s_n;
  __shared__ int s_k[kT1B], s_g[kT1B], s_gs[kT1B], s_ge[kT1B], s_ord[kT1B];
  const int tid = threadIdx.x;
  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int nTiles = (d.p1 + kT1B - 1) / kT1B * d.p2;
  const int NC4 = NC / 4, R14 = d.r1 / 4;
  const int IPG = NMB2 * (d.r2 / 4);           // dP items per group
  const int S = NT % IPG == 0 ? NT / IPG : 0;  // slots a row (0: items straddle threads)

  if (tid == 0) s_next = claim_tile(ctrl);
  for (;;) {
    __syncthreads();
    const int t = s_next;
    if (t >= nTiles) break;
    int i1b, i2;
    const int g =
        tile_prefix_group<kT1B>(d, map, t, i1b, i2, [&](int x) { return x < G && x < slots; });
    if (tid < 32) {  // compact the present groups
      int gs = 0, ge = 0;
      if (g >= 0) {
        group_ids(goffs, g, U, gs, ge);
      }
      const unsigned bal = __ballot_sync(0xffffffffu, g >= 0);
      const int pos = __popc(bal & ((1u << tid) - 1u));
      if (g >= 0) {
        s_k[pos] = tid;
        s_g[pos] = g;
        s_gs[pos] = gs;
        s_ge[pos] = ge;
      }
      if (tid == 0) s_n = __popc(bal);
    }
    int nxt = 0;
    if (tid == 0) nxt = claim_tile(ctrl);  // next tile, used at the end
    __syncthreads();
    const int nG = s_n;
    if (nG == 0) {
      empty_tile_turn(d, col_turn + i2, t / d.p2, i2, dg2);
      if (tid == 0) s_next = nxt;
      continue;
    }
    {
      const float4* src = reinterpret_cast<const float4*>(g2 + (size_t)i2 * d.R1Q2R2);
      for (int i = tid; i < d.r1 * NC4; i += NT) {
        const int a = i / NC4, c = i - a * NC4;
        *reinterpret_cast<float4*>(G2s + a * geo.ldG2 + 4 * c) = __ldg(src + i);
        reinterpret_cast<float4*>(dG2s)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    for (int k0 = 0; k0 < nG; k0 += geo.GB) {
      const int nB = min(geo.GB, nG - k0);
      const int nR = nB * d.q1;
      const bool snake = S > 0 && nB > S;  // a thread takes two groups
      if (snake && tid < 32)
        snake_slots(nB, S, tid, s_ord, [&](int k) { return s_ge[k0 + k] - s_gs[k0 + k]; });
      for (int i = tid; i < nB * d.Q1R1; i += NT) {  // rows fastest: no bank conflicts
        const int a = i / nR, row = i - a * nR;
        const int k = row / d.q1, q1 = row - k * d.q1;
        As[a * geo.ldA + row] = __ldg(g1 + (size_t)(i1b + s_k[k0 + k]) * d.Q1R1 + q1 * d.r1 + a);
      }
      __syncthreads();
      tile_gemm_P<NT>(d, As, geo.ldA, G2s, geo.ldG2, nR, PD, geo.PT);
      __syncthreads();
      {  // P -> Pbuf (layout [m][b])
        const int P4 = d.PSZ / 4;
        for (int i = tid; i < nB * P4; i += NT) {
          const int k = i / P4, w = i - k * P4;
          reinterpret_cast<float4*>(Pbuf + (size_t)s_g[k0 + k] * d.PSZ)[w] =
              *reinterpret_cast<const float4*>(PD + k * geo.PT + 4 * w);
        }
      }
      __syncthreads();
      {  // dP_k[m][b] = sum_u sum_q dRow_u[m][q] G3[i3_u][b][q]
        const int R24 = d.r2 / 4;
        for (int it = tid; it < nB * IPG; it += NT) {
          const int p = it / IPG, rest = it - p * IPG;
          const int k = snake ? s_ord[p] : p;
          const int mb = rest / R24, b0 = 4 * (rest - mb * R24);
          const int m0 = mb * MB2;
          float acc[MB2][4];
          zero_fill(acc);
          const int gs = s_gs[k0 + k], ge = s_ge[k0 + k];
          int id_next = gs < ge ? __ldg(uids + gs) : 0;  // one id ahead
          for (int u = gs; u < ge; ++u) {
            const int id = id_next;
            if (u + 1 < ge) id_next = __ldg(uids + u + 1);
#if FLOWTT_BWD_PREFETCH > 0
            if (u + FLOWTT_BWD_PREFETCH < ge)
              prefetch_l2(d_rows + (size_t)(u + FLOWTT_BWD_PREFETCH) * d.D + m0 * Q3);
#endif
            const float4* dr4 = reinterpret_cast<const float4*>(d_rows + (size_t)u * d.D + m0 * Q3);
            const float4* g34 =
                reinterpret_cast<const float4*>(g3 + ((size_t)id3(d, id) * d.r2 + b0) * Q3);
            float dr[MB2 * Q3], gv[4 * Q3];
            ldg_float4s<MB2 * Q3 / 4>(dr4, dr);
            ldg_float4s<Q3>(g34, gv);
#pragma unroll
            for (int i = 0; i < MB2; ++i)
#pragma unroll
              for (int bb = 0; bb < 4; ++bb) {
                float a = acc[i][bb];
#pragma unroll
                for (int q = 0; q < Q3; ++q) a = fmaf(dr[i * Q3 + q], gv[bb * Q3 + q], a);
                acc[i][bb] = a;
              }
          }
#pragma unroll
          for (int i = 0; i < MB2; ++i)
            *reinterpret_cast<float4*>(PD + k * geo.PT + (m0 + i) * d.r2 + b0) =
                make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        }
      }
      __syncthreads();
      // dG1 partial [q1][a] = sum_j dP_k[q1][j] G2[a][j]; a = a0 + i*r1/4
      for (int it = tid; it < nB * R14; it += NT) {
        const int k = it / R14, a0 = it - k * R14;
        float acc[4][4];
        zero_fill(acc);
        const float* pk = PD + k * geo.PT;
        for (int j = 0; j < NC; j += 4) {
          float4 gv[4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
            gv[i] = *reinterpret_cast<const float4*>(G2s + (a0 + i * R14) * geo.ldG2 + j);
#pragma unroll
          for (int q1 = 0; q1 < 4; ++q1) {
            if (q1 < d.q1) {
              const float4 p = *reinterpret_cast<const float4*>(pk + q1 * NC + j);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                float a = acc[q1][i];
                a = fmaf(p.x, gv[i].x, a);
                a = fmaf(p.y, gv[i].y, a);
                a = fmaf(p.z, gv[i].z, a);
                acc[q1][i] = fmaf(p.w, gv[i].w, a);
              }
            }
          }
        }
        float* o = dG1p + (size_t)s_g[k0 + k] * d.Q1R1;
#pragma unroll
        for (int q1 = 0; q1 < 4; ++q1)
          if (q1 < d.q1)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[q1 * d.r1 + a0 + i * R14] = acc[q1][i];
      }
      // the tile's dG2 [a][j] += sum_rows A[row][a] dP[row][j], rows in order
      for (int it = tid; it < R14 * NC4; it += NT) {
        const int ab = it / NC4, j4 = it - ab * NC4;
        float acc[4][4];
        zero_fill(acc);
        for (int k = 0; k < nB; ++k) {
          for (int q1 = 0; q1 < d.q1; ++q1) {
            const int row = k * d.q1 + q1;
            const float4 p = *reinterpret_cast<const float4*>(PD + k * geo.PT + q1 * NC + 4 * j4);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float av = As[(ab * 4 + i) * geo.ldA + row];
              acc[i][0] = fmaf(av, p.x, acc[i][0]);
              acc[i][1] = fmaf(av, p.y, acc[i][1]);
              acc[i][2] = fmaf(av, p.z, acc[i][2]);
              acc[i][3] = fmaf(av, p.w, acc[i][3]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float4* o = reinterpret_cast<float4*>(dG2s + (ab * 4 + i) * NC + 4 * j4);
          float4 v = *o;
          v.x += acc[i][0];
          v.y += acc[i][1];
          v.z += acc[i][2];
          v.w += acc[i][3];
          *o = v;
        }
      }
      __syncthreads();
    }
    {
      const int kt = t / d.p2;
      await_turn(col_turn + i2, kt);
      float4* dst = reinterpret_cast<float4*>(dg2 + (size_t)i2 * d.R1Q2R2);
      for (int i = tid; i < d.r1 * NC4; i += NT)
        dst[i] = dg2_in_turn(dst + i, kt, reinterpret_cast<const float4*>(dG2s)[i]);
      pass_turn(col_turn + i2, kt);
    }
    if (tid == 0) s_next = nxt;
  }
}

// dG1[i1] = sum over groups of i1 (i2 ascending) of the per-group partials.
// Threads split the group list into S contiguous parts (fixed S), combined
// in order: deterministic.
__global__ void dg1_reduce_kernel(Dev d, const int* __restrict__ map,
                                  const int* __restrict__ counts, int n, int slots,
                                  const float* __restrict__ dG1p, float* __restrict__ dg1) {
  extern __shared__ int s_list[];  // p2 ints, then S*Q1R1 floats
  __shared__ int s_cnt;
  const int i1 = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31;
  const int G = clampi(counts[1], 0, clampi(counts[0], 0, n));
  if (tid < 32) {
    int base = 0;
    for (int c = 0; c < d.p2; c += 32) {
      const int i2 = c + lane;
      const int g = (i2 < d.p2) ? map_group(map, d.p2, i1, i2) : -1;
      const bool v = g >= 0 && g < G && g < slots;
      const unsigned bal = __ballot_sync(0xffffffffu, v);
      if (v) s_list[base + __popc(bal & ((1u << lane) - 1u))] = g;
      base += __popc(bal);
    }
    if (lane == 0) s_cnt = base;
  }
  __syncthreads();
  const int cnt = s_cnt;
  float* s_part = reinterpret_cast<float*>(s_list + align4(d.p2));
  const int EW = min(d.Q1R1, (int)blockDim.x);
  const int S = blockDim.x / EW;
  for (int e0 = 0; e0 < d.Q1R1; e0 += EW) {
    const int e = e0 + tid % EW;
    const int s = tid / EW;
    float acc = 0.f;
    if (s < S && e < d.Q1R1) {
      const int per = (cnt + S - 1) / S;
      const int jb = s * per, je = min(cnt, jb + per);
#pragma unroll 8
      for (int j = jb; j < je; ++j) acc += __ldg(dG1p + (size_t)s_list[j] * d.Q1R1 + e);
      s_part[s * EW + tid % EW] = acc;
    }
    __syncthreads();
    if (s == 0 && e < d.Q1R1) {
      float tot = 0.f;
      for (int ss = 0; ss < S; ++ss) tot += s_part[ss * EW + tid % EW];
      dg1[(size_t)i1 * d.Q1R1 + e] = tot;
    }
    __syncthreads();
  }
}

}  // namespace

size_t bwd_smem(const Dev& d) {
  const int NJ = d.q2 * d.r2;
  const size_t warps = (size_t)(kThreads / 32) * (align4(d.Q1R1) + align4(d.M * d.R2p));
  const size_t ab = (size_t)align4(kKC * d.r1) + (size_t)kKC * NJ;
  return sizeof(float) * ((size_t)align4(d.r1 * (NJ + 1)) + std::max(warps, ab));
}

// Groups per batch of the GEMM backward tile (kBwdSharedSmem of shared memory if
// possible, else up to FLOWTT_BWD_SMEM_KB, 224 KB: the most a CTA takes on sm_90 is 227 KB),
// or 0 when it does not take these dims.
int gemm_bwd_batch_groups(const Dev& d) {
  if (!gemm_dims(d) || d.r1 % 4 != 0 || d.q1 > 4) return 0;
  for (int lim : {kBwdSharedSmem, FLOWTT_BWD_SMEM_KB * 1024})
    for (int GB = kT1B; GB >= 1; GB /= 2)
      if (bwd_geo(d, GB).smem_bytes <= lim) return GB;
  return 0;
}

cudaError_t launch_rows_bwd_tiles(const Dev& d, const float* g1, const float* g2, const float* g3,
                                  const float* d_rows, const int* unique_ids,
                                  const int* group_offsets, const int* counts, int n, float* dg2,
                                  const BwdScratch& s, cudaStream_t stream) {
  const int sms = num_sms();
  cudaError_t err = cudaSuccess;
  const int GBB = gemm_bwd_batch_groups(d);
  if (GBB > 0) {
    const BwdGeo geo = bwd_geo(d, GBB);
    const bool wide = geo.smem_bytes > kBwdSharedSmem;  // alone on its SM: more warps
    GemmShapes::dispatch(
        [&](auto shape) {
          using S = decltype(shape);
          auto launch = [&](auto nt) {
            constexpr int NT = decltype(nt)::value;
            err = launch_persistent<NT>(rows_bwd_gemm_kernel<S::M, S::Q3, NT>, geo.smem_bytes,
                                        stream, sms, d, geo, g1, g2, g3, d_rows, unique_ids,
                                        group_offsets, counts, n, s.map, s.ctrl, s.col_turn(),
                                        s.Pbuf, s.dG1p, dg2, s.slots);
          };
          if (wide)
            launch(std::integral_constant<int, FLOWTT_BWD_WIDE>{});
          else
            launch(std::integral_constant<int, kGT>{});
        },
        d.M, d.q3);
    return err;
  }
  const size_t smem = bwd_smem(d);
  auto launch_warp = [&](auto shape) {
    using S = decltype(shape);
    err = launch_persistent(rows_bwd_tile_kernel<S::Q1, S::M, S::Q3, S::BB>, smem, stream, sms, d,
                            g1, g2, g3, d_rows, unique_ids, group_offsets, counts, n, s.map, s.ctrl,
                            s.col_turn(), s.Pbuf, s.dPbuf, s.dG1p, dg2, s.slots);
  };
  if (!WarpBwdShapes::dispatch(launch_warp, d.q1, d.M, d.q3, d.r2 > 32 ? 2 : 1))
    launch_warp(WarpBwdGeneric{});
  return err;
}

cudaError_t launch_dg1_reduce(const Dev& d, const BwdScratch& s, const int* counts, int n,
                              float* dg1, cudaStream_t stream) {
  const size_t sm1 = sizeof(int) * align4(d.p2) + sizeof(float) * (size_t)kThreads;
  cudaError_t err =
      cudaFuncSetAttribute(dg1_reduce_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           (int)std::max<size_t>(sm1, 48 * 1024));
  if (err != cudaSuccess) return err;
  dg1_reduce_kernel<<<d.p1, kThreads, sm1, stream>>>(d, s.map, counts, n, s.slots, s.dG1p, dg1);
  return cudaGetLastError();
}

}  // namespace flowtt
