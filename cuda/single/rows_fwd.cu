// Forward rows (flowtt_tt_rows_fwd, and the rows of flowtt_bag_fwd's chunks): the
// rows of the unique indices [lo, min(hi, num_unique)) into rows[u - lo], after the
// prefix map (cuda/single/prefix_map.cu). Persistent CTAs, two work queues (claim_tile):
//   phase 1 "tiles": a tile is one i2 column x kT1F consecutive i1 values, claimed by
//     a CTA; G2[i2] stays in shared memory for the whole tile (G2 is read ~p1/kT1F
//     times from L2 instead of once per group). Each group's P = G1[i1].G2[i2] is
//     formed on chip, then G3[i3] applied for the first kCH unique ids of the group.
//     A group with more than kCH unique ids publishes P to an L2 checkpoint slot and
//     sets a flag.
//   phase 2 "chunks": warps claim chunks c = unique indices [c*kCH, (c+1)*kCH); the
//     only work left in a chunk is the tail of (at most) one large group that started
//     before it: the warp waits for the group's flag, reloads P from the checkpoint
//     (ld.cg) and applies G3. Dependencies only point to tiles already claimed by
//     running CTAs: no deadlock.
// No per-id intermediate goes to HBM: rows are written once. Two kernels:
// rows_fwd_gemm_kernel (the fast path, shapes of the GEMM table in
// cuda/single/shape_dispatch.cuh) and rows_fwd_kernel (a warp per group, the fallback).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "common/common.cuh"
#include "single/prefix_product.cuh"
#include "single/scratch.h"
#include "single/shape_dispatch.cuh"
#include "single/stages.h"

#ifndef FLOWTT_FWD_MINB  // tuning knobs (CTAs per SM the compiler targets, smem cap)
#define FLOWTT_FWD_MINB 3
#endif
#ifndef FLOWTT_FWD_SMEM_KB
#define FLOWTT_FWD_SMEM_KB 100
#endif
#ifndef FLOWTT_FWD_APPLY_UNROLL  // tuning knobs: b steps of apply_team unrolled (M < 16, 16)
#define FLOWTT_FWD_APPLY_UNROLL 4
#endif
#ifndef FLOWTT_FWD_APPLY_UNROLL_M16
#define FLOWTT_FWD_APPLY_UNROLL_M16 16
#endif
#ifndef FLOWTT_FWD_GB  // tuning knob: groups per batch (0: the most that fit)
#define FLOWTT_FWD_GB 0
#endif

