// FlowTT CUDA kernels (sm_90). See cuda/NOTES.md for the design and the
// measured numbers, docs/op_contract.md for the op semantics.
//
// Forward (flowtt_tt_rows_fwd):
//   1. memset the dense prefix map [p1*p2] to -1 and the work counters /
//      checkpoint flags to 0 (scratch, on the stream).
//   2. build_map: map[i1*p2+i2] = g for every prefix group g (and zero the
//      padding rows u >= num_unique).
//   3. rows_fwd_kernel: persistent CTAs, two work queues (atomic counters):
//      phase 1 "tiles": a tile is one i2 column x kT1F consecutive i1 values,
//        claimed by a CTA; G2[i2] stays in shared memory for the whole tile
//        (G2 is read ~p1/kT1F times from L2 instead of once per group). Each
//        warp takes whole groups of the tile: P = G1[i1].G2[i2] in its own
//        shared-memory slice (register-blocked over q1 and 4 columns/lane),
//        then G3[i3] applied for the first kCH unique ids of the group. A group
//        with more than kCH unique ids publishes P to an L2 checkpoint slot
//        (slot = group_start / kCH, unique per large group) and sets a flag.
//      phase 2 "chunks": warps claim chunks c = unique indices
//        [c*kCH, (c+1)*kCH); the only work left in a chunk is the tail of (at
//        most one) large group that started before it: the warp waits for the
//        group's flag, reloads P from the checkpoint (ld.cg) and applies G3.
//        Dependencies only point to tiles already claimed by running CTAs:
//        no deadlock.
//   No per-id intermediate goes to HBM: rows are written once.
// Backward (flowtt_tt_rows_bwd), every reduction in a fixed order (bitwise
// reproducible, no float atomics):
//   tile kernel (i2 column x kT1B i1 values, G2[i2] in shared memory): a warp
//     per group recomputes P (stored for dG3), dP = sum_u dRow_u G3[i3_u]^T
//     (stored), and the group's dG1 partial dP.G2^T; then the CTA forms the
//     tile's dG2 partial sum_k G1[i1_k]^T dP_k (groups in i1 order).
//   dg2_reduce: dG2[i2] = sum of the tile partials, i1-blocks in order.
//   dg1_reduce: dG1[i1] = sum of the group partials of i1, i2 ascending.
//   dG3: unique ids stably radix-sorted by i3 (cub), bucket bounds, then fixed
//     parts of each bucket summed (P_g^T dRow_u) and the parts combined in
//     order.
// Pooling: forward one thread team per bag, ids in increasing k; backward
//   d_rows by a segmented reduction over the sorted order (chunks of kPL
//   sorted positions + a fixed-order combine of the chunk partials of hot
//   ids), d_weights one team per id.
#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda/ops.h"

namespace flowtt {
namespace {

constexpr int kThreads = 256;
constexpr int kT1F = 32;   // i1 values per forward tile
constexpr int kQ1Max = 8;  // register blocking bound for q1
constexpr int kJ = 4;      // columns per lane in warp_compute_P
#ifndef FLOWTT_DG3_PARTS
#define FLOWTT_DG3_PARTS 8
#endif
constexpr int kS3 = FLOWTT_DG3_PARTS;  // parts per i3 bucket in the dG3 pass
constexpr int kMMax = 16;  // q1*q2 bound (backward register blocking)
constexpr int kQ3Max = 8;  // q3 bound
constexpr int kBB = 2;     // r2 <= 64: columns b per lane
constexpr int kAMax = 64;  // r1 bound
constexpr int kKC = 16;    // K rows per dG2 staging chunk
constexpr int kT1B = 32;   // i1 values per backward tile
constexpr int kCH = 64;    // unique ids per chunk (split threshold)
constexpr int kBatch = 256;

struct Dev {
  int p1, p2, p3, q1, q2, q3, r1, r2;
  int D, M, Q1R1, R1Q2R2, PSZ, R2p;
  long long nrows;
};

Dev make_dev(const TTDims& t) {
  Dev d;
  d.p1 = t.p1; d.p2 = t.p2; d.p3 = t.p3;
  d.q1 = t.q1; d.q2 = t.q2; d.q3 = t.q3;
  d.r1 = t.r1; d.r2 = t.r2;
  d.D = t.q1 * t.q2 * t.q3;
  d.M = t.q1 * t.q2;
  d.Q1R1 = t.q1 * t.r1;
  d.R1Q2R2 = t.r1 * t.q2 * t.r2;
  d.PSZ = d.M * t.r2;
  d.R2p = t.r2 + 1;
  d.nrows = (long long)t.p1 * t.p2 * t.p3;
  return d;
}

inline size_t align_up(size_t x, size_t a = 256) { return (x + a - 1) / a * a; }
__host__ __device__ inline int align4(int x) { return (x + 3) & ~3; }

__device__ __forceinline__ int clampi(int v, int lo, int hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ void split_id(const Dev& d, int id, int& i1,
                                         int& i2, int& i3) {
  long long c = id;
  if (c < 0) c = 0;
  if (c >= d.nrows) c = d.nrows - 1;
  const int cc = (int)c;
  i3 = cc % d.p3;
  const int t = cc / d.p3;
  i2 = t % d.p2;
  i1 = t / d.p2;
}

__device__ __forceinline__ void load_smem(float* dst,
                                          const float* __restrict__ src,
                                          int n) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) &
       15) == 0) {
    const int n4 = n >> 2;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = __ldg(s4 + i);
    for (int i = (n4 << 2) + threadIdx.x; i < n; i += blockDim.x)
      dst[i] = __ldg(src + i);
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldg(src + i);
  }
}

__device__ __forceinline__ int id3(const Dev& d, int id) {
  long long c = id;
  if (c < 0) c = 0;
  if (c >= d.nrows) c = d.nrows - 1;
  return (int)c % d.p3;
}

