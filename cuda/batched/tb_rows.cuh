// Device helpers of the table-batched rows kernels (cuda/batched/tb_fwd_kernels.cuh,
// cuda/batched/tb_bwd_kernels.cuh, cuda/batched/tb_dg3_kernels.cuh). Every
// plan index read is clamped into its core or range: a bad plan gives wrong numbers,
// never an out-of-bounds access. No CUDA header included (nvcc provides the built-ins;
// tests/native/tb_emu.h provides them for the CPU emulation test).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/tile_fma.cuh"

// A kernel's dynamic shared memory (float4-aligned); the emulation test redefines it.
#ifndef TB_DYNAMIC_SMEM
#define TB_DYNAMIC_SMEM(name) extern __shared__ float4 name[]
#endif

namespace flowtt::tb {

constexpr int kTbThreads = 256;  // every kernel: 8 warps
constexpr int kTbWarps = kTbThreads / 32;
constexpr int kTbChunk = 64;  // unique indices per forward work item
constexpr int kTbBatch = 16;  // groups per shared-memory batch of the dg2 kernel, at most
constexpr int kTbQ1Max = 8, kTbMMax = 16, kTbQ3Max = 8, kTbRMax = 64;
constexpr int kTbMaxG2Row = 24576;  // r1*q2*r2 bound (g2 rows staged in shared memory)
constexpr int kTbTileGroups = 32;   // max groups per batch of the sorted-tile forward
// Most groups per batch of the sorted-tile forward's compile-time dims instances: fewer
// than kTbTileGroups fit more blocks per SM (harness, Meta-like 240 tables: 2.418 ms at
// 32, 2.376 at 16, 2.926 at 8); the run-time dims instance keeps 32 (2.628 ms at 32, 2.963
// at 16).
constexpr int kTbFwdFixedGroups = 16;
constexpr int kTbRPT = kTileRows;  // rows (group, q1) per thread of its prefix GEMM

// Dims and derived sizes, by value into every kernel (the kernels and helpers take any
// dims type DD with these members: TbDev, or TbFixedDims below).
struct TbDev {
  static constexpr bool kFixed = false;
  int p1, p2, p3, q1, q2, q3, r1, r2;
  int K;     // q2*r2: a g2 row [r1][K], a prefix product P [q1][K] (= [M][r2])
  int M;     // q1*q2
  int D;     // q1*q2*q3
  int Q1R1;  // g1 row
  int R1K;   // g2 row
  int PSZ;   // P / dP of a group: M*r2 = q1*K
  int S3;    // g3 row: r2*q3
  int ldP;   // row stride of P in shared memory: r2 + 1 (no bank conflicts across m)
};

template <typename Dims>  // TbDims (cuda/include/tb_rows.h) or any struct with those fields
inline TbDev tb_dev(const Dims& t) {
  TbDev d;
  d.p1 = (int)t.p1;
  d.p2 = (int)t.p2;
  d.p3 = (int)t.p3;
  d.q1 = (int)t.q1;
  d.q2 = (int)t.q2;
  d.q3 = (int)t.q3;
  d.r1 = (int)t.r1;
  d.r2 = (int)t.r2;
  d.K = d.q2 * d.r2;
  d.M = d.q1 * d.q2;
  d.D = d.M * d.q3;
  d.Q1R1 = d.q1 * d.r1;
  d.R1K = d.r1 * d.K;
  d.PSZ = d.M * d.r2;
  d.S3 = d.r2 * d.q3;
  d.ldP = d.r2 + 1;
  return d;
}

// Dims with the column shape and ranks fixed at compile time (the row shape stays a
// run-time value): the same kernels, with every index division and loop bound over q and
// r a constant, so loops unroll and index math folds. Bitwise the TbDev kernels (the same
// sums in the same order); the launchers take it for the shapes of TB_FIXED_SHAPES.
template <int Q1, int Q2, int Q3, int R1, int R2>
struct TbFixedDims {
  static constexpr bool kFixed = true;
  static constexpr int q1 = Q1, q2 = Q2, q3 = Q3, r1 = R1, r2 = R2;
  static constexpr int K = Q2 * R2, M = Q1 * Q2, D = Q1 * Q2 * Q3, Q1R1 = Q1 * R1;
  static constexpr int R1K = R1 * K, PSZ = M * R2, S3 = R2 * Q3, ldP = R2 + 1;
  int p1, p2, p3;
  static bool matches(const TbDev& d) {
    return d.q1 == Q1 && d.q2 == Q2 && d.q3 == Q3 && d.r1 == R1 && d.r2 == R2;
  }
  static TbFixedDims of(const TbDev& d) { return {d.p1, d.p2, d.p3}; }
};

// The fixed shapes: (q1, q2, q3, r1, r2) of dim 32 at ranks 32 (the Meta-like
// collections') and of dim 16 at rank 16 (examples/dlrm.py's). F(DD) is called with DD the
// matching TbFixedDims (unless fixed is false: a test's comparison), else TbDev.
#define TB_FIXED_SHAPES(X) X(2, 4, 4, 32, 32) X(2, 2, 4, 16, 16)
template <class F>
auto tb_with_dims(const TbDev& d, bool fixed, F&& f) {
#define TB_FIXED_CASE(a, b, c, e, g) \
  if (fixed && TbFixedDims<a, b, c, e, g>::matches(d)) return f(TbFixedDims<a, b, c, e, g>::of(d));
  TB_FIXED_SHAPES(TB_FIXED_CASE)
#undef TB_FIXED_CASE
  return f(d);
}

__host__ __device__ inline int tb_align4(int x) { return (x + 3) & ~3; }

// The backward's dg3 passes over the P cache: one per `cap` groups of at most n groups
// (one without a cache, cap = 0).
inline int tb_dg3_passes(int cap, int n) {
  return cap > 0 ? (int)(((long long)n + cap - 1) / cap) : 1;
}

// The sorted-tile forward (tb_fwd_tile_kernel): per batch of GB groups sharing a g2 row,
// the g2 row [r1][K], the g1 rows transposed As [r1][ldA] (rows (group, q1), ldA a
// multiple of kTbRPT) and P of each group as Ps [GB][r2][ldm] (ldm = M + 1). GB: the
// largest power of two <= max_groups (and >= 4) that fits smem_cap; 0 when the dims do
// not take the tile path (r2 % 4 != 0, q3 not 4 or 8, or no GB fits).
struct TbTileGeo {
  int GB, ldA, ldm, PT;
  size_t smem;
};
template <class DD>
inline TbTileGeo tb_tile_geo(const DD& d, size_t smem_cap, int max_groups = kTbTileGroups) {
  TbTileGeo g{0, 0, d.M + 1, d.r2 * (d.M + 1), 0};
  if (d.r2 % 4 != 0 || (d.q3 != 4 && d.q3 != 8)) return g;
  for (int gb = kTbTileGroups; gb >= 4; gb /= 2) {
    if (gb > max_groups) continue;
    const int ldA = (gb * d.q1 + kTbRPT - 1) / kTbRPT * kTbRPT;
    const size_t smem =
        sizeof(float) * ((size_t)tb_align4(d.R1K) + (size_t)d.r1 * ldA + (size_t)gb * g.PT);
    if (smem <= smem_cap) {
      g.GB = gb;
      g.ldA = ldA;
      g.smem = smem;
      return g;
    }
  }
  return g;
}

// Whether tb_pcache_kernel forms P on tensor cores (3xTF32, tb_pcache_batch_mma): k-steps
// of 8 over r1 and column chunks of 32 over K.
template <class DD>
__host__ __device__ inline bool tb_pcache_mma(const DD& d) {
  return d.r1 % 8 == 0 && d.K % 32 == 0;
}

// Rows (group, x1) of a P cache batch on the tensor-core path: GB * q1 rounded up to 16.
__host__ __device__ inline int tb_pcache_mma_rows(int q1, const TbTileGeo& geo) {
  return (geo.GB * q1 + 15) / 16 * 16;
}

// The P cache of the backward (tb_pcache_kernel, tb_tile_geo's GB and ldA): the g2 row
// and the batch's g1 rows, no P tile (P goes straight to global memory). On the
// tensor-core path the g2 row [r1][K + 8] and the g1 rows [rows][r1 + 4] (strides that put
// a fragment's reads at distinct banks).
template <class DD>
inline size_t tb_pcache_smem(const DD& d, const TbTileGeo& geo) {
  if (tb_pcache_mma(d))
    return sizeof(float) *
           ((size_t)d.r1 * (d.K + 8) + (size_t)tb_pcache_mma_rows(d.q1, geo) * (d.r1 + 4));
  return sizeof(float) * ((size_t)tb_align4(d.R1K) + (size_t)d.r1 * geo.ldA);
}

// The dg1 kernel (tb_dg1_kernel): a block takes R consecutive g1 rows; a super-step
// holds up to S g2 rows and KMAX (>= R) groups. Shared memory: the g2 rows [S][R1K], the
// rows' accumulators [R][q1*r1], dP of the listed groups [KMAX][PSZ]. The largest R, then
// S, then KMAX within 110 KB (two blocks per SM), else within 200 KB; R = 0 if none fits.
constexpr int kTbDg1MaxRows = 32, kTbDg1MaxSteps = 4, kTbDg1MaxList = 64;
struct TbDg1Geo {
  int R, S, KMAX;
  size_t smem;
};
template <class DD>
inline TbDg1Geo tb_dg1_geo(const DD& d) {
  for (size_t budget : {size_t{110} << 10, size_t{200} << 10}) {
    for (int R = kTbDg1MaxRows; R >= 8; R /= 2) {
      for (int S = kTbDg1MaxSteps; S >= 1; S /= 2) {
        const size_t fixed =
            sizeof(float) * ((size_t)S * tb_align4(d.R1K) + (size_t)tb_align4(R * d.Q1R1));
        if (fixed >= budget) continue;
        const int kmax =
            (int)std::min<size_t>(kTbDg1MaxList, (budget - fixed) / (sizeof(float) * d.PSZ));
        if (kmax >= R) return {R, S, kmax, fixed + sizeof(float) * (size_t)kmax * d.PSZ};
      }
    }
  }
  return {0, 0, 0, 0};
}

// The dg3 kernel (tb_dg3_kernel): a warp per g3 row takes the row's ids in chunks of
// tb_dg3_chunk(d), staging each id's P (row stride ldP) and d_rows row in its slice of
// shared memory: [align4(q1*r1)] (a g1 row, for a P recomputed) then per id
// tb_dg3_slot(d) floats, at most kTbDg3SliceFloats per warp (up to 8 ids).
constexpr int kTbDg3SliceFloats = 2432, kTbDg3MaxChunk = 8;
template <class DD>
__host__ __device__ inline int tb_dg3_slot(const DD& d) {
  return tb_align4(d.M * d.ldP) + tb_align4(d.D);
}
template <class DD>
__host__ __device__ inline int tb_dg3_chunk(const DD& d) {
  const int room = (kTbDg3SliceFloats - tb_align4(d.Q1R1)) / tb_dg3_slot(d);
  return room < 1 ? 1 : (room > kTbDg3MaxChunk ? kTbDg3MaxChunk : room);
}
template <class DD>
__host__ __device__ inline int tb_dg3_slice(const DD& d) {
  return tb_align4(d.Q1R1) + tb_dg3_chunk(d) * tb_dg3_slot(d);
}

// Dynamic shared memory of the kernels: the per-warp slices (g1 row, P) of the forward
// kernels; the per-warp slices of dg3; the dg2 accumulator row, the g2 row (when dg2
// also writes the dg1 terms, `with_e`), the g1 rows and dP of a batch (dg2).
template <class DD>
inline size_t tb_warp_slices_bytes(const DD& d) {
  return sizeof(float) * kTbWarps * (size_t)(tb_align4(d.Q1R1) + tb_align4(d.M * d.ldP));
}
template <class DD>
inline size_t tb_dg3_smem(const DD& d) {
  return sizeof(float) * kTbWarps * (size_t)tb_dg3_slice(d);
}
template <class DD>
inline size_t tb_stage_bytes(const DD& d);
// Floats of the dg2 kernel's staged g2 row (row stride up to K + 4).
template <class DD>
__host__ __device__ inline int tb_dg2_g2_floats(const DD& d) {
  return tb_align4(d.R1K + 4 * d.r1);
}
template <class DD>
inline size_t tb_dg2_smem(const DD& d, bool with_e = false, int batch = 8) {
  return sizeof(float) * ((size_t)tb_align4(d.R1K) + (with_e ? tb_dg2_g2_floats(d) : 0) +
                          (size_t)batch * (tb_align4(d.Q1R1) + tb_align4(d.PSZ))) +
         tb_stage_bytes(d);
}
// Groups per batch of the dg2 kernel: kTbBatch when that still leaves room for three
// blocks per SM (74 KB), else 8.
template <class DD>
inline int tb_dg2_batch(const DD& d, bool with_e) {
  return tb_dg2_smem(d, with_e, kTbBatch) <= size_t{74} * 1024 ? kTbBatch : 8;
}

__device__ __forceinline__ int tb_clamp(int v, int lo, int hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// num_unique U in [0, n] and num_groups G in [0, U].
__device__ __forceinline__ void tb_counts(const int* counts, int n, int& U, int& G) {
  U = tb_clamp(counts[0], 0, n);
  G = tb_clamp(counts[1], 0, U);
}

// Unique indices [gs, ge) of group g, clamped into [0, U].
__device__ __forceinline__ void tb_group_range(const int* __restrict__ goffs, int g, int U, int& gs,
                                               int& ge) {
  gs = tb_clamp(__ldg(goffs + g), 0, U);
  ge = tb_clamp(__ldg(goffs + g + 1), gs, U);
}

// The group of unique index u: the last g in [0, G) with group_offsets[g] <= u (0 when
// G == 0 or none is).
__device__ __forceinline__ int tb_find_group(const int* __restrict__ goffs, int G, int u) {
  int lo = 0, hi = G;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (__ldg(goffs + mid) <= u)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// A batch of the dg2 kernels (tb_dg2_kernel, tb_dg2_mma_kernel): the groups
// sorted_groups[j0 + k], k < nb (nb <= kTbThreads), with their unique ranges [s_gs, s_ge),
// g1 rows s_i1 and ids s_g in shared memory (the caller's barrier follows).
template <class DD>
__device__ __forceinline__ void tb_load_batch_groups(const DD& d,
                                                     const int* __restrict__ sorted_groups,
                                                     const int* __restrict__ goffs,
                                                     const int* __restrict__ g_i1, int j0, int nb,
                                                     int gmax, int U, int* s_gs, int* s_ge,
                                                     int* s_i1, int* s_g) {
  const int tid = threadIdx.x;
  if (tid >= nb) return;
  const int g = tb_clamp(__ldg(sorted_groups + j0 + tid), 0, gmax);
  tb_group_range(goffs, g, U, s_gs[tid], s_ge[tid]);
  s_i1[tid] = tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1);
  s_g[tid] = g;
}

// The g2 row I [r1][K] into shared memory rows of stride ld (the dg1 terms' operand).
template <class DD>
__device__ __forceinline__ void tb_stage_g2_row(const DD& d, const float* __restrict__ g2, int I,
                                                int ld, float* G2s) {
  for (int i = threadIdx.x; i < d.R1K; i += kTbThreads) {
    const int a = i / d.K;
    G2s[a * ld + (i - a * d.K)] = __ldg(g2 + (size_t)I * d.R1K + i);
  }
}

// The prefix GEMM of a batch of groups sharing a g2 row (tb_fwd_tile_kernel and
// tb_pcache_kernel), in two steps. Staging: As[a][row] = g1[i1_k][x1][a] for the
// nR = nb * q1 rows (group k, x1) of the batch, the block's threads over all elements.
template <class DD>
__device__ __forceinline__ void tb_stage_g1_rows(const DD& d, const float* __restrict__ g1,
                                                 const int* s_i1, int nR, int ldA, float* As) {
  for (int e = threadIdx.x; e < nR * d.r1; e += kTbThreads) {
    const int a = e / nR, row = e - a * nR;
    const int k = row / d.q1, x1 = row - k * d.q1;
    As[a * ldA + row] = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + x1 * d.r1 + a);
  }
}

// The whole prefix GEMM of a batch of nb groups: As staged, then each thread's register
// tiles of P, handed to store(row0, c4, nR, acc) (rows row0 + i < nR, columns 4*c4 + c).
// kTbRPT rows a thread always: tile_gemm_P's 4 / 6-row choice made the Meta-like forward
// 3% slower (docs/log/kernels.md, session 25).
template <class Store, class DD>
__device__ __forceinline__ void tb_batch_P(const DD& d, const float* __restrict__ g1,
                                           const int* s_i1, int nb, int ldA, float* As,
                                           const float* G2s, Store&& store) {
  const int nR = nb * d.q1, NC4 = d.K / 4;
  tb_stage_g1_rows(d, g1, s_i1, nR, ldA, As);
  __syncthreads();
  const int nRB = (nR + kTbRPT - 1) / kTbRPT;
  for (int it = threadIdx.x; it < nRB * NC4; it += kTbThreads) {
    const int rb = it / NC4, c4 = it - rb * NC4;
    float acc[kTbRPT][4];
    tile_fma_rows<kTbRPT>(As + rb * kTbRPT, ldA, G2s + 4 * c4, d.K, d.r1, acc);
    store(rb * kTbRPT, c4, nR, acc);
  }
}

// Work stealing: the block's next item from *ctr (all threads get it; s_item is a
// __shared__ int of the caller).
__device__ __forceinline__ int tb_claim(int* ctr, int* s_item) {
  __syncthreads();  // every thread has read the previous item
  if (threadIdx.x == 0) *s_item = atomicAdd(ctr, 1);
  __syncthreads();
  return *s_item;
}

// Work stealing by a warp: its next item from *ctr (every lane gets it).
__device__ __forceinline__ int tb_warp_claim(int* ctr, int lane) {
  int item = 0;
  if (lane == 0) item = atomicAdd(ctr, 1);
  return __shfl_sync(0xffffffffu, item, 0);
}

// The inclusive prefix sum of v over the warp's lanes (every lane calls it).
__device__ __forceinline__ int tb_warp_inclusive_scan(int v, int lane) {
  for (int off = 1; off < 32; off <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += x;
  }
  return v;
}

// One group's dg1 term dP_g . g2r^T for output column a (a < r1), as the 8 threads
// (a, kp = 0..7) of one column compute it: thread kp sums the K = q2*r2 products of its
// slice (float4 quads kp, kp+8, ... when VEC == 4, else elements kp, kp+8, ...), then a
// fixed xor tree combines the 8 partials; every thread of the column returns the total in
// part[x1]. dp: dP_g [q1][K]; g2r: the g2 row [r1][K] (shared memory, 16-byte aligned
// rows when VEC == 4). Threads with a >= r1 add nothing but take part in the shuffles.
template <int Q1C, int VEC, class DD>
__device__ __forceinline__ void tb_dg1_term(const DD& d, const float* dp, const float* g2r, int a,
                                            int kp, float (&part)[Q1C ? Q1C : kTbQ1Max]) {
  constexpr int NQ1 = Q1C ? Q1C : kTbQ1Max;
  constexpr int KP = 8;
#pragma unroll
  for (int x1 = 0; x1 < NQ1; ++x1) part[x1] = 0.f;
  if (a < d.r1) {
    const float* gr = g2r + a * d.K;
    if (VEC == 4) {
      for (int q = kp; q < d.K / 4; q += KP) {
        const float4 gv = reinterpret_cast<const float4*>(gr)[q];
#pragma unroll
        for (int x1 = 0; x1 < NQ1; ++x1) {
          if (Q1C || x1 < d.q1) {
            const float4 dv = reinterpret_cast<const float4*>(dp + x1 * d.K)[q];
            float t = fmaf(dv.x, gv.x, part[x1]);
            t = fmaf(dv.y, gv.y, t);
            t = fmaf(dv.z, gv.z, t);
            part[x1] = fmaf(dv.w, gv.w, t);
          }
        }
      }
    } else {
      for (int j = kp; j < d.K; j += KP) {
        const float gv = gr[j];
#pragma unroll
        for (int x1 = 0; x1 < NQ1; ++x1)
          if (Q1C || x1 < d.q1) part[x1] = fmaf(dp[x1 * d.K + j], gv, part[x1]);
      }
    }
  }
#pragma unroll
  for (int x1 = 0; x1 < NQ1; ++x1) {
    if (Q1C || x1 < d.q1) {
#pragma unroll
      for (int off = KP / 2; off > 0; off >>= 1)
        part[x1] += __shfl_xor_sync(0xffffffffu, part[x1], off);
    }
  }
}

// One warp forms the prefix product of a group, P[x1][j] = sum_a G1s[x1][a] g2r[a][j]
// (a ascending), into Pw[m][b] (row stride ldP; m = x1*q2 + j / r2, b = j % r2). G1s: the
// g1 row [q1][r1] in shared memory; g2r: the g2 row [r1][K] in global memory. Lanes own
// 4 columns j each (one float4 per a when VEC == 4: K % 4 == 0, g2 16-byte aligned) and
// every q1 row, so each g2 element loaded feeds q1 FMAs.
template <int Q1C, int VEC, class DD>
__device__ __forceinline__ void tb_warp_prefix(const DD& d, const float* G1s,
                                               const float* __restrict__ g2r, float* Pw, int lane) {
  constexpr int NQ1 = Q1C ? Q1C : kTbQ1Max;
  for (int j0 = 0; j0 < d.K; j0 += 128) {
    float acc[4][NQ1];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int x1 = 0; x1 < NQ1; ++x1) acc[i][x1] = 0.f;
#pragma unroll 4
    for (int a = 0; a < d.r1; ++a) {
      float gv[4];
      const float* row = g2r + (size_t)a * d.K;
      if (VEC == 4) {
        const int j = j0 + 4 * lane;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j < d.K) v = __ldg(reinterpret_cast<const float4*>(row + j));
        gv[0] = v.x;
        gv[1] = v.y;
        gv[2] = v.z;
        gv[3] = v.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = j0 + lane + 32 * i;
          gv[i] = j < d.K ? __ldg(row + j) : 0.f;
        }
      }
#pragma unroll
      for (int x1 = 0; x1 < NQ1; ++x1) {
        if (Q1C || x1 < d.q1) {
          const float w = G1s[x1 * d.r1 + a];
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i][x1] = fmaf(w, gv[i], acc[i][x1]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = VEC == 4 ? j0 + 4 * lane + i : j0 + lane + 32 * i;
      if (j < d.K) {
        const int x2 = j / d.r2, b = j - x2 * d.r2;
#pragma unroll
        for (int x1 = 0; x1 < NQ1; ++x1)
          if (Q1C || x1 < d.q1) Pw[(x1 * d.q2 + x2) * d.ldP + b] = acc[i][x1];
      }
    }
  }
}