namespace flowtt {
namespace {

// A warp applies G3 for the unique ids [ulo, uhi) of one group: each lane
// keeps fixed outputs o (all index math hoisted out of the id loop).
__device__ __forceinline__ void warp_apply_g3(const Dev& d, const float* Pw,
                                              const float* __restrict__ g3,
                                              const int* __restrict__ uids, int ulo, int uhi,
                                              int lo, float* __restrict__ rows, int lane) {
  const int G3S = d.r2 * d.q3;
  if (d.D <= 32 && (32 % d.D) == 0) {
    const int per = 32 / d.D;
    const int o = lane % d.D, js = lane / d.D;
    const int m = o / d.q3, q = o - m * d.q3;
    const float* pr = Pw + m * d.R2p;
    for (int u = ulo + js; u < uhi; u += per) {
      const float* g = g3 + (size_t)id3(d, __ldg(uids + u)) * G3S + q;
      float acc = 0.f;
#pragma unroll 8
      for (int b = 0; b < d.r2; ++b) acc = fmaf(pr[b], __ldg(g + b * d.q3), acc);
      rows[(size_t)(u - lo) * d.D + o] = acc;
    }
  } else {
    for (int o0 = 0; o0 < d.D; o0 += 32) {
      const int o = o0 + lane;
      if (o >= d.D) break;
      const int m = o / d.q3, q = o - m * d.q3;
      const float* pr = Pw + m * d.R2p;
      for (int u = ulo; u < uhi; ++u) {
        const float* g = g3 + (size_t)id3(d, __ldg(uids + u)) * G3S + q;
        float acc = 0.f;
#pragma unroll 8
        for (int b = 0; b < d.r2; ++b) acc = fmaf(pr[b], __ldg(g + b * d.q3), acc);
        rows[(size_t)(u - lo) * d.D + o] = acc;
      }
    }
  }
}

// Checkpoint slot of a large group starting at unique index gs, for a
// forward pass over the unique range [lo, hi) (lo a multiple of kCH): 0 for
// the (only) group that starts before lo and reaches into the range, else
// (gs - lo) / kCH + 1 (distinct: large groups start > kCH apart). Slots
// needed: (hi - lo) / kCH + 2.
__device__ __forceinline__ int ckpt_slot(int gs, int lo) { return max(gs - lo + kCH, 0) / kCH; }

// Tiles [t_lo, t_hi) of the forward kernels that can hold groups of the
// unique range [lo, end) (tile t = i1 block t / p2, column t % p2): the i1
// blocks from the range's first to its last unique id.
__device__ __forceinline__ void range_tiles(const Dev& d, const int* __restrict__ uids, int lo,
                                            int end, int& t_lo, int& t_hi) {
  int a1, a2, a3, b1, b2, b3;
  split_id(d, uids[lo], a1, a2, a3);
  split_id(d, uids[end - 1], b1, b2, b3);
  t_lo = (a1 / kT1F) * d.p2;
  t_hi = (b1 / kT1F + 1) * d.p2;
}

// A forward kernel's counts (U unique ids, G groups), its unique range [lo, end), end =
// min(hi, U), and that range's tiles [t_lo, t_hi); false when the range is empty.
__device__ __forceinline__ bool fwd_range(const Dev& d, const int* __restrict__ counts, int n,
                                          const int* __restrict__ uids, int lo, int hi, int& U,
                                          int& G, int& end, int& t_lo, int& t_hi) {
  U = clampi(counts[0], 0, n);
  G = clampi(counts[1], 0, U);
  end = min(hi, U);
  if (lo >= end) return false;
  range_tiles(d, uids, lo, end, t_lo, t_hi);
  return true;
}

// Chunk phase of the forward kernels over the unique range [lo, end), end =
// min(hi, U): a warp claims the next chunk c of unique indices
// [c*kCH, (c+1)*kCH) from *counter (starting at lo / kCH). The only work in it
// is the tail [a, bnd) of (at most) one large group that started before it
// (the group of u0, found through the prefix map). Returns -1 when the chunks
// are exhausted, 0 when the chunk has no tail (or the plan is inconsistent),
// else 1 after waiting for the group's checkpoint flag (slot = its
// checkpoint slot).
__device__ __forceinline__ int claim_chunk_tail(const Dev& d, int* counter, int lo, int end, int U,
                                                int G, const int* __restrict__ goffs,
                                                const int* __restrict__ uids,
                                                const int* __restrict__ map, int* flags, int lane,
                                                int& a, int& bnd, int& slot) {
  int c = 0;
  if (lane == 0) c = claim_tile(counter);
  c = lo / kCH + __shfl_sync(0xffffffffu, c, 0);
  if ((long long)c * kCH >= end) return -1;
  const int u0 = c * kCH, u1 = min(u0 + kCH, end);
  int i1, i2, i3;  // the group holding u0, through the prefix map
  split_id(d, uids[u0], i1, i2, i3);
  const int g = map_group(map, d.p2, i1, i2);
  if (g < 0 || g >= G) return 0;
  int gs, ge;
  group_ids(goffs, g, U, gs, ge);
  if (u0 < gs || u0 >= ge) return 0;  // never, for a valid plan
  a = max(u0, gs + kCH);
  bnd = min(u1, ge);
  if (a >= bnd) return 0;
  slot = ckpt_slot(gs, lo);
  if (lane == 0) {
    while (atomicAdd(flags + slot, 0) == 0) __nanosleep(64);
    __threadfence();
  }
  __syncwarp();
  return 1;
}

// The chunk phase: each claimed chunk's tail [a, bnd) handed to tail(ck, a, bnd), ck the
// checkpointed P of its group ([PSZ] floats, written by the group's first chunk).
template <class Tail>
__device__ __forceinline__ void for_each_chunk_tail(const Dev& d, int* counter, int lo, int end,
                                                    int U, int G, const int* __restrict__ goffs,
                                                    const int* __restrict__ uids,
                                                    const int* __restrict__ map, int* flags,
                                                    const float* ckpt, int lane, Tail&& tail) {
  for (;;) {
    int a, bnd, slot;
    const int got =
        claim_chunk_tail(d, counter, lo, end, U, G, goffs, uids, map, flags, lane, a, bnd, slot);
    if (got < 0) break;
    if (got > 0) tail(ckpt + (size_t)slot * d.PSZ, a, bnd);
  }
}

// Both forward kernels compute the rows of unique indices [lo, min(hi, U))
// into rows[u - lo] (lo a multiple of kCH; the fused bag forward runs one
// range per chunk of its rows buffer).
template <int Q1C>
__global__ void __launch_bounds__(kThreads)
    rows_fwd_kernel(Dev d, const float* __restrict__ g1, const float* __restrict__ g2,
                    const float* __restrict__ g3, const int* __restrict__ uids,
                    const int* __restrict__ goffs, const int* __restrict__ counts, int n, int lo,
                    int hi, const int* __restrict__ map, int* ctrl, int* flags, float* ckpt,
                    float* __restrict__ rows) {
  extern __shared__ float4 smem4[];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  float* G2s = reinterpret_cast<float*>(smem4);
  float* G1w = G2s + align4(d.R1Q2R2) + warp * (align4(d.Q1R1) + align4(d.M * d.R2p));
  float* Pw = G1w + align4(d.Q1R1);
  __shared__ int s_item;
  __shared__ int s_g[kT1F];

  int U, G, end, t_lo, t_hi;
  if (!fwd_range(d, counts, n, uids, lo, hi, U, G, end, t_lo, t_hi)) return;

  // ---- phase 1: tiles (i2 column x kT1F i1 values), a warp per group ----
  for (;;) {
    const int t = claim_tile_block(ctrl, t_lo, s_item);
    if (t >= t_hi) break;
    int i1b, i2;
    const int gk = tile_prefix_group<kT1F>(
        d, map, t, i1b, i2, [&](int x) { return x < G && goffs[x] < end && goffs[x + 1] > lo; });
    if (tid < kT1F) s_g[tid] = gk;
    if (!__syncthreads_or(gk >= 0)) continue;
    load_smem(G2s, g2 + (size_t)i2 * d.R1Q2R2, d.R1Q2R2);
    __syncthreads();
    for (int k = warp; k < kT1F; k += nwarps) {
      const int g = s_g[k];
      if (g < 0) continue;
      warp_group_P<Q1C>(d, g1, i1b + k, G1w, G2s, d.q2 * d.r2, Pw, lane);
      int gs, ge;
      group_ids(goffs, g, U, gs, ge);
      const int sz = ge - gs;
      if (sz > kCH) {
        const int slot = ckpt_slot(gs, lo);
        float* ck = ckpt + (size_t)slot * d.PSZ;
        for (int w = lane; w < d.PSZ; w += 32) {
          const int m = w / d.r2, b = w - m * d.r2;
          __stcg(ck + w, Pw[m * d.R2p + b]);
        }
        __threadfence();
        __syncwarp();
        if (lane == 0) atomicExch(flags + slot, 1);
      }
      warp_apply_g3(d, Pw, g3, uids, max(gs, lo), min(gs + min(sz, kCH), end), lo, rows, lane);
      __syncwarp();
    }
    __syncthreads();
  }

  // ---- phase 2: tails of large groups, a warp per chunk ----
  for_each_chunk_tail(d, ctrl + 1, lo, end, U, G, goffs, uids, map, flags, ckpt, lane,
                      [&](const float* ck, int a, int bnd) {
                        for (int w = lane; w < d.PSZ; w += 32) {
                          const int m = w / d.r2, b = w - m * d.r2;
                          Pw[m * d.R2p + b] = __ldcg(ck + w);
                        }
                        __syncwarp();
                        warp_apply_g3(d, Pw, g3, uids, a, bnd, lo, rows, lane);
                        __syncwarp();
                      });
}

// ---- forward, GEMM tile kernel (the fast path) ----------------------------
// Used for the shapes of GemmShapes (cuda/single/shape_dispatch.cuh) with r2 % 4 == 0
// (else the warp kernel above). A tile is one i2 column x kT1F consecutive i1 values:
//   1. the tile's present groups (dense prefix map) are compacted and G2[i2]
//      goes to shared memory once per tile;
//   2. per batch of up to GB groups: their G1 rows (transposed, As[a][row])
//      to shared memory, then P of the whole batch as one small GEMM
//      [GB*q1, r1] x [r1, q2*r2], 8x4 outputs per thread, kept in shared
//      memory transposed as Ps[group][b][m] (row stride M + 4);
//   3. a team of T lanes per unique id (apply_team): four lanes split b, so
//      the id's G3 row is read in coalesced segments, multiply-add over their
//      b, a reduce-scatter over the four leaves each lane a quarter of its
//      rows, and the team's stores cover the row contiguously.
// Groups with more than kCH unique ids: the tile does the first kCH, writes
// P to the L2 checkpoint slot and sets its flag; the chunk phase (a warp per
// kCH-chunk of unique indices) finishes them from the checkpoint.
// Team of one unique id in apply_team: lane t = qh + QH*(tb + TB*ms) takes
// the four q of half qh, the b = tb, tb + TB, ... and the Mm rows m of block
// ms; after the reduce-scatter over tb it owns Mm / TB consecutive rows m.
template <int M, int Q3>
struct Team {
  static constexpr int QH = Q3 / 4;
  static constexpr int MS = M * 4 > 32 ? M * 4 / 32 : 1;
  static constexpr int Mm = M / MS;  // 4 or 8
  static constexpr int TB = 4;       // lanes splitting b
  static constexpr int LOG_TB = 2;
  static constexpr int OWN = Mm / TB;     // rows m a lane owns at the end
  static constexpr int T = QH * TB * MS;  // 4 .. 16
  static constexpr int LDM = M + 4;       // Ps row stride: conflict-free float4 reads
};

struct TileGeo {
  int GB, ldA, PT, ps_floats, smem_bytes;
};

__host__ __device__ inline TileGeo tile_geo(const Dev& d, int GB) {
  TileGeo g;
  g.GB = GB;
  g.ldA = (GB * d.q1 + kRPT - 1) / kRPT * kRPT;
  g.PT = d.r2 * (d.M + 4);  // [b][m], row stride M + 4
  g.ps_floats = GB * g.PT;  // the chunk phase: P of one warp per PT (min(GB, 8) warps)
  g.smem_bytes = (int)sizeof(float) * (d.r1 * d.q2 * d.r2 + d.r1 * g.ldA + g.ps_floats);
  return g;
}

// c ? a : b as one selp, so the compiler cannot turn a select between two
// elements of a register array into a dynamically indexed (local) load.
__device__ __forceinline__ float select(bool c, float a, float b) {
  float r;
  asm("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %3, 0;\n\tselp.f32 %0, %1, %2, p;\n\t}"
      : "=f"(r)
      : "f"(a), "f"(b), "r"((int)c));
  return r;
}

// Row of one unique id from its group's P (Pt: [b][m], stride LDM) and
// G3[i3], by a team of T lanes (t: lane in the team, tmask: the team's lanes
// in the warp). Fixed order: bitwise reproducible.
// b steps unrolled: D128 r64 (M 16, 16 steps a lane) all of them (harness rows_fwd 0.642 ->
// 0.616 ms at B65536; 8: 0.622, 2: 0.727); S1 (8 steps) 4 (2 to 16 within run-to-run noise).
template <int M>
constexpr int kApplyUnroll = M >= 16 ? FLOWTT_FWD_APPLY_UNROLL_M16 : FLOWTT_FWD_APPLY_UNROLL;
template <int M, int Q3>
__device__ __forceinline__ void apply_team(const Dev& d, const float* Pt,
                                           const float* __restrict__ g3, int id, int t,
                                           unsigned tmask, float* __restrict__ out) {
  using A = Team<M, Q3>;
  const int qh = t % A::QH, tb = (t / A::QH) % A::TB, ms = t / (A::QH * A::TB);
  float acc[A::Mm][4];
  zero_fill(acc);
  const float* g = g3 + (size_t)id3(d, id) * d.r2 * Q3 + qh * 4;
  const float* p = Pt + ms * A::Mm;
#pragma unroll(kApplyUnroll<M>)
  for (int b = tb; b < d.r2; b += A::TB) {  // r2 % TB == 0: same trip count
    const float4 gv = __ldg(reinterpret_cast<const float4*>(g + b * Q3));
#pragma unroll
    for (int i4 = 0; i4 < A::Mm / 4; ++i4) {
      const float4 pv = *reinterpret_cast<const float4*>(p + b * A::LDM + 4 * i4);
      const float pm[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[4 * i4 + i][0] = fmaf(pm[i], gv.x, acc[4 * i4 + i][0]);
        acc[4 * i4 + i][1] = fmaf(pm[i], gv.y, acc[4 * i4 + i][1]);
        acc[4 * i4 + i][2] = fmaf(pm[i], gv.z, acc[4 * i4 + i][2]);
        acc[4 * i4 + i][3] = fmaf(pm[i], gv.w, acc[4 * i4 + i][3]);
      }
    }
  }
  // reduce-scatter over the tb bits: level l keeps the half of the live rows
  // selected by bit l of tb and adds the partner's copy of it
  int mloc = 0;
#pragma unroll
  for (int l = 0; l < A::LOG_TB; ++l) {
    const int half = A::Mm >> (l + 1);
    const bool up = (tb >> l) & 1;
#pragma unroll
    for (int i = 0; i < half; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float send = select(up, acc[i][j], acc[i + half][j]);
        const float keep = select(up, acc[i + half][j], acc[i][j]);
        acc[i][j] = keep + __shfl_xor_sync(tmask, send, A::QH << l);
      }
    mloc += up ? half : 0;
  }
#pragma unroll
  for (int i = 0; i < A::OWN; ++i)
    *reinterpret_cast<float4*>(out + (ms * A::Mm + mloc + i) * Q3 + qh * 4) =
        make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

// MINB: CTAs per SM the kernel is compiled for (FLOWTT_FWD_MINB or kFwdMinbWide).
template <int M, int Q3, int MINB>
__global__ void __launch_bounds__(kGT, MINB)
    rows_fwd_gemm_kernel(Dev d, TileGeo geo, const float* __restrict__ g1,
                         const float* __restrict__ g2, const float* __restrict__ g3,
                         const int* __restrict__ uids, const int* __restrict__ goffs,
                         const int* __restrict__ counts, int n, int lo, int hi,
                         const int* __restrict__ map, int* ctrl, int* flags, float* ckpt,
                         float* __restrict__ rows) {
  using A = Team<M, Q3>;
  extern __shared__ float4 smem4[];
  const int NC = d.q2 * d.r2;
  float* G2s = reinterpret_cast<float*>(smem4);  // [r1][NC]
  float* As = G2s + d.r1 * NC;                   // [r1][ldA]
  float* Ps = As + d.r1 * geo.ldA;               // [GB][PT]
  __shared__ int s_next, s_n, s_w;
  __shared__ int s_k[kT1F], s_gs[kT1F], s_big[kT1F], s_sz[kT1F];
  __shared__ int s_pref[kT1F + 1];         // exclusive scan of the batch's sizes
  __shared__ int s_rowoff[kT1F * kQ1Max];  // G1 offset of each batch row
  const int tid = threadIdx.x, lane = tid & 31;
  int U, G, end, t_lo, t_hi;
  if (!fwd_range(d, counts, n, uids, lo, hi, U, G, end, t_lo, t_hi)) return;
  const int team = tid / A::T, nTeams = kGT / A::T, tl = tid % A::T;
  const unsigned tmask = A::T == 32 ? 0xffffffffu : ((1u << A::T) - 1u) << (lane & ~(A::T - 1));

  if (tid == 0) s_next = claim_tile(ctrl, t_lo);
  for (;;) {
    __syncthreads();
    const int t = s_next;
    if (t >= t_hi) break;
    int i1b, i2;
    int g = tile_prefix_group<kT1F>(d, map, t, i1b, i2, [&](int x) { return x < G; });
    if (tid < 32) {  // compact the present groups, scan their (capped) sizes
      int first = 0, cnt = 0, gs = 0, ge = 0;
      if (g >= 0) {
        group_ids(goffs, g, U, gs, ge);
        if (gs >= end || ge <= lo) g = -1;  // outside the range
        first = max(gs, lo);
        cnt = max(0, min(min(gs + kCH, ge), end) - first);
      }
      const unsigned bal = __ballot_sync(0xffffffffu, g >= 0);
      const int pos = __popc(bal & ((1u << tid) - 1u));
      if (g >= 0) {
        s_k[pos] = tid;
        s_gs[pos] = first;
        s_big[pos] = ge - gs > kCH ? ckpt_slot(gs, lo) : -1;
        s_sz[pos] = cnt;
      }
      if (tid == 0) s_n = __popc(bal);
    }
    int nxt = 0;
    if (tid == 0) nxt = claim_tile(ctrl, t_lo);  // next tile, used at the end
    __syncthreads();
    const int nG = s_n;
    if (nG > 0) load_smem(G2s, g2 + (size_t)i2 * d.R1Q2R2, d.R1Q2R2);
    __syncthreads();
    for (int k0 = 0; k0 < nG; k0 += geo.GB) {
      const int nB = min(geo.GB, nG - k0);
      if (tid < 32) {  // exclusive scan of the batch's sizes
        const int v = tid < nB ? s_sz[k0 + tid] : 0;
        int incl = v;
        for (int off = 1; off < 32; off <<= 1) {
          const int o = __shfl_up_sync(0xffffffffu, incl, off);
          if (tid >= off) incl += o;
        }
        if (tid < nB) s_pref[tid] = incl - v;
        if (tid == 31) s_w = incl;  // the batch's unique ids (nB <= 32)
      }
      const int nR = nB * d.q1;
      if (tid < nR) {  // G1 offset of each batch row (group k, q1)
        const int k = tid / d.q1;
        s_rowoff[tid] = (i1b + s_k[k0 + k]) * d.Q1R1 + (tid - k * d.q1) * d.r1;
      }
      __syncthreads();
      {  // As[a][row] = G1 rows, rows fastest (no bank conflicts), no divisions
        int a = tid / nR, row = tid - a * nR;
        const int da = kGT / nR, drow = kGT - da * nR;
        for (; a < d.r1; a += da, row += drow) {
          if (row >= nR) {
            row -= nR;
            ++a;
            if (a >= d.r1) break;
          }
          As[a * geo.ldA + row] = __ldg(g1 + s_rowoff[row] + a);
        }
      }
      __syncthreads();
      const int W = s_w;
      tile_gemm_P(d, As, geo.ldA, G2s, NC, nB * d.q1, Ps, geo.PT, A::LDM);
      __syncthreads();
      // checkpoint P of the groups split across chunks (compact [b][m], PSZ)
      bool wrote = false;
      for (int k = 0; k < nB; ++k) {
        const int slot = s_big[k0 + k];
        if (slot < 0) continue;
        float* ck = ckpt + (size_t)slot * d.PSZ;
        for (int w = tid; w < d.PSZ; w += kGT)
          __stcg(ck + w, Ps[k * geo.PT + (w / M) * A::LDM + w % M]);
        wrote = true;
      }
      if (__syncthreads_or(wrote)) {
        __threadfence();
        __syncthreads();
        if (tid < nB && s_big[k0 + tid] >= 0) atomicExch(flags + s_big[k0 + tid], 1);
      }
      // items uq -> (group k, unique u); the next item's id is loaded ahead
      auto locate = [&](int uq, int& k, int& u) {
        k = 0;  // last group of the batch with s_pref[k] <= uq
        for (int step = 16; step > 0; step >>= 1)
          if (k + step < nB && s_pref[k + step] <= uq) k += step;
        u = s_gs[k0 + k] + (uq - s_pref[k]);
      };
      int k = 0, u = 0, id = 0;
      if (team < W) {
        locate(team, k, u);
        id = __ldg(uids + u);
      }
      for (int uq = team; uq < W; uq += nTeams) {
        int kn = 0, un = 0, idn = 0;
        if (uq + nTeams < W) {
          locate(uq + nTeams, kn, un);
          idn = __ldg(uids + un);
        }
        apply_team<M, Q3>(d, Ps + k * geo.PT, g3, id, tl, tmask, rows + (size_t)(u - lo) * d.D);
        k = kn, u = un, id = idn;
      }
      __syncthreads();
    }
    if (tid == 0) s_next = nxt;
  }

  // ---- chunk phase: tails of large groups, a warp per chunk (the warps
  // that have a P buffer in Ps: all 8 unless the batch is under 8 groups) ----
  const int warp = tid >> 5;
  if ((warp + 1) * geo.PT > geo.ps_floats) return;
  float* Pw = Ps + warp * geo.PT;
  for_each_chunk_tail(d, ctrl + 1, lo, end, U, G, goffs, uids, map, flags, ckpt, lane,
                      [&](const float* ck, int a, int bnd) {
                        for (int w = lane; w < d.PSZ; w += 32)
                          Pw[(w / M) * A::LDM + w % M] = __ldcg(ck + w);
                        __syncwarp();
                        for (int u = a + lane / A::T; u < bnd; u += 32 / A::T)
                          apply_team<M, Q3>(d, Pw, g3, __ldg(uids + u), lane % A::T, tmask,
                                            rows + (size_t)(u - lo) * d.D);
                        __syncwarp();
                      });
}

// Groups per batch of the GEMM forward tile (the most, up to kT1F or FLOWTT_FWD_GB,
// whose shared memory fits FLOWTT_FWD_SMEM_KB), or 0 when the GEMM kernel does not
// take these dims (then the warp kernel runs). The rows do not depend on it.
int gemm_batch_groups(const Dev& d) {
  if (!gemm_dims(d)) return 0;
  for (int GB = FLOWTT_FWD_GB > 0 ? FLOWTT_FWD_GB : kT1F; GB >= 1; --GB)
    if (tile_geo(d, GB).smem_bytes <= FLOWTT_FWD_SMEM_KB * 1024) return GB;
  return 0;
}

// The GEMM kernel is compiled for FLOWTT_FWD_MINB CTAs per SM (S1: 72 KB of shared memory
// each, three fit) where that many fit by shared memory, else for kFwdMinbWide: past ~73 KB
// (D128 r64: 90 KB) two CTAs fit, and compiled for two they have 128 registers instead of
// 80 and no spills (harness rows_fwd at D128 r64 B65536: 0.714 -> 0.639 ms).
constexpr int kFwdMinbWide = 2;

}  // namespace

size_t fwd_smem(const Dev& d) {
  return sizeof(float) *
         (size_t)(align4(d.R1Q2R2) + (kThreads / 32) * (align4(d.Q1R1) + align4(d.M * d.R2p)));
}

cudaError_t launch_rows_fwd_range(const Dev& d, const float* g1, const float* g2, const float* g3,
                                  const int* unique_ids, const int* group_offsets,
                                  const int* counts, int n, int lo, int range, const FwdScratch& s,
                                  int p, float* rows, cudaStream_t stream) {
  int* ctrl = s.pass_ctrl(p);
  int* flags = ctrl + 2;
  const int sms = num_sms();
  const int hi = lo + range;
  const int GB = gemm_batch_groups(d);
  cudaError_t err = cudaSuccess;
  if (GB > 0) {
    const TileGeo geo = tile_geo(d, GB);
    auto launch_gemm = [&](auto shape) {
      using S = decltype(shape);
      auto launch = [&](auto kernel, int occ) {
        err = launch_persistent_at<kGT>(kernel, geo.smem_bytes, occ, stream, sms, d, geo, g1, g2,
                                        g3, unique_ids, group_offsets, counts, n, lo, hi, s.map,
                                        ctrl, flags, s.ckpt, rows);
      };
      auto narrow = rows_fwd_gemm_kernel<S::M, S::Q3, FLOWTT_FWD_MINB>;
      auto wide = rows_fwd_gemm_kernel<S::M, S::Q3, kFwdMinbWide>;
      int occ = 0;
      if ((err = ctas_per_sm<kGT>(narrow, geo.smem_bytes, occ)) != cudaSuccess) return;
      if (occ >= FLOWTT_FWD_MINB)
        launch(narrow, occ);
      else if ((err = ctas_per_sm<kGT>(wide, geo.smem_bytes, occ)) == cudaSuccess)
        launch(wide, occ);
    };
    if (GemmShapes::dispatch(launch_gemm, d.M, d.q3)) return err;
  }
  const size_t smem = fwd_smem(d);
  auto launch_warp = [&](auto shape) {
    using S = decltype(shape);
    err = launch_persistent(rows_fwd_kernel<S::Q1>, smem, stream, sms, d, g1, g2, g3, unique_ids,
                            group_offsets, counts, n, lo, hi, s.map, ctrl, flags, s.ckpt, rows);
  };
  if (!WarpFwdShapes::dispatch(launch_warp, d.q1)) launch_warp(WarpFwdGeneric{});
  return err;
}

}  // namespace flowtt
