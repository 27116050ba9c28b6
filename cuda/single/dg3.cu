// dG3 of the backward (flowtt_tt_rows_bwd), after the tile stage (cuda/single/rows_bwd.cu,
// which keeps every group's P in Pbuf): the unique ids are stably radix-sorted by i3
// (cub; the keys kernel also writes each id's group from the prefix map), bucket
// bounds come from adjacent sorted keys, fixed parts of each i3 bucket are summed
// (P_g^T dRow_u, ids ascending) and the parts combined in order: bitwise
// reproducible. dg3_blocked_kernel is the fast path (GEMM table shapes), dg3_kernel
// the fallback.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cub/cub.cuh>
#include <type_traits>

#include "common/common.cuh"
#include "single/scratch.h"
#include "single/shape_dispatch.cuh"
#include "single/stages.h"

namespace flowtt {
namespace {

// Columns b a thread of the blocked dG3 pass takes (dg3_blocked_kernel): 2 (512 threads)
// for r2 >= 64, else 4 (256 threads). Harness rows backward, same bits: D128 r64 B65536
// 2.587 -> 2.548 ms with 2; S1 (r2 = 32) 0.283 -> 0.318 ms with 2, so 4 there.
// FLOWTT_DG3_BW = 2 or 4 forces one for every shape (tuning).
#ifndef FLOWTT_DG3_BW
#define FLOWTT_DG3_BW 0
#endif
inline int dg3_bw(const Dev& d) { return FLOWTT_DG3_BW ? FLOWTT_DG3_BW : d.r2 >= 64 ? 2 : 4; }

constexpr int kBatch = 256;  // ids staged in shared memory per step of dg3_kernel

// Sort keys (i3, or p3 past num_unique) and values (u) for the dG3 pass, and
// ug[u] = the prefix group of unique id u (from the prefix map).
__global__ void dg3_keys_kernel(Dev d, const int* __restrict__ uids, const int* __restrict__ counts,
                                int n, const int* __restrict__ map, int* __restrict__ keys,
                                int* __restrict__ vals, int* __restrict__ ug) {
  const int U = clampi(counts[0], 0, n);
  for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < n; u += gridDim.x * blockDim.x) {
    int k = d.p3;
    if (u < U) {
      int i1, i2, i3;
      split_id(d, uids[u], i1, i2, i3);
      k = i3;
      ug[u] = map_group(map, d.p2, i1, i2);
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
__global__ void dg3_kernel(Dev d, const int* __restrict__ bounds, const int* __restrict__ vals,
                           int n, const int* __restrict__ ug, const float* __restrict__ Pbuf,
                           const float* __restrict__ d_rows, int slots, float* __restrict__ dg3p) {
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
          for (int m = m0; m < d.M; ++m) acc = fmaf(__ldg(P + m * d.r2), __ldg(dr + m * d.q3), acc);
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

// BW consecutive floats (16- or 8-byte aligned) from global memory into p.
template <int BW>
__device__ __forceinline__ void ldg_cols(const float* a, float (&p)[BW]) {
  static_assert(BW == 2 || BW == 4, "BW: 2 or 4");
  if constexpr (BW == 4) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(a));
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
  } else {
    const float2 v = __ldg(reinterpret_cast<const float2*>(a));
    p[0] = v.x, p[1] = v.y;
  }
}

// dG3 partials, blocked (the fast path, same dims as the GEMM kernels): block (i3, part)
// as in dg3_kernel; the part's unique ids are dealt to kThreads / (r2 / 4) streams (`sub`:
// ids sub, sub + subs, ... in order), and each of a stream's r2 / BW threads owns BW
// columns b x all q3 of its output; per id a thread reads P_g[m][b0..b0+BW) and
// dRow_u[m][:] (BW*Q3 FMAs per m). Streams are combined in order. Neither the streams nor
// an output's sum over m within one depends on BW: BW = 2 (512 threads, a warp per stream
// at r2 = 64) gives the bits of BW = 4 (256 threads) with fewer registers a thread and
// more warps in flight.
template <int M, int Q3, int BW>
__global__ void __launch_bounds__(kThreads * 4 / BW)
    dg3_blocked_kernel(Dev d, const int* __restrict__ bounds, const int* __restrict__ vals, int n,
                       const int* __restrict__ ug, const float* __restrict__ Pbuf,
                       const float* __restrict__ d_rows, int slots, float* __restrict__ dg3p) {
  constexpr int NT = kThreads * 4 / BW;
  extern __shared__ float4 smem4[];
  float* s_red = reinterpret_cast<float*>(smem4);  // [subs][r2*Q3]
  const int i3 = blockIdx.x, part = blockIdx.y;
  const int tid = threadIdx.x;
  const int NBW = d.r2 / BW;               // threads of a stream
  const int subs = kThreads / (d.r2 / 4);  // streams (those of BW = 4)
  const int sub = tid / NBW, b0 = BW * (tid - sub * NBW);
  const int E3 = d.r2 * Q3;
  const int blo = bounds[i3], bhi = bounds[i3 + 1];
  const int per = (bhi - blo + kS3 - 1) / kS3;
  const int lo = min(bhi, blo + part * per), hi = min(bhi, lo + per);
  float acc[BW][Q3];
  zero_fill(acc);
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
        float p[BW];
        ldg_cols<BW>(P + m * d.r2, p);
        float dv[Q3];
        ldg_float4s<Q3 / 4>(dr + m * (Q3 / 4), dv);
#pragma unroll
        for (int q = 0; q < Q3; ++q)
#pragma unroll
          for (int i = 0; i < BW; ++i) acc[i][q] = fmaf(p[i], dv[q], acc[i][q]);
      }
    }
    float* r = s_red + sub * E3 + b0 * Q3;  // [b][q] order
#pragma unroll
    for (int i = 0; i < BW; ++i)
#pragma unroll
      for (int q = 0; q < Q3; ++q) r[i * Q3 + q] = acc[i][q];
  }
  __syncthreads();
  float* out = dg3p + ((size_t)i3 * kS3 + part) * E3;
  for (int e = tid; e < E3; e += NT) {
    float tot = 0.f;
    for (int k = 0; k < subs; ++k) tot += s_red[k * E3 + e];
    out[e] = tot;
  }
}