// One warp copies the g1 row i1 into G1s.
template <class DD>
__device__ __forceinline__ void tb_warp_load_g1(const DD& d, const float* __restrict__ g1, int i1,
                                                float* G1s, int lane) {
  const float* src = g1 + (size_t)i1 * d.Q1R1;
  for (int i = lane; i < d.Q1R1; i += 32) G1s[i] = __ldg(src + i);
}

// One warp writes rows[u] = P . g3[u_i3[u]] for the unique indices [ulo, uhi) of one
// group (P in Pw as tb_warp_prefix leaves it); each output is a sum over b ascending.
// D dividing 32: 32 / D ids at a time, a lane per output; else a lane per output, 32
// outputs at a time.
template <class DD>
__device__ __forceinline__ void tb_warp_apply(const DD& d, const float* Pw,
                                              const float* __restrict__ g3,
                                              const int* __restrict__ u_i3, int ulo, int uhi,
                                              float* __restrict__ rows, int lane) {
  const int per = (d.D <= 32 && 32 % d.D == 0) ? 32 / d.D : 1;
  const int js = per > 1 ? lane / d.D : 0;
  for (int o0 = 0; o0 < d.D; o0 += 32) {
    const int o = per > 1 ? lane % d.D : o0 + lane;
    if (o >= d.D) break;
    const int m = o / d.q3, z = o - m * d.q3;
    const float* pr = Pw + m * d.ldP;
    for (int u = ulo + js; u < uhi; u += per) {
      const int i3 = tb_clamp(__ldg(u_i3 + u), 0, d.p3 - 1);
      const float* c = g3 + (size_t)i3 * d.S3 + z;
      float acc = 0.f;
#pragma unroll 8
      for (int b = 0; b < d.r2; ++b) acc = fmaf(pr[b], __ldg(c + b * d.q3), acc);
      rows[(size_t)u * d.D + o] = acc;
    }
  }
}