// A warp applies G3 for the unique ids [ulo, uhi) of one group: each lane
// keeps fixed outputs o (all index math hoisted out of the id loop).
__device__ __forceinline__ void warp_apply_g3(const Dev& d, const float* Pw,
                                              const float* __restrict__ g3,
                                              const int* __restrict__ uids,
                                              int ulo, int uhi, int lo,
                                              float* __restrict__ rows,
                                              int lane) {
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
        for (int b = 0; b < d.r2; ++b)
          acc = fmaf(pr[b], __ldg(g + b * d.q3), acc);
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
__device__ __forceinline__ int ckpt_slot(int gs, int lo) {
  return max(gs - lo + kCH, 0) / kCH;
}

// Tiles [t_lo, t_hi) of the forward kernels that can hold groups of the
// unique range [lo, end) (tile t = i1 block t / p2, column t % p2): the i1
// blocks from the range's first to its last unique id.
__device__ __forceinline__ void range_tiles(const Dev& d, const int* __restrict__ uids,
                                            int lo, int end, int& t_lo, int& t_hi) {
  int a1, a2, a3, b1, b2, b3;
  split_id(d, uids[lo], a1, a2, a3);
  split_id(d, uids[end - 1], b1, b2, b3);
  t_lo = (a1 / kT1F) * d.p2;
  t_hi = (b1 / kT1F + 1) * d.p2;
}

// Chunk phase of the forward kernels over the unique range [lo, end), end =
// min(hi, U): a warp claims the next chunk c of unique indices
// [c*kCH, (c+1)*kCH) from *counter (starting at lo / kCH). The only work in it
// is the tail [a, bnd) of (at most) one large group that started before it
// (the group of u0, found through the prefix map). Returns -1 when the chunks
// are exhausted, 0 when the chunk has no tail (or the plan is inconsistent),
// else 1 after waiting for the group's checkpoint flag (slot = its
// checkpoint slot).
__device__ __forceinline__ int claim_chunk_tail(
    const Dev& d, int* counter, int lo, int end, int U, int G,
    const int* __restrict__ goffs, const int* __restrict__ uids,
    const int* __restrict__ map, int* flags, int lane, int& a, int& bnd,
    int& slot) {
  int c = 0;
  if (lane == 0) c = atomicAdd(counter, 1);
  c = lo / kCH + __shfl_sync(0xffffffffu, c, 0);
  if ((long long)c * kCH >= end) return -1;
  const int u0 = c * kCH, u1 = min(u0 + kCH, end);
  int i1, i2, i3;  // the group holding u0, through the prefix map
  split_id(d, uids[u0], i1, i2, i3);
  const int g = map[i1 * d.p2 + i2];
  if (g < 0 || g >= G) return 0;
  const int gs = clampi(goffs[g], 0, U);
  const int ge = clampi(goffs[g + 1], gs, U);
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

__global__ void build_map_kernel(Dev d, const int* __restrict__ uids,
                                 const int* __restrict__ goffs,
                                 const int* __restrict__ counts, int n,
                                 int* __restrict__ map) {
  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int stride = gridDim.x * blockDim.x;
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < G; g += stride) {
    const int gs = clampi(goffs[g], 0, n - 1);
    int i1, i2, i3;
    split_id(d, uids[gs], i1, i2, i3);
    map[i1 * d.p2 + i2] = g;
  }
}

// One warp forms P for one group: lanes own columns j = (q2, b) (kJ per
// lane) and all q1 rows, so each G2 element read from shared memory feeds
// q1 FMAs and each (broadcast) G1 element kJ FMAs.
template <int Q1C>
__device__ __forceinline__ void warp_compute_P(const Dev& d, const float* G1w,
                                               const float* G2s, int ld2,
                                               float* Pw, int lane) {
  const int Q2R2 = d.q2 * d.r2;
  for (int j0 = 0; j0 < Q2R2; j0 += 32 * kJ) {
    constexpr int NQ1 = Q1C ? Q1C : kQ1Max;
    float acc[kJ][NQ1];
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj)
#pragma unroll
      for (int q1 = 0; q1 < NQ1; ++q1) acc[jj][q1] = 0.f;
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
          for (int jj = 0; jj < kJ; ++jj)
            acc[jj][q1] = fmaf(g1v, g2v[jj], acc[jj][q1]);
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

// Both forward kernels compute the rows of unique indices [lo, min(hi, U))
// into rows[u - lo] (lo a multiple of kCH; the fused bag forward runs one
// range per chunk of its rows buffer).
template <int Q1C>
__global__ void __launch_bounds__(kThreads)
    rows_fwd_kernel(Dev d, const float* __restrict__ g1,
                    const float* __restrict__ g2, const float* __restrict__ g3,
                    const int* __restrict__ uids,
                    const int* __restrict__ goffs,
                    const int* __restrict__ counts, int n, int lo, int hi,
                    const int* __restrict__ map, int* ctrl, int* flags,
                    float* ckpt, float* __restrict__ rows) {
  extern __shared__ float4 smem4[];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  float* G2s = reinterpret_cast<float*>(smem4);
  float* G1w = G2s + align4(d.R1Q2R2) +
               warp * (align4(d.Q1R1) + align4(d.M * d.R2p));
  float* Pw = G1w + align4(d.Q1R1);
  __shared__ int s_item;
  __shared__ int s_g[kT1F];

  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int end = min(hi, U);
  if (lo >= end) return;
  int t_lo, t_hi;
  range_tiles(d, uids, lo, end, t_lo, t_hi);

  // ---- phase 1: tiles (i2 column x kT1F i1 values), a warp per group ----
  for (;;) {
    if (tid == 0) s_item = t_lo + atomicAdd(ctrl, 1);
    __syncthreads();
    const int t = s_item;
    __syncthreads();
    if (t >= t_hi) break;
    const int i2 = t % d.p2;
    const int i1b = (t / d.p2) * kT1F;
    int gk = -1;
    if (tid < kT1F) {
      if (i1b + tid < d.p1) {
        gk = map[(i1b + tid) * d.p2 + i2];
        if (gk < 0 || gk >= G || goffs[gk] >= end || goffs[gk + 1] <= lo) gk = -1;
      }
      s_g[tid] = gk;
    }
    if (!__syncthreads_or(gk >= 0)) continue;
    load_smem(G2s, g2 + (size_t)i2 * d.R1Q2R2, d.R1Q2R2);
    __syncthreads();
    for (int k = warp; k < kT1F; k += nwarps) {
      const int g = s_g[k];
      if (g < 0) continue;
      const int gs = clampi(goffs[g], 0, U);
      const int ge = clampi(goffs[g + 1], gs, U);
      const float* g1s = g1 + (size_t)(i1b + k) * d.Q1R1;
      for (int i = lane; i < d.Q1R1; i += 32) G1w[i] = __ldg(g1s + i);
      __syncwarp();
      warp_compute_P<Q1C>(d, G1w, G2s, d.q2 * d.r2, Pw, lane);
      __syncwarp();
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
      warp_apply_g3(d, Pw, g3, uids, max(gs, lo), min(gs + min(sz, kCH), end), lo, rows,
                    lane);
      __syncwarp();
    }
    __syncthreads();
  }

  // ---- phase 2: tails of large groups, a warp per chunk ----
  for (;;) {
    int a, bnd, slot;
    const int got = claim_chunk_tail(d, ctrl + 1, lo, end, U, G, goffs, uids, map, flags, lane,
                                     a, bnd, slot);
    if (got < 0) break;
    if (got == 0) continue;
    const float* ck = ckpt + (size_t)slot * d.PSZ;
    for (int w = lane; w < d.PSZ; w += 32) {
      const int m = w / d.r2, b = w - m * d.r2;
      Pw[m * d.R2p + b] = __ldcg(ck + w);
    }
    __syncwarp();
    warp_apply_g3(d, Pw, g3, uids, a, bnd, lo, rows, lane);
    __syncwarp();
  }
}

// ---- forward, GEMM tile kernel (the fast path) ----------------------------
// Used when q3 in {4, 8}, q1*q2 in {4, 8, 16} and r2 % 4 == 0 (else the warp
// kernel above). A tile is one i2 column x kT1F consecutive i1 values:
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
constexpr int kGT = 256;  // threads of the GEMM tile kernel
#ifndef FLOWTT_FWD_MINB  // tuning knobs (CTAs per SM the compiler targets, smem cap)
#define FLOWTT_FWD_MINB 3
#endif
#ifndef FLOWTT_BWD_MINB
#define FLOWTT_BWD_MINB 3
#endif
#ifndef FLOWTT_FWD_SMEM_KB
#define FLOWTT_FWD_SMEM_KB 100
#endif
constexpr int kRPT = 8;   // GEMM rows per thread

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
  g.smem_bytes = (int)sizeof(float) *
                 (d.r1 * d.q2 * d.r2 + d.r1 * g.ldA + g.ps_floats);
  return g;
}

// c ? a : b as one selp, so the compiler cannot turn a select between two
// elements of a register array into a dynamically indexed (local) load.
__device__ __forceinline__ float select(bool c, float a, float b) {
  float r;
  asm("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %3, 0;\n\tselp.f32 %0, %1, %2, p;\n\t}"
      : "=f"(r) : "f"(a), "f"(b), "r"((int)c));
  return r;
}

// Row of one unique id from its group's P (Pt: [b][m], stride LDM) and
// G3[i3], by a team of T lanes (t: lane in the team, tmask: the team's lanes
// in the warp). Fixed order: bitwise reproducible.
template <int M, int Q3>
__device__ __forceinline__ void apply_team(const Dev& d, const float* Pt,
                                           const float* __restrict__ g3,
                                           int id, int t, unsigned tmask,
                                           float* __restrict__ out) {
  using A = Team<M, Q3>;
  const int qh = t % A::QH, tb = (t / A::QH) % A::TB, ms = t / (A::QH * A::TB);
  float acc[A::Mm][4];
#pragma unroll
  for (int i = 0; i < A::Mm; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  const float* g = g3 + (size_t)id3(d, id) * d.r2 * Q3 + qh * 4;
  const float* p = Pt + ms * A::Mm;
#pragma unroll 4
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

// P of the nR rows (group k, q1) of a batch = A . G2, kRPT x 4 outputs per
// thread (float4 loads of A^T and G2 from shared memory), stored as
// Ps[k][m][b] (m = q1*q2 index, group stride PT) when ldm == 0, else
// transposed as Ps[k][b][m] with row stride ldm (the forward's layout).
// As: [r1][ldA], G2s: [r1][ldB].
__device__ __forceinline__ void tile_gemm_P(const Dev& d, const float* As,
                                            int ldA, const float* G2s, int ldB,
                                            int nR, float* Ps, int PT,
                                            int ldm = 0) {
  const int NC4 = d.q2 * d.r2 / 4;
  const int nRB = (nR + kRPT - 1) / kRPT;
  for (int it = threadIdx.x; it < NC4 * nRB; it += kGT) {
    const int rb = it / NC4, c4 = it - rb * NC4;
    float acc[kRPT][4];
#pragma unroll
    for (int i = 0; i < kRPT; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    const float* ap = As + rb * kRPT;
    const float* bp = G2s + c4 * 4;
#pragma unroll 4
    for (int a = 0; a < d.r1; ++a) {
      const float4 a0 = *reinterpret_cast<const float4*>(ap + a * ldA);
      const float4 a1 = *reinterpret_cast<const float4*>(ap + a * ldA + 4);
      const float4 bv = *reinterpret_cast<const float4*>(bp + a * ldB);
      const float av[kRPT] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < kRPT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bw[j], acc[i][j]);
    }
    const int q2 = (c4 * 4) / d.r2, b0 = c4 * 4 - q2 * d.r2;  // r2 % 4 == 0
#pragma unroll
    for (int i = 0; i < kRPT; ++i) {
      const int row = rb * kRPT + i;
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

template <int M, int Q3>
__global__ void __launch_bounds__(kGT, FLOWTT_FWD_MINB)
    rows_fwd_gemm_kernel(Dev d, TileGeo geo, const float* __restrict__ g1,
                         const float* __restrict__ g2,
                         const float* __restrict__ g3,
                         const int* __restrict__ uids,
                         const int* __restrict__ goffs,
                         const int* __restrict__ counts, int n, int lo, int hi,
                         const int* __restrict__ map, int* ctrl, int* flags,
                         float* ckpt, float* __restrict__ rows) {
  using A = Team<M, Q3>;
  extern __shared__ float4 smem4[];
  const int NC = d.q2 * d.r2;
  float* G2s = reinterpret_cast<float*>(smem4);  // [r1][NC]
  float* As = G2s + d.r1 * NC;                   // [r1][ldA]
  float* Ps = As + d.r1 * geo.ldA;               // [GB][PT]
  __shared__ int s_next, s_n, s_w;
  __shared__ int s_k[kT1F], s_gs[kT1F], s_big[kT1F], s_sz[kT1F];
  __shared__ int s_pref[kT1F + 1];  // exclusive scan of the batch's sizes
  __shared__ int s_rowoff[kT1F * kQ1Max];  // G1 offset of each batch row
  const int tid = threadIdx.x, lane = tid & 31;
  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int end = min(hi, U);
  if (lo >= end) return;
  int t_lo, t_hi;
  range_tiles(d, uids, lo, end, t_lo, t_hi);
  const int team = tid / A::T, nTeams = kGT / A::T, tl = tid % A::T;
  const unsigned tmask =
      A::T == 32 ? 0xffffffffu : ((1u << A::T) - 1u) << (lane & ~(A::T - 1));

  if (tid == 0) s_next = t_lo + atomicAdd(ctrl, 1);
  for (;;) {
    __syncthreads();
    const int t = s_next;
    if (t >= t_hi) break;
    const int i2 = t % d.p2;
    const int i1b = (t / d.p2) * kT1F;
    if (tid < 32) {  // compact the present groups, scan their (capped) sizes
      int g = -1, first = 0, cnt = 0, gs = 0, ge = 0;
      if (tid < kT1F && i1b + tid < d.p1) {
        g = map[(i1b + tid) * d.p2 + i2];
        if (g >= G) g = -1;
      }
      if (g >= 0) {
        gs = clampi(goffs[g], 0, U);
        ge = clampi(goffs[g + 1], gs, U);
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
    if (tid == 0) nxt = t_lo + atomicAdd(ctrl, 1);  // next tile, used at the end
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
          if (row >= nR) { row -= nR; ++a; if (a >= d.r1) break; }
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
        apply_team<M, Q3>(d, Ps + k * geo.PT, g3, id, tl, tmask,
                          rows + (size_t)(u - lo) * d.D);
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
  for (;;) {
    int a, bnd, slot;
    const int got = claim_chunk_tail(d, ctrl + 1, lo, end, U, G, goffs, uids, map, flags, lane,
                                     a, bnd, slot);
    if (got < 0) break;
    if (got == 0) continue;
    const float* ck = ckpt + (size_t)slot * d.PSZ;
    for (int w = lane; w < d.PSZ; w += 32) Pw[(w / M) * A::LDM + w % M] = __ldcg(ck + w);
    __syncwarp();
    for (int u = a + lane / A::T; u < bnd; u += 32 / A::T)
      apply_team<M, Q3>(d, Pw, g3, __ldg(uids + u), lane % A::T, tmask,
                        rows + (size_t)(u - lo) * d.D);
    __syncwarp();
  }
}

// --------------------------- backward ---------------------------------------

// Backward tile: i2 column x kT1B i1 values. G2[i2] stays in shared memory
// (rows padded to ld = q2*r2+1). Each warp takes whole groups: P (stored for
// the dG3 pass), dP = sum_u dRow_u G3[i3_u]^T (stored), the group's dG1
// partial dP.G2^T. Then the CTA forms this tile's dG2 partial
// sum_k G1[i1_k]^T dP_k (groups in i1 order) with register accumulators.
template <int Q1C, int MC, int Q3C, int BBC>
__global__ void __launch_bounds__(kThreads)
    rows_bwd_tile_kernel(Dev d, const float* __restrict__ g1,
                         const float* __restrict__ g2,
                         const float* __restrict__ g3,
                         const float* __restrict__ d_rows,
                         const int* __restrict__ uids,
                         const int* __restrict__ goffs,
                         const int* __restrict__ counts, int n,
                         const int* __restrict__ map, int* ctrl,
                         int* __restrict__ tile_flag, float* __restrict__ Pbuf,
                         float* __restrict__ dPbuf, float* __restrict__ dG1p,
                         float* __restrict__ dG2p, int slots) {
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
    if (tid == 0) s_item = atomicAdd(ctrl, 1);
    __syncthreads();
    const int t = s_item;
    __syncthreads();
    if (t >= nTiles) break;
    const int i2 = t % d.p2;
    const int i1b = (t / d.p2) * kT1B;
    int gk = -1;
    if (tid < kT1B) {
      if (i1b + tid < d.p1) {
        gk = map[(i1b + tid) * d.p2 + i2];
        if (gk >= G || gk >= slots) gk = -1;
      }
      s_g[tid] = gk;
    }
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
      if (tid == 0) tile_flag[t] = 0;
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
      const int gs = clampi(goffs[g], 0, U);
      const int ge = clampi(goffs[g + 1], gs, U);
      const float* g1s = g1 + (size_t)(i1b + k) * d.Q1R1;
      for (int i = lane; i < d.Q1R1; i += 32) G1w[i] = __ldg(g1s + i);
      __syncwarp();
      warp_compute_P<Q1C>(d, G1w, G2s, LS, Pw, lane);
      __syncwarp();
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
#pragma unroll
      for (int bb = 0; bb < NBB; ++bb)
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[bb][m] = 0.f;
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
                for (int bb = 0; bb < NBB; ++bb)
                  acc[bb][m] = fmaf(dv, g3v[bb][q], acc[bb][m]);
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
                if (Q1C || q1 < d.q1)
                  s1[q1] = fmaf(Pw[(q1 * d.q2 + q2) * d.R2p + b], gv, s1[q1]);
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
    // ---- tile dG2 partial: C[a, j] = sum_{k, q1} G1[i1_k, q1, a] dP_k[q1, j]
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
                  for (int i = ib * 16; i < ib * 16 + 16; ++i)
                    c[i] = fmaf(ar[i], bv, c[i]);
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
          float* out = dG2p + (size_t)t * d.R1Q2R2;
#pragma unroll
          for (int i = 0; i < kAMax; ++i)
            if (i < NA && a0 + i < d.r1) out[(size_t)(a0 + i) * NJ + j] = c[i];
        }
        __syncthreads();
      }
    }
    if (tid == 0) tile_flag[t] = 1;
  }
}

// ---- backward, GEMM tile kernel (the fast path) ----------------------------
// Same tiles as the forward GEMM kernel (i2 column x kT1B i1 values) and the
// same outputs as rows_bwd_tile_kernel: Pbuf[g] (P, [m][b]), dG1p[g],
// dG2p[t] + tile_flag[t]. Per batch of up to GB groups:
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
  g.smem_bytes = (int)sizeof(float) *
                 (d.r1 * g.ldG2 + d.r1 * NC + d.r1 * g.ldA + GB * g.PT);
  return g;
}

template <int M, int Q3>
__global__ void __launch_bounds__(kGT, FLOWTT_BWD_MINB)
    rows_bwd_gemm_kernel(Dev d, BwdGeo geo, const float* __restrict__ g1,
                         const float* __restrict__ g2,
                         const float* __restrict__ g3,
                         const float* __restrict__ d_rows,
                         const int* __restrict__ uids,
                         const int* __restrict__ goffs,
                         const int* __restrict__ counts, int n,
                         const int* __restrict__ map, int* ctrl,
                         int* __restrict__ tile_flag, float* __restrict__ Pbuf,
                         float* __restrict__ dG1p, float* __restrict__ dG2p,
                         int slots) {
  constexpr int MB2 = (32 / Q3) < M ? (32 / Q3) : M;  // rows m per dP item
  constexpr int NMB2 = M / MB2;
  extern __shared__ float4 smem4[];
  const int NC = d.q2 * d.r2;
  float* G2s = reinterpret_cast<float*>(smem4);  // [r1][ldG2]
  float* dG2s = G2s + d.r1 * geo.ldG2;           // [r1][NC], the tile's dG2
  float* As = dG2s + d.r1 * NC;                  // [r1][ldA], G1 transposed
  float* PD = As + d.r1 * geo.ldA;               // [GB][PT]: P, then dP
  __shared__ int s_next, s_n;
  __shared__ int s_k[kT1B], s_g[kT1B], s_gs[kT1B], s_ge[kT1B];
  const int tid = threadIdx.x;
  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int nTiles = (d.p1 + kT1B - 1) / kT1B * d.p2;
  const int NC4 = NC / 4, R14 = d.r1 / 4;

  if (tid == 0) s_next = atomicAdd(ctrl, 1);
  for (;;) {
    __syncthreads();
    const int t = s_next;
    if (t >= nTiles) break;
    const int i2 = t % d.p2;
    const int i1b = (t / d.p2) * kT1B;
    if (tid < 32) {  // compact the present groups
      int g = -1, gs = 0, ge = 0;
      if (tid < kT1B && i1b + tid < d.p1) {
        g = map[(i1b + tid) * d.p2 + i2];
        if (g >= G || g >= slots) g = -1;
      }
      if (g >= 0) {
        gs = clampi(goffs[g], 0, U);
        ge = clampi(goffs[g + 1], gs, U);
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
    if (tid == 0) nxt = atomicAdd(ctrl, 1);  // next tile, used at the end
    __syncthreads();
    const int nG = s_n;
    if (nG == 0) {
      if (tid == 0) {
        tile_flag[t] = 0;
        s_next = nxt;
      }
      continue;
    }
    {
      const float4* src = reinterpret_cast<const float4*>(g2 + (size_t)i2 * d.R1Q2R2);
      for (int i = tid; i < d.r1 * NC4; i += kGT) {
        const int a = i / NC4, c = i - a * NC4;
        *reinterpret_cast<float4*>(G2s + a * geo.ldG2 + 4 * c) = __ldg(src + i);
        reinterpret_cast<float4*>(dG2s)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    for (int k0 = 0; k0 < nG; k0 += geo.GB) {
      const int nB = min(geo.GB, nG - k0);
      const int nR = nB * d.q1;
      for (int i = tid; i < nB * d.Q1R1; i += kGT) {  // rows fastest: no bank conflicts
        const int a = i / nR, row = i - a * nR;
        const int k = row / d.q1, q1 = row - k * d.q1;
        As[a * geo.ldA + row] =
            __ldg(g1 + (size_t)(i1b + s_k[k0 + k]) * d.Q1R1 + q1 * d.r1 + a);
      }
      __syncthreads();
      tile_gemm_P(d, As, geo.ldA, G2s, geo.ldG2, nR, PD, geo.PT);
      __syncthreads();
      {  // P -> Pbuf (layout [m][b])
        const int P4 = d.PSZ / 4;
        for (int i = tid; i < nB * P4; i += kGT) {
          const int k = i / P4, w = i - k * P4;
          reinterpret_cast<float4*>(Pbuf + (size_t)s_g[k0 + k] * d.PSZ)[w] =
              *reinterpret_cast<const float4*>(PD + k * geo.PT + 4 * w);
        }
      }
      __syncthreads();
      {  // dP_k[m][b] = sum_u sum_q dRow_u[m][q] G3[i3_u][b][q]
        const int R24 = d.r2 / 4;
        const int IPG = NMB2 * R24;
        for (int it = tid; it < nB * IPG; it += kGT) {
          const int k = it / IPG, rest = it - k * IPG;
          const int mb = rest / R24, b0 = 4 * (rest - mb * R24);
          const int m0 = mb * MB2;
          float acc[MB2][4];
#pragma unroll
          for (int i = 0; i < MB2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
          const int gs = s_gs[k0 + k], ge = s_ge[k0 + k];
          int id_next = gs < ge ? __ldg(uids + gs) : 0;  // one id ahead
          for (int u = gs; u < ge; ++u) {
            const int id = id_next;
            if (u + 1 < ge) id_next = __ldg(uids + u + 1);
            const float4* dr4 = reinterpret_cast<const float4*>(
                d_rows + (size_t)u * d.D + m0 * Q3);
            const float4* g34 = reinterpret_cast<const float4*>(
                g3 + ((size_t)id3(d, id) * d.r2 + b0) * Q3);
            float dr[MB2 * Q3], gv[4 * Q3];
#pragma unroll
            for (int i = 0; i < MB2 * Q3 / 4; ++i) {
              const float4 v = __ldg(dr4 + i);
              dr[4 * i] = v.x; dr[4 * i + 1] = v.y; dr[4 * i + 2] = v.z; dr[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < Q3; ++i) {
              const float4 v = __ldg(g34 + i);
              gv[4 * i] = v.x; gv[4 * i + 1] = v.y; gv[4 * i + 2] = v.z; gv[4 * i + 3] = v.w;
            }
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
      for (int it = tid; it < nB * R14; it += kGT) {
        const int k = it / R14, a0 = it - k * R14;
        float acc[4][4];
#pragma unroll
        for (int q1 = 0; q1 < 4; ++q1)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[q1][i] = 0.f;
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
      for (int it = tid; it < R14 * NC4; it += kGT) {
        const int ab = it / NC4, j4 = it - ab * NC4;
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
        for (int k = 0; k < nB; ++k) {
          for (int q1 = 0; q1 < d.q1; ++q1) {
            const int row = k * d.q1 + q1;
            const float4 p =
                *reinterpret_cast<const float4*>(PD + k * geo.PT + q1 * NC + 4 * j4);
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
          v.x += acc[i][0]; v.y += acc[i][1]; v.z += acc[i][2]; v.w += acc[i][3];
          *o = v;
        }
      }
      __syncthreads();
    }
    {
      float4* dst = reinterpret_cast<float4*>(dG2p + (size_t)t * d.R1Q2R2);
      for (int i = tid; i < d.r1 * NC4; i += kGT) dst[i] = reinterpret_cast<const float4*>(dG2s)[i];
    }
    if (tid == 0) {
      tile_flag[t] = 1;
      s_next = nxt;
    }
  }
}

__global__ void dg2_reduce_kernel(Dev d, int nT1, const int* __restrict__ flag,
                                  const float* __restrict__ dG2p,
                                  float* __restrict__ dg2) {
  const int i2 = blockIdx.y;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= d.R1Q2R2) return;
  float acc = 0.f;
  for (int k = 0; k < nT1; ++k) {
    const int t = k * d.p2 + i2;
    if (flag[t]) acc += dG2p[(size_t)t * d.R1Q2R2 + e];
  }
  dg2[(size_t)i2 * d.R1Q2R2 + e] = acc;
}

// dG1[i1] = sum over groups of i1 (i2 ascending) of the per-group partials.
// Threads split the group list into S contiguous parts (fixed S), combined
// in order: deterministic.
__global__ void dg1_reduce_kernel(Dev d, const int* __restrict__ map,
                                  const int* __restrict__ counts, int n,
                                  int slots, const float* __restrict__ dG1p,
                                  float* __restrict__ dg1) {
  extern __shared__ int s_list[];  // p2 ints, then S*Q1R1 floats
  __shared__ int s_cnt;
  const int i1 = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31;
  const int G = clampi(counts[1], 0, clampi(counts[0], 0, n));
  if (tid < 32) {
    int base = 0;
    for (int c = 0; c < d.p2; c += 32) {
      const int i2 = c + lane;
      const int g = (i2 < d.p2) ? map[i1 * d.p2 + i2] : -1;
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
      for (int j = jb; j < je; ++j)
        acc += __ldg(dG1p + (size_t)s_list[j] * d.Q1R1 + e);
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

// Sort keys (i3, or p3 past num_unique) and values (u) for the dG3 pass, and
// ug[u] = the prefix group of unique id u (from the prefix map).
__global__ void dg3_keys_kernel(Dev d, const int* __restrict__ uids,
                                const int* __restrict__ counts, int n,
                                const int* __restrict__ map,
                                int* __restrict__ keys,
                                int* __restrict__ vals, int* __restrict__ ug) {
  const int U = clampi(counts[0], 0, n);
  for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < n;
       u += gridDim.x * blockDim.x) {
    int k = d.p3;
    if (u < U) {
      int i1, i2, i3;
      split_id(d, uids[u], i1, i2, i3);
      k = i3;
      ug[u] = map[i1 * d.p2 + i2];
    }
    keys[u] = k;
    vals[u] = u;
  }
}

// bounds[k] = first j with keys[j] >= k (k = 0..p3) of the sorted keys (all
// <= p3): position j writes the keys in (keys[j-1], keys[j]], position n the
// keys in (keys[n-1], p3]; every k is written once.
__global__ void dg3_bounds_kernel(Dev d, const int* __restrict__ keys, int n,
                                  int* __restrict__ bounds) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j > n) return;
  const int k0 = j == 0 ? -1 : clampi(keys[j - 1], 0, d.p3);
  const int k1 = j == n ? d.p3 : clampi(keys[j], 0, d.p3);
  for (int k = k0 + 1; k <= k1; ++k) bounds[k] = j;
}

// dG3 partials: block (i3, part) sums P_g(u)^T dRow_u over a fixed
// contiguous part of the i3 bucket (unique ids in ascending order); sub-groups
// of threads take a fixed strided subset and are combined in order.
__global__ void dg3_kernel(Dev d, const int* __restrict__ bounds,
                           const int* __restrict__ vals, int n,
                           const int* __restrict__ ug,
                           const float* __restrict__ Pbuf,
                           const float* __restrict__ d_rows, int slots,
                           float* __restrict__ dg3p) {
  __shared__ int s_u[kBatch];
  __shared__ int s_gg[kBatch];
  __shared__ float s_red[kThreads];
  const int i3 = blockIdx.x, part = blockIdx.y;
  const int tid = threadIdx.x;
  const int blo = bounds[i3];
  const int bhi = bounds[i3 + 1];
  const int per = (bhi - blo + kS3 - 1) / kS3;
  const int lo = min(bhi, blo + part * per), hi = min(bhi, lo + per);
  const int E3 = d.r2 * d.q3;
  const int EW = min(E3, (int)blockDim.x);
  const int W = blockDim.x / EW;
  float* out = dg3p + ((size_t)i3 * kS3 + part) * E3;
  for (int e0 = 0; e0 < E3; e0 += EW) {
    const int e = e0 + tid % EW;
    const int w = tid / EW;
    const bool active = (w < W) && (e < E3);
    const int b = e / d.q3, q = e - (e / d.q3) * d.q3;
    float acc = 0.f;
    for (int j0 = lo; j0 < hi; j0 += kBatch) {
      const int cnt = min(kBatch, hi - j0);
      __syncthreads();
      for (int i = tid; i < cnt; i += blockDim.x) {
        const int u = clampi(vals[j0 + i], 0, n - 1);
        s_u[i] = u;
        s_gg[i] = clampi(ug[u], 0, slots - 1);
      }
      __syncthreads();
      if (active) {
        for (int i = w; i < cnt; i += W) {
          const float* P = Pbuf + (size_t)s_gg[i] * d.PSZ + b;
          const float* dr = d_rows + (size_t)s_u[i] * d.D + q;
          float pv[8], dv[8];
          int m0 = 0;
          for (; m0 + 8 <= d.M; m0 += 8) {
#pragma unroll
            for (int mm = 0; mm < 8; ++mm) {
              pv[mm] = __ldg(P + (m0 + mm) * d.r2);
              dv[mm] = __ldg(dr + (m0 + mm) * d.q3);
            }
#pragma unroll
            for (int mm = 0; mm < 8; ++mm) acc = fmaf(pv[mm], dv[mm], acc);
          }
          for (int m = m0; m < d.M; ++m)
            acc = fmaf(__ldg(P + m * d.r2), __ldg(dr + m * d.q3), acc);
        }
      }
    }
    __syncthreads();
    s_red[tid] = acc;
    __syncthreads();
    if (w == 0 && e < E3) {
      float tot = 0.f;
      for (int ww = 0; ww < W; ++ww) tot += s_red[ww * EW + tid];
      out[e] = tot;
    }
  }
}

// dG3 partials, blocked (the fast path, same dims as the GEMM kernels):
// block (i3, part) as in dg3_kernel; a thread owns 4 columns b x all q3 of
// the output and a fixed strided subset of the part's unique ids (stream
// `sub`); per id it reads P_g[m][b0..b0+3] and dRow_u[m][:] as float4s
// (4*M*Q3 FMAs per 2 float4s per m). Streams are combined in order.
template <int M, int Q3>
__global__ void __launch_bounds__(kThreads)
    dg3_blocked_kernel(Dev d, const int* __restrict__ bounds,
                       const int* __restrict__ vals, int n,
                       const int* __restrict__ ug,
                       const float* __restrict__ Pbuf,
                       const float* __restrict__ d_rows, int slots,
                       float* __restrict__ dg3p) {
  extern __shared__ float4 smem4[];
  float* s_red = reinterpret_cast<float*>(smem4);  // [subs][r2*Q3]
  const int i3 = blockIdx.x, part = blockIdx.y;
  const int tid = threadIdx.x;
  const int NB4 = d.r2 / 4;
  const int subs = kThreads / NB4;
  const int sub = tid / NB4, b0 = 4 * (tid - sub * NB4);
  const int E3 = d.r2 * Q3;
  const int blo = bounds[i3], bhi = bounds[i3 + 1];
  const int per = (bhi - blo + kS3 - 1) / kS3;
  const int lo = min(bhi, blo + part * per), hi = min(bhi, lo + per);
  float acc[4][Q3];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int q = 0; q < Q3; ++q) acc[i][q] = 0.f;
  if (sub < subs) {
    // (u, group) of the next id loaded one step ahead
    int j = lo + sub;
    int u_next = 0, g_next = 0;
    if (j < hi) {
      u_next = clampi(__ldg(vals + j), 0, n - 1);
      g_next = clampi(__ldg(ug + u_next), 0, slots - 1);
    }
    for (; j < hi; j += subs) {
      const int u = u_next, g = g_next;
      if (j + subs < hi) {
        u_next = clampi(__ldg(vals + j + subs), 0, n - 1);
        g_next = clampi(__ldg(ug + u_next), 0, slots - 1);
      }
      const float* P = Pbuf + (size_t)g * d.PSZ + b0;
      const float4* dr = reinterpret_cast<const float4*>(d_rows + (size_t)u * d.D);
#pragma unroll 4
      for (int m = 0; m < M; ++m) {
        const float4 p = __ldg(reinterpret_cast<const float4*>(P + m * d.r2));
        float dv[Q3];
#pragma unroll
        for (int i = 0; i < Q3 / 4; ++i) {
          const float4 v = __ldg(dr + m * (Q3 / 4) + i);
          dv[4 * i] = v.x; dv[4 * i + 1] = v.y; dv[4 * i + 2] = v.z; dv[4 * i + 3] = v.w;
        }
#pragma unroll
        for (int q = 0; q < Q3; ++q) {
          acc[0][q] = fmaf(p.x, dv[q], acc[0][q]);
          acc[1][q] = fmaf(p.y, dv[q], acc[1][q]);
          acc[2][q] = fmaf(p.z, dv[q], acc[2][q]);
          acc[3][q] = fmaf(p.w, dv[q], acc[3][q]);
        }
      }
    }
    float* r = s_red + sub * E3 + b0 * Q3;  // [b][q] order
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int q = 0; q < Q3; ++q) r[i * Q3 + q] = acc[i][q];
  }
  __syncthreads();
  float* out = dg3p + ((size_t)i3 * kS3 + part) * E3;
  for (int e = tid; e < E3; e += kThreads) {
    float tot = 0.f;
    for (int k = 0; k < subs; ++k) tot += s_red[k * E3 + e];
    out[e] = tot;
  }
}

__global__ void dg3_final_kernel(Dev d, const float* __restrict__ dg3p,
                                 float* __restrict__ dg3) {
  const int E3 = d.r2 * d.q3;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)d.p3 * E3) return;
  const int i3 = (int)(i / E3), e = (int)(i % E3);
  float tot = 0.f;
#pragma unroll
  for (int s = 0; s < kS3; ++s) tot += dg3p[((size_t)i3 * kS3 + s) * E3 + e];
  dg3[i] = tot;
}

// ----------------------------- pooling --------------------------------------

template <int VEC>
struct VecT;
template <>
struct VecT<1> { using T = float; };
template <>
struct VecT<4> { using T = float4; };

__device__ __forceinline__ void vfma(float& acc, float w, float v) {
  acc = fmaf(w, v, acc);
}
__device__ __forceinline__ void vfma(float4& acc, float w, float4 v) {
  acc.x = fmaf(w, v.x, acc.x); acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z); acc.w = fmaf(w, v.w, acc.w);
}
__device__ __forceinline__ float vdot(float a, float b) { return a * b; }
__device__ __forceinline__ float vdot(float4 a, float4 b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}
template <typename T> __device__ __forceinline__ T vzero();
template <> __device__ __forceinline__ float vzero<float>() { return 0.f; }
template <> __device__ __forceinline__ float4 vzero<float4>() {
  return make_float4(0.f, 0.f, 0.f, 0.f);
}

// One thread team (TS lanes over D/VEC vectors) per bag, positions in
// increasing k. Only positions whose unique index is in [lo, hi) (hi capped
// at num_unique when counts is given) add w * rows[idx - lo]; accumulate:
// start from out (the fused forward's later chunks), else from 0.
template <int VEC>
__global__ void pool_fwd_kernel(const float* __restrict__ rows,
                                const int* __restrict__ inverse,
                                const float* __restrict__ weights,
                                const int* __restrict__ bag_offsets, int n,
                                int B, int D, int TS, int lo, int hi,
                                const int* __restrict__ counts,
                                bool accumulate, float* __restrict__ out) {
  using T = typename VecT<VEC>::T;
  if (counts != nullptr) hi = min(hi, clampi(counts[0], 0, n));
  if (accumulate && lo >= hi) return;
  const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int bag = (int)(gt / TS), lane = (int)(gt % TS);
  if (bag >= B) return;
  const int kb = clampi(bag_offsets[bag], 0, n);
  const int ke = clampi(bag_offsets[bag + 1], kb, n);
  const int DV = D / VEC;
  const unsigned span = (unsigned)max(hi - lo, 0);
  const T* rv = reinterpret_cast<const T*>(rows);
  T* ov = reinterpret_cast<T*>(out);
  for (int dv = lane; dv < DV; dv += TS) {
    T acc = accumulate ? ov[(size_t)bag * DV + dv] : vzero<T>();
#pragma unroll 4
    for (int k = kb; k < ke; ++k) {
      const unsigned idx = (unsigned)(__ldg(inverse + k) - lo);
      if (idx < span) vfma(acc, __ldg(weights + k), rv[(size_t)idx * DV + dv]);
    }
    ov[(size_t)bag * DV + dv] = acc;
  }
}

// d_rows by a deterministic segmented reduction over the sorted order
// (positions j -> perm[j]), so that a Zipf-hot id with 10^4..10^5
// occurrences does not serialise one thread team.
// Pass 1: team per chunk of kPL sorted positions; runs complete inside the
//   chunk are written to d_rows; a run that started before the chunk leaves
//   its chunk partial in slot (chunk, 0), a run that starts inside and
//   continues past the chunk leaves it in slot (chunk, 1).
// Pass 2: warp per unique id; runs spanning chunks sum their partials in
//   chunk order (sub-teams over contiguous parts, fixed shuffle tree).
// d_rows past num_unique is not written (the contract leaves it unspecified).
constexpr int kPL = 32;

template <int VEC>
__global__ void pool_bwd_rows_p1(const float* __restrict__ dout,
                                 const float* __restrict__ weights,
                                 const int* __restrict__ bag_ids,
                                 const int* __restrict__ perm,
                                 const int* __restrict__ inverse,
                                 const int* __restrict__ run_offsets,
                                 const int* __restrict__ counts, int n, int B,
                                 int D, int TS, float* __restrict__ d_rows,
                                 float* __restrict__ part) {
  using T = typename VecT<VEC>::T;
  const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int k = (int)(gt / TS), lane = (int)(gt % TS);
  const int nch = (n + kPL - 1) / kPL;
  if (k >= nch) return;
  const int U = clampi(counts[0], 0, n);
  const int cs = k * kPL, ce = min(n, cs + kPL);
  const int DV = D / VEC;
  const T* dv_ = reinterpret_cast<const T*>(dout);
  T* o = reinterpret_cast<T*>(d_rows);
  T* pv = reinterpret_cast<T*>(part);
  for (int dv = lane; dv < DV; dv += TS) {
    int cur = -1;
    T acc = vzero<T>();
    auto flush = [&](int u) {
      if (u < 0 || u >= U) return;
      const int s = run_offsets[u], e = run_offsets[u + 1];
      if (s >= cs && e <= ce) {
        o[(size_t)u * DV + dv] = acc;
      } else {
        const int side = (s < cs) ? 0 : 1;
        pv[((size_t)k * 2 + side) * DV + dv] = acc;
      }
    };
    for (int j0 = cs; j0 < ce; j0 += 8) {
      int uj[8];
      float wj[8];
      T xj[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int j = j0 + i;
        uj[i] = -1;
        wj[i] = 0.f;
        xj[i] = vzero<T>();
        if (j < ce) {
          const int p = clampi(__ldg(perm + j), 0, n - 1);
          uj[i] = __ldg(inverse + p);
          wj[i] = __ldg(weights + p);
          const int b = clampi(__ldg(bag_ids + p), 0, B - 1);
          xj[i] = dv_[(size_t)b * DV + dv];
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (j0 + i < ce) {
          if (uj[i] != cur) {
            flush(cur);
            cur = uj[i];
            acc = vzero<T>();
          }
          vfma(acc, wj[i], xj[i]);
        }
      }
    }
    flush(cur);
  }
}

template <int VEC>
__device__ __forceinline__ void shfl_add(float& v, int off) {
  v += __shfl_xor_sync(0xffffffffu, v, off);
}
template <int VEC>
__device__ __forceinline__ void shfl_add(float4& v, int off) {
  v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
  v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
  v.z += __shfl_xor_sync(0xffffffffu, v.z, off);
  v.w += __shfl_xor_sync(0xffffffffu, v.w, off);
}

// Persistent warps over blocks of 32 unique ids (a lane reads one id's run
// bounds). A run spanning chunks k0..k1 sums its partials: lane l takes
// partials l, l+32, ... (fixed), then a fixed xor tree across lanes. A unique
// id without occurrences (never, for a valid plan) gets zeros.
template <int VEC>
__global__ void pool_bwd_rows_p2(const int* __restrict__ run_offsets,
                                 const int* __restrict__ counts, int n, int D,
                                 const float* __restrict__ part,
                                 float* __restrict__ d_rows) {
  using T = typename VecT<VEC>::T;
  constexpr int kV = 8;  // vectors per lane per pass
  const int lane = threadIdx.x & 31;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5;
  const int U = clampi(counts[0], 0, n);
  const int DV = D / VEC;
  T* o = reinterpret_cast<T*>(d_rows);
  const T* pv = reinterpret_cast<const T*>(part);
  for (int base = gw * 32; base < U; base += nw * 32) {
    const int u = base + lane;
    int s = 0, e = 0;
    if (u < U) {
      s = clampi(run_offsets[u], 0, n);
      e = clampi(run_offsets[u + 1], s, n);
    }
    const bool empty = u < U && e <= s;
    const bool cross = e > s && s / kPL != (e - 1) / kPL;
    for (unsigned zmask = __ballot_sync(0xffffffffu, empty); zmask; zmask &= zmask - 1) {
      const int uz = base + __ffs(zmask) - 1;
      for (int dv = lane; dv < DV; dv += 32) o[(size_t)uz * DV + dv] = vzero<T>();
    }
    for (unsigned cmask = __ballot_sync(0xffffffffu, cross); cmask; cmask &= cmask - 1) {
      const int src_lane = __ffs(cmask) - 1;
      const int uc = base + src_lane;
      const int k0 = __shfl_sync(0xffffffffu, s, src_lane) / kPL;
      const int k1 = (__shfl_sync(0xffffffffu, e, src_lane) - 1) / kPL;
      const int L = k1 - k0 + 1;  // partials: (k0,1), (k0+1,0), ..., (k1,0)
      for (int dv0 = 0; dv0 < DV; dv0 += kV) {
        T acc[kV];
#pragma unroll
        for (int v = 0; v < kV; ++v) acc[v] = vzero<T>();
#pragma unroll 4
        for (int i = lane; i < L; i += 32) {  // unrolled: hot ids have ~10^3 partials
          const int kk = k0 + i;
          const int side = (i == 0) ? 1 : 0;
          const T* src = pv + ((size_t)kk * 2 + side) * DV + dv0;
#pragma unroll
          for (int v = 0; v < kV; ++v)
            if (dv0 + v < DV) vfma(acc[v], 1.f, src[v]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
#pragma unroll
          for (int v = 0; v < kV; ++v) shfl_add<VEC>(acc[v], off);
#pragma unroll
        for (int v = 0; v < kV; ++v)
          if (lane == v && dv0 + v < DV) o[(size_t)uc * DV + dv0 + v] = acc[v];
      }
    }
  }
}

// d_weights[p] = dout[bag_p] . rows[u_p], one team per position, taken in
// sorted order (p = perm[j]) so the rows are read in runs, not gathered.
template <int VEC>
__global__ void pool_bwd_weights_kernel(const float* __restrict__ dout,
                                        const float* __restrict__ rows,
                                        const int* __restrict__ inverse,
                                        const int* __restrict__ bag_ids,
                                        const int* __restrict__ perm,
                                        int n, int B, int D, int TS,
                                        float* __restrict__ d_weights) {
  using T = typename VecT<VEC>::T;
  const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int j = (int)(gt / TS), lane = (int)(gt % TS);
  const bool valid = j < n;
  const int DV = D / VEC;
  float s = 0.f;
  int k = 0;
  if (valid) {
    k = clampi(__ldg(perm + j), 0, n - 1);
    const int b = clampi(__ldg(bag_ids + k), 0, B - 1);
    const int idx = clampi(__ldg(inverse + k), 0, n - 1);
    const T* a = reinterpret_cast<const T*>(dout) + (size_t)b * DV;
    const T* r = reinterpret_cast<const T*>(rows) + (size_t)idx * DV;
    for (int dv = lane; dv < DV; dv += TS) s += vdot(a[dv], r[dv]);
  }
  for (int off = TS >> 1; off > 0; off >>= 1)
    s += __shfl_xor_sync(0xffffffffu, s, off);
  if (valid && lane == 0) d_weights[k] = s;
}

int team_size(int DV) {
  int ts = 1;
  while (ts < DV && ts < 32) ts <<= 1;
  return ts;
}

int num_sms() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

size_t fwd_smem(const Dev& d) {
  return sizeof(float) *
         (size_t)(align4(d.R1Q2R2) +
                  (kThreads / 32) * (align4(d.Q1R1) + align4(d.M * d.R2p)));
}
size_t bwd_smem(const Dev& d) {
  const int NJ = d.q2 * d.r2;
  const size_t warps = (size_t)(kThreads / 32) *
                       (align4(d.Q1R1) + align4(d.M * d.R2p));
  const size_t ab = (size_t)align4(kKC * d.r1) + (size_t)kKC * NJ;
  return sizeof(float) *
         ((size_t)align4(d.r1 * (NJ + 1)) + std::max(warps, ab));
}

// The dims the GEMM tile kernels (forward and backward) take.
bool gemm_dims(const Dev& d) {
  return (d.q3 == 4 || d.q3 == 8) && (d.M == 4 || d.M == 8 || d.M == 16) && d.r2 % 4 == 0;
}

// Groups per batch of the GEMM forward tile (largest power of two <= kT1F
// whose shared memory fits FLOWTT_FWD_SMEM_KB), or 0 when the GEMM kernel
// does not take these dims (then the warp kernel runs).
int gemm_batch_groups(const Dev& d) {
  if (!gemm_dims(d)) return 0;
  for (int GB = kT1F; GB >= 1; GB /= 2)
    if (tile_geo(d, GB).smem_bytes <= FLOWTT_FWD_SMEM_KB * 1024) return GB;
  return 0;
}

// Groups per batch of the GEMM backward tile (~110 KB of shared memory if
// possible, else up to 200 KB), or 0 when it does not take these dims.
int gemm_bwd_batch_groups(const Dev& d) {
  if (!gemm_dims(d) || d.r1 % 4 != 0 || d.q1 > 4) return 0;
  for (int lim : {110 * 1024, 200 * 1024})
    for (int GB = kT1B; GB >= 1; GB /= 2)
      if (bwd_geo(d, GB).smem_bytes <= lim) return GB;
  return 0;
}

struct Bump {
  char* base;
  size_t off = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(base ? base + off : nullptr);
    off += align_up(count * sizeof(T));
    return p;
  }
};

// Forward scratch for `passes` passes over unique ranges of `range` rows (one
// pass of n rows for flowtt_tt_rows_fwd, one per chunk for flowtt_bag_fwd):
// per pass two work counters and the checkpoint flags (zeroed by one
// memset), one checkpoint buffer, plus `buf_rows` rows of D floats (the fused
// forward's rows buffer; 0 otherwise).
struct FwdScratch {
  int* map; int* ctrl; float* ckpt; float* rows; size_t bytes; int nslots; int passes;
  int* pass_ctrl(int p) const { return ctrl + (size_t)p * (2 + nslots); }  // flags at +2
  size_t ctrl_bytes() const { return sizeof(int) * (size_t)passes * (2 + nslots); }
};
FwdScratch fwd_layout(const Dev& d, int range, int passes, int buf_rows, void* base) {
  Bump bp{static_cast<char*>(base)};
  FwdScratch s;
  s.nslots = range / kCH + 2;
  s.passes = passes;
  s.map = bp.take<int>((size_t)d.p1 * d.p2);
  s.ctrl = bp.take<int>((size_t)passes * (2 + s.nslots));
  s.ckpt = bp.take<float>((size_t)s.nslots * d.PSZ);
  s.rows = bp.take<float>((size_t)buf_rows * d.D);
  s.bytes = bp.off;
  return s;
}

struct BwdScratch {
  int* map; int* ctrl; int* tile_flag; float* Pbuf; float* dPbuf; float* dG1p;
  float* dG2p;
  int* ug; int* keys_in; int* keys_out; int* vals_in; int* vals_out;
  float* dg3p;
  void* cub_tmp; size_t cub_bytes; size_t bytes; int slots; int nT1; int nTiles;
};
BwdScratch bwd_layout(const Dev& d, int n, void* base) {
  Bump bp{static_cast<char*>(base)};
  BwdScratch s;
  s.slots = (int)std::min<long long>(n, (long long)d.p1 * d.p2);
  s.nT1 = (d.p1 + kT1B - 1) / kT1B;
  s.nTiles = s.nT1 * d.p2;
  s.map = bp.take<int>((size_t)d.p1 * d.p2);
  s.ctrl = bp.take<int>(1);
  s.tile_flag = bp.take<int>(s.nTiles);
  s.Pbuf = bp.take<float>((size_t)s.slots * d.PSZ);
  // dP goes through global memory only in the warp tile kernel (not the GEMM one)
  s.dPbuf = bp.take<float>(gemm_bwd_batch_groups(d) > 0 ? 0 : (size_t)s.slots * d.PSZ);
  s.dG1p = bp.take<float>((size_t)s.slots * d.Q1R1);
  s.dG2p = bp.take<float>((size_t)s.nTiles * d.R1Q2R2);
  s.ug = bp.take<int>(n);
  s.keys_in = bp.take<int>(std::max(n, d.p3 + 1));
  s.keys_out = bp.take<int>(n);
  s.vals_in = bp.take<int>(n);
  s.vals_out = bp.take<int>(n);
  s.dg3p = bp.take<float>((size_t)d.p3 * kS3 * d.r2 * d.q3);
  s.cub_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, s.cub_bytes, (int*)nullptr,
                                  (int*)nullptr, (int*)nullptr, (int*)nullptr,
                                  n, 0, 32);
  s.cub_tmp = bp.take<char>(s.cub_bytes + 16);
  s.bytes = bp.off;
  return s;
}

// Persistent grid: as many CTAs as fit on the device at once.
template <typename Kernel, typename... Args>
cudaError_t launch_persistent(Kernel kernel, size_t smem, cudaStream_t stream,
                              int sms, Args... args) {
  cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  int occ = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kThreads, smem);
  occ = std::max(1, std::min(occ, 8));
  kernel<<<sms * occ, kThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

int end_bit_for(int maxkey) {
  int b = 1;
  while (b < 31 && (1LL << b) <= maxkey) ++b;
  return b;
}

}  // namespace

// Profiling aid for the harness: bit i enables backward stage i
// (1 tile, 2 dG2 reduce, 4 dG1 reduce, 8 keys, 16 sort, 32 dG3). Default: all.
int g_stage_mask = ~0;
void set_stage_mask(int m) { g_stage_mask = m; }

const char* check_dims(const TTDims& t) {
  if (t.p1 <= 0 || t.p2 <= 0 || t.p3 <= 0 || t.q1 <= 0 || t.q2 <= 0 ||
      t.q3 <= 0 || t.r1 <= 0 || t.r2 <= 0)
    return "flowtt CUDA: core dimensions must be positive";
  if ((long long)t.p1 * t.p2 > (1LL << 26))
    return "flowtt CUDA: p1*p2 too large for the dense prefix map (max 2^26)";
  if (t.p2 > 65535) return "flowtt CUDA: p2 > 65535 unsupported";
  if (t.q1 > kQ1Max || t.q1 * t.q2 > kMMax || t.q3 > kQ3Max ||
      t.r2 > 32 * kBB || t.r1 > kAMax)
    return "flowtt CUDA: unsupported core shape (need q1<=8, q1*q2<=16, "
           "q3<=8, r1<=64, r2<=64); use impl='reference'";
  const Dev d = make_dev(t);
  if (bwd_smem(d) > 200 * 1024 || fwd_smem(d) > 200 * 1024)
    return "flowtt CUDA: cores too large for the shared-memory kernels "
           "(r1*q2*r2 must be <= ~24k); use impl='reference'";
  return nullptr;
}

size_t rows_fwd_scratch_bytes(const TTDims& t, int n) {
  return fwd_layout(make_dev(t), n, 1, 0, nullptr).bytes;
}

namespace {

// Prefix map (and zeroed work counters of every pass) for the forward passes.
cudaError_t build_prefix_map(const Dev& d, const int* unique_ids,
                             const int* group_offsets, const int* counts, int n,
                             const FwdScratch& s, cudaStream_t stream) {
  int* map = s.map;
  cudaError_t err = cudaMemsetAsync(map, 0xFF, sizeof(int) * (size_t)d.p1 * d.p2, stream);
  if (err != cudaSuccess) return err;
  if ((err = cudaMemsetAsync(s.ctrl, 0, s.ctrl_bytes(), stream)) != cudaSuccess) return err;
  const int blocks = std::max(1, std::min((n + 255) / 256, num_sms() * 8));
  build_map_kernel<<<blocks, 256, 0, stream>>>(d, unique_ids, group_offsets, counts, n, map);
  return cudaGetLastError();
}

// Rows of the unique range [lo, lo + range) into rows[u - lo] (after
// build_prefix_map), pass p's counters and flags: one launch.
cudaError_t rows_fwd_range(const Dev& d, const float* g1, const float* g2,
                           const float* g3, const int* unique_ids,
                           const int* group_offsets, const int* counts, int n,
                           int lo, int range, const FwdScratch& s, int p, float* rows,
                           cudaStream_t stream) {
  int* ctrl = s.pass_ctrl(p);
  int* flags = ctrl + 2;
  const int sms = num_sms();
  const int hi = lo + range;
  const int GB = gemm_batch_groups(d);
  if (GB > 0) {
    const TileGeo geo = tile_geo(d, GB);
#define FLOWTT_FWD_GEMM(MM, QQ3)                                               \
  if (d.M == MM && d.q3 == QQ3)                                                \
    return launch_persistent(rows_fwd_gemm_kernel<MM, QQ3>, geo.smem_bytes,    \
                             stream, sms, d, geo, g1, g2, g3, unique_ids,      \
                             group_offsets, counts, n, lo, hi, s.map, ctrl,    \
                             flags, s.ckpt, rows);
    FLOWTT_FWD_GEMM(4, 4) FLOWTT_FWD_GEMM(8, 4) FLOWTT_FWD_GEMM(16, 4)
    FLOWTT_FWD_GEMM(4, 8) FLOWTT_FWD_GEMM(8, 8) FLOWTT_FWD_GEMM(16, 8)
#undef FLOWTT_FWD_GEMM
  }
  const size_t smem = fwd_smem(d);
#define FLOWTT_FWD_WARP(Q1)                                                     \
  return launch_persistent(rows_fwd_kernel<Q1>, smem, stream, sms, d, g1, g2,  \
                           g3, unique_ids, group_offsets, counts, n, lo, hi,   \
                           s.map, ctrl, flags, s.ckpt, rows)
  switch (d.q1) {
    case 1: FLOWTT_FWD_WARP(1);
    case 2: FLOWTT_FWD_WARP(2);
    case 4: FLOWTT_FWD_WARP(4);
    case 8: FLOWTT_FWD_WARP(8);
    default: FLOWTT_FWD_WARP(0);
  }
#undef FLOWTT_FWD_WARP
}

cudaError_t launch_pool_fwd(const float* rows, const int* inverse,
                            const float* weights, const int* bag_offsets, int n,
                            int B, int D, int lo, int hi, const int* counts,
                            bool accumulate, float* out, cudaStream_t stream) {
  if (B <= 0) return cudaSuccess;
  const bool v4 = (D % 4) == 0 &&
                  (reinterpret_cast<uintptr_t>(rows) % 16) == 0 &&
                  (reinterpret_cast<uintptr_t>(out) % 16) == 0;
  const int DV = v4 ? D / 4 : D;
  const int TS = team_size(DV);
  const int blocks = (int)(((long long)B * TS + 255) / 256);
  if (v4)
    pool_fwd_kernel<4><<<blocks, 256, 0, stream>>>(rows, inverse, weights, bag_offsets, n, B, D,
                                                   TS, lo, hi, counts, accumulate, out);
  else
    pool_fwd_kernel<1><<<blocks, 256, 0, stream>>>(rows, inverse, weights, bag_offsets, n, B, D,
                                                   TS, lo, hi, counts, accumulate, out);
  return cudaGetLastError();
}

// The fused forward's rows buffer: chunk_rows rounded up to kCH, at most n
// rounded up to kCH.
int bag_chunk(int n, long long chunk_rows) {
  const long long c = (std::max(chunk_rows, 1LL) + kCH - 1) / kCH * kCH;
  const long long cap = ((long long)n + kCH - 1) / kCH * kCH;
  return (int)std::min(c, cap);
}

}  // namespace

cudaError_t rows_fwd(const TTDims& t, const float* g1, const float* g2,
                     const float* g3, const int* unique_ids,
                     const int* group_offsets, const int* counts, int n,
                     float* rows, void* scratch, cudaStream_t stream) {
  const Dev d = make_dev(t);
  const FwdScratch s = fwd_layout(d, n, 1, 0, scratch);
  cudaError_t err = build_prefix_map(d, unique_ids, group_offsets, counts, n, s, stream);
  if (err != cudaSuccess) return err;
  return rows_fwd_range(d, g1, g2, g3, unique_ids, group_offsets, counts, n, 0, n, s, 0, rows,
                        stream);
}

size_t bag_fwd_scratch_bytes(const TTDims& t, int n, long long chunk_rows) {
  const int C = bag_chunk(n, chunk_rows);
  return fwd_layout(make_dev(t), C, (n + C - 1) / C, C, nullptr).bytes;
}

cudaError_t bag_fwd(const TTDims& t, const float* g1, const float* g2,
                    const float* g3, const int* unique_ids,
                    const int* group_offsets, const int* counts,
                    const int* inverse, const float* weights,
                    const int* bag_offsets, int n, int B, long long chunk_rows,
                    float* out, void* scratch, cudaStream_t stream) {
  if (B <= 0) return cudaSuccess;
  const Dev d = make_dev(t);
  const int C = bag_chunk(n, chunk_rows);
  const FwdScratch s = fwd_layout(d, C, (n + C - 1) / C, C, scratch);
  cudaError_t err = build_prefix_map(d, unique_ids, group_offsets, counts, n, s, stream);
  if (err != cudaSuccess) return err;
  // static chunk count (U <= n is on the device): chunks past U exit at once
  for (int lo = 0; lo < n; lo += C) {
    if ((err = rows_fwd_range(d, g1, g2, g3, unique_ids, group_offsets, counts, n, lo, C, s,
                              lo / C, s.rows, stream)) != cudaSuccess)
      return err;
    if ((err = launch_pool_fwd(s.rows, inverse, weights, bag_offsets, n, B, d.D, lo, lo + C,
                               counts, lo > 0, out, stream)) != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

size_t rows_bwd_scratch_bytes(const TTDims& t, int n) {
  return bwd_layout(make_dev(t), n, nullptr).bytes;
}

cudaError_t rows_bwd(const TTDims& t, const float* g1, const float* g2,
                     const float* g3, const float* d_rows,
                     const int* unique_ids, const int* group_offsets,
                     const int* counts, int n, float* dg1, float* dg2,
                     float* dg3, void* scratch, cudaStream_t stream) {
  const Dev d = make_dev(t);
  BwdScratch s = bwd_layout(d, n, scratch);
  cudaError_t err;
  if ((err = cudaMemsetAsync(s.map, 0xFF, sizeof(int) * (size_t)d.p1 * d.p2,
                             stream)) != cudaSuccess)
    return err;
  if ((err = cudaMemsetAsync(s.ctrl, 0, sizeof(int), stream)) != cudaSuccess)
    return err;
  const int sms = num_sms();
  const int eblocks = std::max(1, std::min((n + 255) / 256, sms * 8));
  build_map_kernel<<<eblocks, 256, 0, stream>>>(d, unique_ids, group_offsets,
                                                counts, n, s.map);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (!(g_stage_mask & 1)) return cudaGetLastError();
  const int GBB = gemm_bwd_batch_groups(d);
  if (GBB > 0) {
    const BwdGeo geo = bwd_geo(d, GBB);
#define FLOWTT_BWD_GEMM(MM, QQ3)                                               \
  else if (d.M == MM && d.q3 == QQ3) err =                                     \
      launch_persistent(rows_bwd_gemm_kernel<MM, QQ3>, geo.smem_bytes, stream, \
                        sms, d, geo, g1, g2, g3, d_rows, unique_ids,           \
                        group_offsets, counts, n, s.map, s.ctrl, s.tile_flag,  \
                        s.Pbuf, s.dG1p, s.dG2p, s.slots);
    if (false) {
    }
    FLOWTT_BWD_GEMM(4, 4) FLOWTT_BWD_GEMM(8, 4) FLOWTT_BWD_GEMM(16, 4)
    FLOWTT_BWD_GEMM(4, 8) FLOWTT_BWD_GEMM(8, 8) FLOWTT_BWD_GEMM(16, 8)
#undef FLOWTT_BWD_GEMM
  } else {
    const size_t smem = bwd_smem(d);
  #define FLOWTT_BWD(Q1, M, Q3, BB)                                              \
    err = launch_persistent(rows_bwd_tile_kernel<Q1, M, Q3, BB>, smem, stream,   \
                            sms, d, g1, g2, g3, d_rows, unique_ids,              \
                            group_offsets, counts, n, s.map, s.ctrl,             \
                            s.tile_flag, s.Pbuf, s.dPbuf, s.dG1p, s.dG2p,        \
                            s.slots)
    {
      const int bb = d.r2 > 32 ? 2 : 1;
      const int key = d.q1 * 1000 + d.M * 10 + d.q3;
      if (key == 2084 && bb == 1) FLOWTT_BWD(2, 8, 4, 1);
      else if (key == 2084) FLOWTT_BWD(2, 8, 4, 2);
      else if (key == 4168 && bb == 1) FLOWTT_BWD(4, 16, 8, 1);
      else if (key == 4168) FLOWTT_BWD(4, 16, 8, 2);
      else if (key == 2044 && bb == 1) FLOWTT_BWD(2, 4, 4, 1);
      else if (key == 2044) FLOWTT_BWD(2, 4, 4, 2);
      else if (key == 4164 && bb == 1) FLOWTT_BWD(4, 16, 4, 1);
      else if (key == 4164) FLOWTT_BWD(4, 16, 4, 2);
      else FLOWTT_BWD(0, 0, 0, 0);
    }
  #undef FLOWTT_BWD
  }
  if (err != cudaSuccess) return err;
  if (!(g_stage_mask & 2)) return cudaGetLastError();
  {
    dim3 grid((d.R1Q2R2 + 255) / 256, d.p2);
    dg2_reduce_kernel<<<grid, 256, 0, stream>>>(d, s.nT1, s.tile_flag, s.dG2p,
                                                dg2);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (!(g_stage_mask & 4)) return cudaGetLastError();
  {
    const size_t sm1 = sizeof(int) * align4(d.p2) +
                       sizeof(float) * (size_t)kThreads;
    if ((err = cudaFuncSetAttribute(dg1_reduce_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)std::max<size_t>(sm1, 48 * 1024))) !=
        cudaSuccess)
      return err;
    dg1_reduce_kernel<<<d.p1, kThreads, sm1, stream>>>(d, s.map, counts, n,
                                                       s.slots, s.dG1p, dg1);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (!(g_stage_mask & 8)) return cudaGetLastError();
  dg3_keys_kernel<<<eblocks, 256, 0, stream>>>(d, unique_ids, counts, n, s.map,
                                               s.keys_in, s.vals_in, s.ug);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (!(g_stage_mask & 16)) return cudaGetLastError();
  size_t cub_bytes = s.cub_bytes;
  if ((err = cub::DeviceRadixSort::SortPairs(
           s.cub_tmp, cub_bytes, s.keys_in, s.keys_out, s.vals_in, s.vals_out,
           n, 0, end_bit_for(d.p3), stream)) != cudaSuccess)
    return err;
  if (!(g_stage_mask & 32)) return cudaGetLastError();
  dg3_bounds_kernel<<<n / 256 + 1, 256, 0, stream>>>(d, s.keys_out, n, s.keys_in);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  // keys_in is free after the sort: it holds the p3+1 bucket bounds
  if (GBB > 0) {  // the GEMM path's dims: blocked dG3
    const size_t sm3 = sizeof(float) * (size_t)(kThreads / (d.r2 / 4)) * d.r2 * d.q3;
#define FLOWTT_DG3(MM, QQ3)                                                    \
  else if (d.M == MM && d.q3 == QQ3) {                                         \
    if ((err = cudaFuncSetAttribute(dg3_blocked_kernel<MM, QQ3>,               \
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                    (int)sm3)) != cudaSuccess)                 \
      return err;                                                              \
    dg3_blocked_kernel<MM, QQ3><<<dim3(d.p3, kS3), kThreads, sm3, stream>>>(   \
        d, s.keys_in, s.vals_out, n, s.ug, s.Pbuf, d_rows, s.slots, s.dg3p);   \
  }
    if (false) {
    }
    FLOWTT_DG3(4, 4) FLOWTT_DG3(8, 4) FLOWTT_DG3(16, 4)
    FLOWTT_DG3(4, 8) FLOWTT_DG3(8, 8) FLOWTT_DG3(16, 8)
#undef FLOWTT_DG3
  } else {
    dg3_kernel<<<dim3(d.p3, kS3), kThreads, 0, stream>>>(
        d, s.keys_in, s.vals_out, n, s.ug, s.Pbuf, d_rows, s.slots, s.dg3p);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  {
    const long long tot = (long long)d.p3 * d.r2 * d.q3;
    dg3_final_kernel<<<(int)((tot + 255) / 256), 256, 0, stream>>>(d, s.dg3p,
                                                                 dg3);
  }
  return cudaGetLastError();
}

cudaError_t bag_pool_fwd(const float* rows, const int* inverse,
                         const float* weights, const int* bag_offsets, int n,
                         int B, int D, float* out, cudaStream_t stream) {
  return launch_pool_fwd(rows, inverse, weights, bag_offsets, n, B, D, 0, n, nullptr, false,
                         out, stream);
}

size_t bag_pool_bwd_scratch_bytes(int n, int D) {
  return sizeof(float) * (size_t)((n + kPL - 1) / kPL) * 2 * D + 256;
}

cudaError_t bag_pool_bwd(const float* dout, const float* rows,
                         const float* weights, const int* inverse,
                         const int* bag_ids, const int* perm,
                         const int* run_offsets, const int* counts, int n,
                         int B, int D, float* d_rows, float* d_weights,
                         void* scratch, cudaStream_t stream) {
  float* part = static_cast<float*>(scratch);
  const bool v4 = (D % 4) == 0 &&
                  ((reinterpret_cast<uintptr_t>(dout) |
                    reinterpret_cast<uintptr_t>(rows) |
                    reinterpret_cast<uintptr_t>(d_rows) |
                    reinterpret_cast<uintptr_t>(part)) % 16) == 0;
  const int DV = v4 ? D / 4 : D;
  const int TS = team_size(DV);
  if (B <= 0) {
    cudaError_t e = cudaMemsetAsync(d_rows, 0, sizeof(float) * (size_t)n * D,
                                    stream);
    if (e != cudaSuccess) return e;
    return d_weights == nullptr
               ? cudaSuccess
               : cudaMemsetAsync(d_weights, 0, sizeof(float) * (size_t)n, stream);
  }
  const int nch = (n + kPL - 1) / kPL;
  const int b1 = (int)(((long long)nch * TS + 255) / 256);
  const int b2 = std::max(1, std::min((int)(((long long)n + 255) / 256),
                                      num_sms() * 16));
  const int bw = (int)(((long long)n * TS + 255) / 256);
  if (v4) {
    pool_bwd_rows_p1<4><<<b1, 256, 0, stream>>>(dout, weights, bag_ids, perm,
                                                inverse, run_offsets, counts,
                                                n, B, D, TS, d_rows, part);
    pool_bwd_rows_p2<4><<<b2, 256, 0, stream>>>(run_offsets, counts, n, D,
                                                part, d_rows);
    if (d_weights != nullptr)
      pool_bwd_weights_kernel<4><<<bw, 256, 0, stream>>>(
          dout, rows, inverse, bag_ids, perm, n, B, D, TS, d_weights);
  } else {
    pool_bwd_rows_p1<1><<<b1, 256, 0, stream>>>(dout, weights, bag_ids, perm,
                                                inverse, run_offsets, counts,
                                                n, B, D, TS, d_rows, part);
    pool_bwd_rows_p2<1><<<b2, 256, 0, stream>>>(run_offsets, counts, n, D,
                                                part, d_rows);
    if (d_weights != nullptr)
      pool_bwd_weights_kernel<1><<<bw, 256, 0, stream>>>(
          dout, rows, inverse, bag_ids, perm, n, B, D, TS, d_weights);
  }
  return cudaGetLastError();
}

}  // namespace flowtt