__global__ void dg3_final_kernel(Dev d, const float* __restrict__ dg3p, float* __restrict__ dg3) {
  const int E3 = d.r2 * d.q3;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)d.p3 * E3) return;
  const int i3 = (int)(i / E3), e = (int)(i % E3);
  float tot = 0.f;
#pragma unroll
  for (int s = 0; s < kS3; ++s) tot += dg3p[((size_t)i3 * kS3 + s) * E3 + e];
  dg3[i] = tot;
}

int end_bit_for(int maxkey) {
  int b = 1;
  while (b < 31 && (1LL << b) <= maxkey) ++b;
  return b;
}

}  // namespace

size_t dg3_sort_bytes(int n) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, (int*)nullptr, (int*)nullptr, (int*)nullptr,
                                  (int*)nullptr, n, 0, 32);
  return bytes;
}

cudaError_t launch_dg3_keys(const Dev& d, const int* unique_ids, const int* counts, int n,
                            const BwdScratch& s, cudaStream_t stream) {
  const int blocks = std::max(1, std::min((n + 255) / 256, num_sms() * 8));
  dg3_keys_kernel<<<blocks, 256, 0, stream>>>(d, unique_ids, counts, n, s.map, s.keys_in, s.vals_in,
                                              s.ug);
  return cudaGetLastError();
}

cudaError_t launch_dg3_sort(const Dev& d, int n, const BwdScratch& s, cudaStream_t stream) {
  size_t cub_bytes = s.cub_bytes;
  return cub::DeviceRadixSort::SortPairs(s.cub_tmp, cub_bytes, s.keys_in, s.keys_out, s.vals_in,
                                         s.vals_out, n, 0, end_bit_for(d.p3), stream);
}

cudaError_t launch_dg3(const Dev& d, const float* d_rows, int n, const BwdScratch& s, float* dg3,
                       cudaStream_t stream) {
  cudaError_t err;
  dg3_bounds_kernel<<<n / 256 + 1, 256, 0, stream>>>(d, s.keys_out, n, s.keys_in);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  // keys_in is free after the sort: it holds the p3+1 bucket bounds
  if (gemm_bwd_batch_groups(d) > 0) {  // the GEMM path's dims: blocked dG3
    const size_t sm3 = sizeof(float) * (size_t)(kThreads / (d.r2 / 4)) * d.r2 * d.q3;
    GemmShapes::dispatch(
        [&](auto shape) {
          using S = decltype(shape);
          auto launch = [&](auto bw) {
            constexpr int BW = decltype(bw)::value;
            auto kernel = dg3_blocked_kernel<S::M, S::Q3, BW>;
            err =
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm3);
            if (err == cudaSuccess)
              kernel<<<dim3(d.p3, kS3), kThreads * 4 / BW, sm3, stream>>>(
                  d, s.keys_in, s.vals_out, n, s.ug, s.Pbuf, d_rows, s.slots, s.dg3p);
          };
          if (dg3_bw(d) == 2)
            launch(std::integral_constant<int, 2>{});
          else
            launch(std::integral_constant<int, 4>{});
        },
        d.M, d.q3);
    if (err != cudaSuccess) return err;
  } else {
    dg3_kernel<<<dim3(d.p3, kS3), kThreads, 0, stream>>>(d, s.keys_in, s.vals_out, n, s.ug, s.Pbuf,
                                                         d_rows, s.slots, s.dg3p);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  {
    const long long tot = (long long)d.p3 * d.r2 * d.q3;
    dg3_final_kernel<<<(int)((tot + 255) / 256), 256, 0, stream>>>(d, s.dg3p, dg3);
  }
  return cudaGetLastError();
}

}  // namespace flowtt