// The block forms dP of the nb groups of a batch: dPs[k][m*r2 + b] = sum over u in
// [s_gs[k], s_ge[k]) ascending of (sum_z d_rows[u][m*q3 + z] g3[u_i3[u]][b][z]).
template <class DD>
__device__ __forceinline__ void tb_block_dP(const DD& d, int nb, const int* s_gs, const int* s_ge,
                                            const int* __restrict__ u_i3,
                                            const float* __restrict__ g3,
                                            const float* __restrict__ d_rows, float* dPs) {
  for (int e = threadIdx.x; e < nb * d.PSZ; e += blockDim.x) {
    const int k = e / d.PSZ, r = e - k * d.PSZ;
    const int m = r / d.r2, b = r - m * d.r2;
    const int ue = s_ge[k];
    float acc = 0.f;
#pragma unroll 2
    for (int u = s_gs[k]; u < ue; ++u) {
      const int i3 = tb_clamp(__ldg(u_i3 + u), 0, d.p3 - 1);
      const float* dr = d_rows + (size_t)u * d.D + m * d.q3;
      const float* c = g3 + (size_t)i3 * d.S3 + b * d.q3;
      float t = 0.f;
      for (int z = 0; z < d.q3; ++z) t = fmaf(__ldg(dr + z), __ldg(c + z), t);
      acc += t;
    }
    dPs[e] = acc;
  }
}

