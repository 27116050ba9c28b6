// Pooling (flowtt_bag_pool_fwd, flowtt_bag_pool_bwd and the pooling of
// flowtt_bag_fwd's chunks). Forward: one thread team per bag, ids in increasing k.
// Backward: d_rows by a segmented reduction over the sorted order (chunks of kPL
// sorted positions + a fixed-order combine of the chunk partials of hot ids),
// d_weights a team's dot per position (in pass 1 where a team covers D). Bitwise
// reproducible; float4 vectors when D % 4 == 0 and the buffers are 16-byte aligned.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/common.cuh"
#include "contract/pool_layout.h"
#include "include/ops.h"
#include "single/stages.h"

namespace flowtt {
namespace {

template <int VEC>
struct VecT;
template <>
struct VecT<1> {
  using T = float;
};
template <>
struct VecT<4> {
  using T = float4;
};

__device__ __forceinline__ void vfma(float& acc, float w, float v) { acc = fmaf(w, v, acc); }
__device__ __forceinline__ void vfma(float4& acc, float w, float4 v) {
  acc.x = fmaf(w, v.x, acc.x);
  acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z);
  acc.w = fmaf(w, v.w, acc.w);
}
__device__ __forceinline__ float vdot(float a, float b) { return a * b; }
__device__ __forceinline__ float vdot(float4 a, float4 b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}
// The sum of s over a team of TS lanes (mask: the team's lanes), a fixed xor tree; every
// lane holds it. team_dot: the same for one vector's dot a . b per lane (0 where !has).
__device__ __forceinline__ float team_sum(float s, int TS, unsigned mask) {
  for (int off = TS >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(mask, s, off);
  return s;
}
template <typename T>
__device__ __forceinline__ float team_dot(T a, T b, bool has, int TS, unsigned mask) {
  float s = 0.f;
  if (has) s += vdot(a, b);
  return team_sum(s, TS, mask);
}
template <typename T>
__device__ __forceinline__ T vzero();
template <>
__device__ __forceinline__ float vzero<float>() {
  return 0.f;
}
template <>
__device__ __forceinline__ float4 vzero<float4>() {
  return make_float4(0.f, 0.f, 0.f, 0.f);
}

// One thread team (TS lanes over D/VEC vectors) per bag, positions in
// increasing k. Only positions whose unique index is in [lo, hi) (hi capped
// at num_unique when counts is given) and whose weight is not 0 add
// w * rows[idx - lo] (a zero weight never reads its row: 0, not 0 * inf = NaN);
// accumulate: start from out (the fused forward's later chunks), else from 0. Bag b's
// sum is row PoolOutRow(b, B, batch) of out. Positions in batches of kPB: the batch's
// indices and weights, then its rows, are loaded before its fmas (two load latencies per
// batch, not per position), the fmas in increasing k.
constexpr int kPB = 8;  // positions per load batch of pool_fwd_kernel

template <int VEC>
__global__ void pool_fwd_kernel(const float* __restrict__ rows, const int* __restrict__ inverse,
                                const float* __restrict__ weights,
                                const int* __restrict__ bag_offsets, int n, int B, int D, int TS,
                                int lo, int hi, const int* __restrict__ counts, bool accumulate,
                                int batch, float* __restrict__ out) {
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
  T* ov = reinterpret_cast<T*>(out) + (size_t)PoolOutRow(bag, B, batch) * DV;
  for (int dv = lane; dv < DV; dv += TS) {
    T acc = accumulate ? ov[dv] : vzero<T>();
    for (int k0 = kb; k0 < ke; k0 += kPB) {
      unsigned idx[kPB];
      float w[kPB];
      T r[kPB];
#pragma unroll
      for (int i = 0; i < kPB; ++i) {
        idx[i] = span;
        w[i] = 0.f;
        if (k0 + i < ke) {
          idx[i] = (unsigned)(__ldg(inverse + k0 + i) - lo);
          w[i] = __ldg(weights + k0 + i);
        }
      }
#pragma unroll
      for (int i = 0; i < kPB; ++i) {
        r[i] = vzero<T>();
        if (idx[i] < span && w[i] != 0.f) r[i] = rv[(size_t)idx[i] * DV + dv];
      }
#pragma unroll
      for (int i = 0; i < kPB; ++i)
        if (idx[i] < span && w[i] != 0.f) vfma(acc, w[i], r[i]);
    }
    ov[dv] = acc;
  }
}

// d_rows by a deterministic segmented reduction over the sorted order
// (positions j -> perm[j]), so that a Zipf-hot id with 10^4..10^5
// occurrences does not serialise one thread team.
// Pass 1: team per chunk of kPL sorted positions; runs complete inside the
//   chunk are written to d_rows; a run that started before the chunk leaves
//   its chunk partial in slot (chunk, 0), a run that starts inside and
//   continues past the chunk leaves it in slot (chunk, 1).
// Pass 2: warps over blocks of unique ids; runs spanning chunks sum their partials in
//   chunk order (lane-strided, then a fixed shuffle tree); runs of more than kHotL
//   partials are queued for Pass 3: a warp per (run, vector), the same sums.
// d_rows past num_unique is not written (the contract leaves it unspecified).

// Pass 1 waits on its gathers (long scoreboard). Load batches of 4 positions, compiled for
// 5 CTAs per SM (48 registers, no spills), keep 40 warps per SM in flight instead of 24
// (batches of 8, 72 registers): harness pool backward S1 0.109 -> 0.093 ms, D128 r64
// B65536 0.728 -> 0.596 (4 CTAs with batches of 8: 0.099, 0.641).
#ifndef FLOWTT_POOL_P1_MINB  // tuning knob
#define FLOWTT_POOL_P1_MINB 5
#endif
#ifndef FLOWTT_POOL_P1_BATCH  // tuning knob: sorted positions loaded before their fmas
#define FLOWTT_POOL_P1_BATCH 4
#endif
#ifndef FLOWTT_POOL_P1_WEIGHTS  // tuning knob: 0 = d_weights by its own kernel always
#define FLOWTT_POOL_P1_WEIGHTS 1
#endif
#ifndef FLOWTT_POOL_P1W_MINB  // tuning knob: CTAs per SM of pass 1 with d_weights
#define FLOWTT_POOL_P1W_MINB 4
#endif
constexpr int kP1B = FLOWTT_POOL_P1_BATCH;
// WEIGHTS (a team's lanes cover D, DV <= TS): pass 1 also writes d_weights[p] = dout[bag_p] .
// rows[u_p] of each position, the dot and xor tree of pool_bwd_weights_kernel (same bits)
// from the dout vector it has loaded anyway; rows are read in runs of u (the batch's rows
// take 16 more registers: FLOWTT_POOL_P1W_MINB CTAs per SM).
template <int VEC, bool WEIGHTS>
__global__ void __launch_bounds__(256, WEIGHTS ? FLOWTT_POOL_P1W_MINB : FLOWTT_POOL_P1_MINB)
    pool_bwd_rows_p1(const float* __restrict__ dout, const float* __restrict__ weights,
                     const int* __restrict__ bag_ids, const int* __restrict__ perm,
                     const int* __restrict__ inverse, const int* __restrict__ run_offsets,
                     const int* __restrict__ counts, int n, int B, int D, int TS, int lo, int m,
                     float* __restrict__ d_rows, float* __restrict__ part, int* __restrict__ hot,
                     const float* __restrict__ rows, float* __restrict__ d_weights) {
  using T = typename VecT<VEC>::T;
  const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (gt == 0) *hot = 0;  // pass 2 counts its hot runs here
  const int k = (int)(gt / TS), lane = (int)(gt % TS);
  const int nch = (n + kPL - 1) / kPL;
  if (k >= nch) return;
  // the window: uniques [lo, hi) are the sorted positions [s0, s1); uniques are relative to lo
  const int hi = min(clampi(counts[0], 0, n), lo + m);
  if (lo >= hi) return;
  const int U = hi - lo;
  const int s0 = clampi(run_offsets[lo], 0, n), s1 = clampi(run_offsets[hi], s0, n);
  const int cs = k * kPL, ce = min(n, cs + kPL);
  const int js = max(cs, s0), je = min(ce, s1);
  if (js >= je) return;
  const int DV = D / VEC;
  const T* dv_ = reinterpret_cast<const T*>(dout);
  const T* rv = reinterpret_cast<const T*>(rows);
  T* o = reinterpret_cast<T*>(d_rows);
  T* pv = reinterpret_cast<T*>(part);
  const int wl = threadIdx.x & 31;
  const unsigned tmask = TS == 32 ? 0xffffffffu : ((1u << TS) - 1u) << (wl & ~(TS - 1));
  const int dv_end = WEIGHTS ? TS : DV;  // WEIGHTS: one pass, every lane of the team
  for (int dv = lane; dv < dv_end; dv += TS) {
    const bool has = !WEIGHTS || dv < DV;
    int cur = -1;
    T acc = vzero<T>();
    auto flush = [&](int u) {
      if (u < 0 || u >= U || !has) return;
      const int s = run_offsets[lo + u], e = run_offsets[lo + u + 1];
      if (s >= cs && e <= ce) {
        o[(size_t)u * DV + dv] = acc;
      } else {
        const int side = (s < cs) ? 0 : 1;
        pv[((size_t)k * 2 + side) * DV + dv] = acc;
      }
    };
    for (int j0 = js; j0 < je; j0 += kP1B) {
      int uj[kP1B], pj[kP1B];
      float wj[kP1B];
      T xj[kP1B], rj[WEIGHTS ? kP1B : 1];
#pragma unroll
      for (int i = 0; i < kP1B; ++i) {
        const int j = j0 + i;
        uj[i] = -1;
        wj[i] = 0.f;
        xj[i] = vzero<T>();
        if (WEIGHTS) rj[i] = vzero<T>();
        if (j < je) {
          const int p = clampi(__ldg(perm + j), 0, n - 1);
          pj[i] = p;
          uj[i] = __ldg(inverse + p) - lo;
          wj[i] = __ldg(weights + p);
          const int b = clampi(__ldg(bag_ids + p), 0, B - 1);
          if (has) xj[i] = dv_[(size_t)b * DV + dv];
          if (WEIGHTS && has) rj[i] = rv[(size_t)clampi(uj[i], 0, m - 1) * DV + dv];
        }
      }
#pragma unroll
      for (int i = 0; i < kP1B; ++i) {
        if (j0 + i < je) {
          if (uj[i] != cur) {
            flush(cur);
            cur = uj[i];
            acc = vzero<T>();
          }
          vfma(acc, wj[i], xj[i]);
          if (WEIGHTS) {
            const float sw = team_dot(xj[i], rj[i], has, TS, tmask);
            if (lane == 0) d_weights[pj[i]] = sw;
          }
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

// The sum of vector dv of a run's L chunk partials (chunks k0 ..): lane l takes partials l,
// l+32, ... (fixed), then a fixed xor tree across lanes; every lane holds the sum.
template <typename T>
__device__ __forceinline__ T warp_run_sum(const T* pv, int k0, int L, int DV, int dv, int lane) {
  T acc = vzero<T>();
#pragma unroll 8
  for (int i = lane; i < L; i += 32)  // unrolled: hot ids have ~10^3 partials
    vfma(acc, 1.f, pv[((size_t)(k0 + i) * 2 + (i == 0 ? 1 : 0)) * DV + dv]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) shfl_add<1>(acc, off);
  return acc;
}

// Persistent warps over blocks of 32 unique ids (a lane reads one id's run
// bounds). A run spanning chunks k0..k1 sums its L = k1 - k0 + 1 partials with
// warp_run_sum, the warp's vectors in turn; a run of more than kHotL partials is queued
// for pass 3 instead (hot[0] counts them, hot[1 ..] lists them; order-free: each run's
// sum does not depend on who computes it). A unique id without occurrences (never, for a
// valid plan) gets zeros.
template <int VEC>
__global__ void pool_bwd_rows_p2(const int* __restrict__ run_offsets,
                                 const int* __restrict__ counts, int n, int D, int lo, int m,
                                 const float* __restrict__ part, float* __restrict__ d_rows,
                                 int* __restrict__ hot) {
  using T = typename VecT<VEC>::T;
  constexpr int kV = 8;  // vectors per lane per pass
  const int lane = threadIdx.x & 31;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5;
  const int U = max(min(clampi(counts[0], 0, n), lo + m) - lo, 0);  // the window's uniques
  const int DV = D / VEC;
  T* o = reinterpret_cast<T*>(d_rows);
  const T* pv = reinterpret_cast<const T*>(part);
  for (int base = gw * 32; base < U; base += nw * 32) {
    const int u = base + lane;
    int s = 0, e = 0;
    if (u < U) {
      s = clampi(run_offsets[lo + u], 0, n);
      e = clampi(run_offsets[lo + u + 1], s, n);
    }
    const bool empty = u < U && e <= s;
    const int L = e > s ? (e - 1) / kPL - s / kPL + 1 : 0;  // partials of the run
    if (L > kHotL) {
      const int slot = atomicAdd(hot, 1);
      if (slot < pool_bwd_hot_capacity(n)) hot[1 + slot] = u;
    }
    const bool cross = L > 1 && L <= kHotL;
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
        for (int i = lane; i < L; i += 32) {  // once: L <= kHotL = 32
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

// Pass 3: the hot runs pass 2 queued (hot[0] of them, ids hot[1 ..]), a warp per (run,
// vector): the same sums as pass 2's warp, from more warps (a hot id's ~10^3 partials
// per vector are the longest chain of the pooling backward).
template <int VEC>
__global__ void pool_bwd_rows_p3(const int* __restrict__ run_offsets, const int* __restrict__ hot,
                                 int n, int D, int lo, const float* __restrict__ part,
                                 float* __restrict__ d_rows) {
  using T = typename VecT<VEC>::T;
  const int lane = threadIdx.x & 31;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nw = ((long long)gridDim.x * blockDim.x) >> 5;
  const int DV = D / VEC;
  const long long tasks = (long long)min(hot[0], pool_bwd_hot_capacity(n)) * DV;
  T* o = reinterpret_cast<T*>(d_rows);
  const T* pv = reinterpret_cast<const T*>(part);
  for (long long t = gw; t < tasks; t += nw) {
    const int u = hot[1 + t / DV], dv = (int)(t % DV);
    const int s = clampi(run_offsets[lo + u], 0, n), e = clampi(run_offsets[lo + u + 1], s, n);
    const int k0 = s / kPL;
    const T acc = warp_run_sum(pv, k0, (e - 1) / kPL - k0 + 1, DV, dv, lane);
    if (lane == 0) o[(size_t)u * DV + dv] = acc;
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
                                        const int* __restrict__ run_offsets,
                                        const int* __restrict__ counts, int n, int B, int D,
                                        int TS, int lo, int m, float* __restrict__ d_weights) {
  using T = typename VecT<VEC>::T;
  const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int j = (int)(gt / TS), lane = (int)(gt % TS);
  // the window's sorted positions [s0, s1) (uniques [lo, hi)); the others are not written
  const int hi = min(clampi(counts[0], 0, n), lo + m);
  const int s0 = lo < hi ? clampi(run_offsets[lo], 0, n) : 0;
  const int s1 = lo < hi ? clampi(run_offsets[hi], s0, n) : 0;
  const bool valid = j >= s0 && j < s1;
  const int DV = D / VEC;
  float s = 0.f;
  int k = 0;
  if (valid) {
    k = clampi(__ldg(perm + j), 0, n - 1);
    const int b = clampi(__ldg(bag_ids + k), 0, B - 1);
    const int idx = clampi(__ldg(inverse + k) - lo, 0, m - 1);
    const T* a = reinterpret_cast<const T*>(dout) + (size_t)b * DV;
    const T* r = reinterpret_cast<const T*>(rows) + (size_t)idx * DV;
    for (int dv = lane; dv < DV; dv += TS) s += vdot(a[dv], r[dv]);
  }
  s = team_sum(s, TS, 0xffffffffu);
  if (valid && lane == 0) d_weights[k] = s;
}

// Calls f(std::integral_constant<int, VEC>{}) with VEC = 4 (float4 vectors) when v4,
// else 1: the pooling kernels' vector width.
template <typename F>
void with_vec(bool v4, F&& f) {
  if (v4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 1>{});
}

int team_size(int DV) {
  int ts = 1;
  while (ts < DV && ts < 32) ts <<= 1;
  return ts;
}

}  // namespace

cudaError_t launch_pool_fwd(const float* rows, const int* inverse, const float* weights,
                            const int* bag_offsets, int n, int B, int D, int lo, int hi,
                            const int* counts, bool accumulate, int batch, float* out,
                            cudaStream_t stream) {
  if (B <= 0) return cudaSuccess;
  const bool v4 = (D % 4) == 0 && (reinterpret_cast<uintptr_t>(rows) % 16) == 0 &&
                  (reinterpret_cast<uintptr_t>(out) % 16) == 0;
  const int DV = v4 ? D / 4 : D;
  const int TS = team_size(DV);
  const int blocks = (int)(((long long)B * TS + 255) / 256);
  with_vec(v4, [&](auto vec) {
    pool_fwd_kernel<vec()><<<blocks, 256, 0, stream>>>(rows, inverse, weights, bag_offsets, n, B, D,
                                                       TS, lo, hi, counts, accumulate, batch, out);
  });
  return cudaGetLastError();
}

cudaError_t bag_pool_fwd(const float* rows, const int* inverse, const float* weights,
                         const int* bag_offsets, int n, int B, int D, int batch, PoolWindow w,
                         const int* counts, const float* prev, float* out, cudaStream_t stream) {
  if (prev != nullptr && prev != out) {  // accumulate onto prev (aliased to out, or copied)
    cudaError_t e = cudaMemcpyAsync(out, prev, sizeof(float) * (size_t)B * D,
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return e;
  }
  return launch_pool_fwd(rows, inverse, weights, bag_offsets, n, B, D, w.lo, w.lo + w.m, counts,
                         prev != nullptr, batch, out, stream);
}

cudaError_t bag_pool_bwd(const float* dout, const float* rows, const float* weights,
                         const int* inverse, const int* bag_ids, const int* perm,
                         const int* run_offsets, const int* counts, int n, int B, int D,
                         PoolWindow w, float* d_rows, float* d_weights, void* scratch,
                         cudaStream_t stream) {
  float* part = static_cast<float*>(scratch);
  int* hot = reinterpret_cast<int*>(part + pool_bwd_part_floats(n, D));
  // rows is read only for d_weights (without it, it may be an empty placeholder)
  const uintptr_t rows_addr = d_weights != nullptr ? reinterpret_cast<uintptr_t>(rows) : 0;
  const bool v4 =
      (D % 4) == 0 && ((reinterpret_cast<uintptr_t>(dout) | rows_addr |
                        reinterpret_cast<uintptr_t>(d_rows) | reinterpret_cast<uintptr_t>(part)) %
                       16) == 0;
  const int DV = v4 ? D / 4 : D;
  const int TS = team_size(DV);
  if (B <= 0) {
    cudaError_t e = cudaMemsetAsync(d_rows, 0, sizeof(float) * (size_t)w.m * D, stream);
    if (e != cudaSuccess) return e;
    return d_weights == nullptr ? cudaSuccess
                                : cudaMemsetAsync(d_weights, 0, sizeof(float) * (size_t)n, stream);
  }
  if (d_weights != nullptr && (w.lo > 0 || w.m < n)) {  // positions outside the window: 0
    cudaError_t e = cudaMemsetAsync(d_weights, 0, sizeof(float) * (size_t)n, stream);
    if (e != cudaSuccess) return e;
  }
  const int nch = (n + kPL - 1) / kPL;
  const int b1 = (int)(((long long)nch * TS + 255) / 256);
  const int b2 = std::max(1, std::min((int)(((long long)n + 255) / 256), num_sms() * 16));
  const int bw = (int)(((long long)n * TS + 255) / 256);
  with_vec(v4, [&](auto vec) {
    // d_weights in pass 1 where a team's lanes cover D (D <= 128), else by its own kernel
    const bool fused_w = FLOWTT_POOL_P1_WEIGHTS && d_weights != nullptr && DV <= TS;
    auto p1 = [&](auto wt) {
      pool_bwd_rows_p1<vec(), wt()><<<b1, 256, 0, stream>>>(
          dout, weights, bag_ids, perm, inverse, run_offsets, counts, n, B, D, TS, w.lo, w.m,
          d_rows, part, hot, wt() ? rows : nullptr, wt() ? d_weights : nullptr);
    };
    if (fused_w)
      p1(std::true_type{});
    else
      p1(std::false_type{});
    pool_bwd_rows_p2<vec()>
        <<<b2, 256, 0, stream>>>(run_offsets, counts, n, D, w.lo, w.m, part, d_rows, hot);
    pool_bwd_rows_p3<vec()>
        <<<num_sms() * 4, 256, 0, stream>>>(run_offsets, hot, n, D, w.lo, part, d_rows);
    if (d_weights != nullptr && !fused_w)
      pool_bwd_weights_kernel<vec()><<<bw, 256, 0, stream>>>(dout, rows, inverse, bag_ids, perm,
                                                             run_offsets, counts, n, B, D, TS,
                                                             w.lo, w.m, d_weights);
  });
  return cudaGetLastError();
}

}  // namespace flowtt