// Staging of tb_block_dP_staged: the d_rows row and the g3 row of up to tb_stage_ids(d)
// ids ([ids][tb_stage_ld(d)] floats, kTbStageFloats at most) per round.
constexpr int kTbStageFloats = 5120, kTbStageMaxIds = 64;
template <class DD>
__host__ __device__ inline int tb_stage_ld(const DD& d) {
  return tb_align4(d.D) + tb_align4(d.S3);
}
template <class DD>
__host__ __device__ inline int tb_stage_ids(const DD& d) {
  const int k = kTbStageFloats / tb_stage_ld(d);
  return k < 1 ? 1 : (k > kTbStageMaxIds ? kTbStageMaxIds : k);
}
template <class DD>
inline size_t tb_stage_bytes(const DD& d) {
  return sizeof(float) * (size_t)tb_stage_ids(d) * tb_stage_ld(d);
}

// F<Q3C>(args...) with Q3C = q3 when it is 4 or 8 (float4 paths), else F<0> (any q3).
#define TB_BY_Q3(q3, F, ...) \
  ((q3) == 4 ? F<4>(__VA_ARGS__) : (q3) == 8 ? F<8>(__VA_ARGS__) : F<0>(__VA_ARGS__))

// One round of tb_block_dP_staged: each element of dPs adds the terms of the round's ids
// of its group (ids [lo, hi) of the round), each term a sum over z ascending. Q3C: q3 when
// 4 or 8 (float4 reads of the staged rows), else 0 (any q3). Element r = x1 * K + j of
// group k's dP at dPs[(k * q1 + x1) * ldq + j] (ldq >= K; ldq == K: dPs[k * PSZ + r]).
template <int Q3C, class DD>
__device__ __forceinline__ void tb_stage_dP_round(const DD& d, int nb, int p0, int nr,
                                                  const int* s_pre, const float* Stg, int ldq,
                                                  float* dPs) {
  const int ld = tb_stage_ld(d), ldD = tb_align4(d.D), gstride = d.q1 * ldq;
  for (int r = threadIdx.x; r < d.PSZ; r += blockDim.x) {  // element r of every group's dP
    const int m = r / d.r2, b = r - m * d.r2;
    const int ro = r + (r / d.K) * (ldq - d.K);
    for (int k = 0; k < nb; ++k) {
      const int lo = max(s_pre[k], p0) - p0, hi = min(s_pre[k + 1], p0 + nr) - p0;
      if (lo >= hi) continue;
      float acc = dPs[k * gstride + ro];
      for (int i = lo; i < hi; ++i) {
        const float* dr = Stg + i * ld + m * d.q3;
        const float* c = Stg + i * ld + ldD + b * d.q3;
        float t = 0.f;
        if (Q3C > 0) {
#pragma unroll
          for (int z4 = 0; z4 < Q3C; z4 += 4) {
            const float4 dv = *reinterpret_cast<const float4*>(dr + z4);
            const float4 cv = *reinterpret_cast<const float4*>(c + z4);
            t = fmaf(dv.x, cv.x, t);
            t = fmaf(dv.y, cv.y, t);
            t = fmaf(dv.z, cv.z, t);
            t = fmaf(dv.w, cv.w, t);
          }
        } else {
          for (int z = 0; z < d.q3; ++z) t = fmaf(dr[z], c[z], t);
        }
        acc += t;
      }
      dPs[k * gstride + ro] = acc;
    }
  }
}

// tb_block_dP with every load of a round in flight at once: the nb (<= 32) groups' ids,
// taken group after group, in rounds of tb_stage_ids(d): the ids' g3 rows (u_i3, one
// load each), then their d_rows and g3 rows into Stg (float4 when vec: D and S3
// multiples of 4, both arrays 16-byte aligned), then each element of dPs adds the round's
// terms of its group in ascending u. Bitwise tb_block_dP (the same sums in the same
// order). dPs rows (group, x1) at stride ldq (tb_stage_dP_round; ldq == K: [nb][PSZ]),
// the whole [nb * q1][ldq] zeroed first. terms(p0, nr): the terms of a round's staged ids
// (tb_stage_dP_round, or the tensor-core round of cuda/batched/tb_dg2_mma_kernel.cuh). s_pre
// [nb + 1], s_u, s_i3 [kTbStageMaxIds]: shared scratch of the caller.
template <class DD, class Round>
__device__ __forceinline__ void tb_block_dP_staged(
    const DD& d, int nb, const int* s_gs, const int* s_ge, int* s_pre, int* s_u, int* s_i3,
    float* Stg, bool vec, const int* __restrict__ u_i3, const float* __restrict__ g3,
    const float* __restrict__ d_rows, float* dPs, int ldq, Round&& terms) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int NU = tb_stage_ids(d), ld = tb_stage_ld(d), ldD = tb_align4(d.D);
  if (tid == 0) {
    int p = 0;
    for (int k = 0; k < nb; ++k) {
      s_pre[k] = p;
      p += s_ge[k] - s_gs[k];
    }
    s_pre[nb] = p;
  }
  for (int e = tid; e < nb * d.q1 * ldq; e += nt) dPs[e] = 0.f;
  __syncthreads();
  const int total = s_pre[nb];
  for (int p0 = 0; p0 < total; p0 += NU) {
    const int nr = min(NU, total - p0);
    if (tid < nr) {
      const int p = p0 + tid;
      int k = 0;
      while (s_pre[k + 1] <= p) ++k;
      const int u = s_gs[k] + (p - s_pre[k]);
      s_u[tid] = u;
      s_i3[tid] = tb_clamp(__ldg(u_i3 + u), 0, d.p3 - 1);
    }
    __syncthreads();
    if (vec) {  // float4s: D/4 of the d_rows row, then S3/4 of the g3 row, per id
      const int D4 = d.D / 4, W4 = D4 + d.S3 / 4, n4 = nr * W4;
      for (int base = tid; base < n4; base += 4 * nt) {
        float4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e4 = base + j * nt;
          if (e4 < n4) {
            const int i = e4 / W4, q = e4 - i * W4;
            v[j] = q < D4
                       ? __ldg(reinterpret_cast<const float4*>(d_rows + (size_t)s_u[i] * d.D) + q)
                       : __ldg(reinterpret_cast<const float4*>(g3 + (size_t)s_i3[i] * d.S3) +
                               (q - D4));
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e4 = base + j * nt;
          if (e4 < n4) {
            const int i = e4 / W4, q = e4 - i * W4;
            *reinterpret_cast<float4*>(Stg + i * ld + 4 * q) = v[j];
          }
        }
      }
    } else {
      const int W = d.D + d.S3;
      for (int e = tid; e < nr * W; e += nt) {
        const int i = e / W, q = e - i * W;
        Stg[i * ld + (q < d.D ? q : ldD + q - d.D)] =
            q < d.D ? __ldg(d_rows + (size_t)s_u[i] * d.D + q)
                    : __ldg(g3 + (size_t)s_i3[i] * d.S3 + (q - d.D));
      }
    }
    __syncthreads();
    terms(p0, nr);
    __syncthreads();  // the round's staging is read
  }
}

}  // namespace flowtt::tb

// The Q1C template argument of the kernels for a TbFixedDims DD: its q1 when 1, 2, 4 or 8.
template <class DD>
constexpr int tb_fixed_q1c() {
  return DD::q1 == 1 || DD::q1 == 2 || DD::q1 == 4 || DD::q1 == 8 ? DD::q1 : 0;
}

// The kernel instance for q1 and dims type DD (register blocking over q1 when q1 is 1, 2,
// 4 or 8; a TbFixedDims DD has one q1). Inside a template (a launcher's generic lambda).
#define TB_BY_Q1(KERNEL, VEC, Q1V, DD)             \
  [&] {                                            \
    if constexpr (DD::kFixed)                      \
      return &KERNEL<tb_fixed_q1c<DD>(), VEC, DD>; \
    else                                           \
      return (Q1V) == 1   ? &KERNEL<1, VEC, DD>    \
             : (Q1V) == 2 ? &KERNEL<2, VEC, DD>    \
             : (Q1V) == 4 ? &KERNEL<4, VEC, DD>    \
             : (Q1V) == 8 ? &KERNEL<8, VEC, DD>    \
                          : &KERNEL<0, VEC, DD>;   \
  }()

// The Q3 template argument of the sorted-tile forward for a TbFixedDims DD (the path runs
// for q3 = 4 or 8 only: tb_tile_geo).
template <class DD>
constexpr int tb_tile_q3() {
  return DD::q3 == 8 ? 8 : 4;
}

// The sorted-tile forward for q3 (4 or 8) and dims type DD.
#define TB_TILE_KERNEL(Q3V, DD)                                                    \
  [&] {                                                                            \
    if constexpr (DD::kFixed)                                                      \
      return &tb_fwd_tile_kernel<tb_tile_q3<DD>(), DD>;                            \
    else                                                                           \
      return (Q3V) == 4 ? &tb_fwd_tile_kernel<4, DD> : &tb_fwd_tile_kernel<8, DD>; \
  }()
