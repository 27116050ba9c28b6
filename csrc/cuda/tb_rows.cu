// Table-batched rows kernels (sm_90), docs/batched_contract.md. The kernels see packed
// core rows only (u_i3, g_i1, g_i2 from the plan), never tables: one launch per stage
// serves every table of a shape group.
//
// Forward (flowtt_tb_rows_fwd), one persistent kernel: warps steal chunks of kTbChunk
// consecutive unique indices from an atomic counter; a warp walks the groups overlapping
// its chunk (the first by binary search in group_offsets), forms each group's prefix
// product P = g1[g_i1] . g2[g_i2] in its shared-memory slice and writes the rows of the
// chunk's unique indices of that group. A group longer than a chunk is split across
// chunks (its P recomputed per chunk), so any skew balances.
//
// Backward (flowtt_tb_rows_bwd), in the contract's summation order, no float atomics:
//   prep: sort keys (g_i2 of each group) and ug[u] (the group of each unique index);
//   cub radix sort of (g_i2, g) and bucket bounds of each packed g2 row; bounds of each
//   g1 row over g_i1 (non-decreasing in g); cub radix sort of (u_i3, u) and bounds of
//   each g3 row. Then one persistent kernel per core, work stealing over its packed rows
//   (a row no group touches is written 0):
//   dg1[I]: for the groups of I in ascending g, in batches of kTbBatch: dP_g by the
//     block (a thread per element, u ascending), then dP_g . g2[g_i2]^T (8 threads per
//     output, fixed shuffle tree) added to the row's accumulators;
//   dg2[I]: the same over the groups sorted by g_i2 (stable: ascending g), adding
//     g1[g_i1]^T . dP_g into the row kept in shared memory (4x4 tiles per thread);
//   dg3[I]: for the unique indices of I in ascending u, 8 at a time: a warp per u forms
//     P of its group, then each output element adds P^T . d_rows[u] in u order.
#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda/tb_rows.cuh"

namespace flowtt::tb {
namespace {

// ------------------------------- forward -------------------------------------------

template <int Q1C, int VEC>
__global__ void __launch_bounds__(kTbThreads)
    tb_fwd_kernel(TbDev d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ g3, const int* __restrict__ u_i3,
                  const int* __restrict__ g_i1, const int* __restrict__ g_i2,
                  const int* __restrict__ goffs, const int* __restrict__ counts, int n,
                  int* ctr, float* __restrict__ rows) {
  extern __shared__ float4 tb_smem4[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* G1s = reinterpret_cast<float*>(tb_smem4) +
               warp * (tb_align4(d.Q1R1) + tb_align4(d.M * d.ldP));
  float* Pw = G1s + tb_align4(d.Q1R1);
  int U, G;
  tb_counts(counts, n, U, G);
  for (;;) {
    int c = 0;
    if (lane == 0) c = atomicAdd(ctr, 1);
    c = __shfl_sync(0xffffffffu, c, 0);
    if ((long long)c * kTbChunk >= U) break;
    const int u0 = c * kTbChunk, u1 = min(u0 + kTbChunk, U);
    for (int g = tb_find_group(goffs, G, u0); g < G; ++g) {
      int gs, ge;
      tb_group_range(goffs, g, U, gs, ge);
      if (gs >= u1) break;
      const int a = max(gs, u0), b = min(ge, u1);
      if (a >= b) continue;
      tb_warp_load_g1(d, g1, tb_clamp(__ldg(g_i1 + g), 0, d.P1 - 1), G1s, lane);
      __syncwarp();
      tb_warp_prefix<Q1C, VEC>(d, G1s,
                               g2 + (size_t)tb_clamp(__ldg(g_i2 + g), 0, d.P2 - 1) * d.R1K,
                               Pw, lane);
      __syncwarp();
      tb_warp_apply(d, Pw, g3, u_i3, a, b, rows, lane);
      __syncwarp();
    }
  }
}

// ------------------------------- backward: sorts ------------------------------------

// keys[g] = g_i2[g] (P2 past num_groups: sorted last), vals[g] = g; ug[u] = the group
// of unique index u < num_unique.
__global__ void tb_prep_kernel(TbDev d, const int* __restrict__ g_i2,
                               const int* __restrict__ goffs, const int* __restrict__ counts,
                               int n, int* __restrict__ keys, int* __restrict__ vals,
                               int* __restrict__ ug) {
  int U, G;
  tb_counts(counts, n, U, G);
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    keys[j] = j < G ? tb_clamp(g_i2[j], 0, d.P2 - 1) : d.P2;
    vals[j] = j;
    if (j < U) ug[j] = tb_find_group(goffs, G, j);
  }
}

// keys[u] = u_i3[u] (P3 past num_unique), vals[u] = u.
__global__ void tb_keys3_kernel(TbDev d, const int* __restrict__ u_i3,
                                const int* __restrict__ counts, int n, int* __restrict__ keys,
                                int* __restrict__ vals) {
  int U, G;
  tb_counts(counts, n, U, G);
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    keys[j] = j < U ? tb_clamp(u_i3[j], 0, d.P3 - 1) : d.P3;
    vals[j] = j;
  }
}

// bounds[k] = the first j in [0, n) with key(j) >= k, for k in [0, P] (n if none), over
// non-decreasing keys in [0, P]: position j writes the k in (key(j-1), key(j)], position
// n those in (key(n-1), P]. key(j) = sorted[j] when given, else raw[j] clamped into
// [0, P) for j < num_groups and P past it (g_i1: non-decreasing for a valid plan).
__global__ void tb_bounds_kernel(const int* __restrict__ sorted, const int* __restrict__ raw,
                                 const int* __restrict__ counts, int n, int P,
                                 int* __restrict__ bounds) {
  int U, G;
  tb_counts(counts, n, U, G);
  auto key = [&](int j) {
    if (sorted != nullptr) return tb_clamp(sorted[j], 0, P);
    return j < G ? tb_clamp(raw[j], 0, P - 1) : P;
  };
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j <= n; j += gridDim.x * blockDim.x) {
    const int k0 = j == 0 ? -1 : key(j - 1);
    const int k1 = j == n ? P : key(j);
    for (int k = k0 + 1; k <= k1; ++k) bounds[k] = j;
  }
}

// ------------------------------- backward: dg1 --------------------------------------

// dg1[I] = sum over the groups g of I (bounds1), ascending, of dP_g . g2[g_i2[g]]^T.
// Threads (a, kp): output column a = tid / 8 (+ 32 per pass), kp = tid % 8 splits the
// K = q2*r2 terms (float4 quads kp, kp+8, ...); the 8 partials of each (q1, a) are
// combined by a fixed xor tree, then added to the accumulator of thread kp == 0.
template <int Q1C, int VEC>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg1_kernel(TbDev d, const float* __restrict__ g2, const float* __restrict__ g3,
                  const float* __restrict__ d_rows, const int* __restrict__ u_i3,
                  const int* __restrict__ g_i1, const int* __restrict__ g_i2,
                  const int* __restrict__ goffs, const int* __restrict__ counts, int n,
                  const int* __restrict__ bounds1, int* ctr, float* __restrict__ dg1) {
  constexpr int NQ1 = Q1C ? Q1C : kTbQ1Max;
  constexpr int KP = 8;
  extern __shared__ float4 tb_smem4[];
  float* dPs = reinterpret_cast<float*>(tb_smem4);  // [kTbBatch][PSZ]
  __shared__ int s_item, s_gs[kTbBatch], s_ge[kTbBatch], s_i2[kTbBatch], s_ok[kTbBatch];
  const int tid = threadIdx.x, kp = tid % KP;
  int U, G;
  tb_counts(counts, n, U, G);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.P1) break;
    const int lo = tb_clamp(bounds1[I], 0, G), hi = tb_clamp(bounds1[I + 1], lo, G);
    float acc[2][NQ1];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int x1 = 0; x1 < NQ1; ++x1) acc[p][x1] = 0.f;
    for (int g0 = lo; g0 < hi; g0 += kTbBatch) {
      const int nb = min(kTbBatch, hi - g0);
      __syncthreads();  // the previous batch's dPs are read
      if (tid < nb) {
        const int g = g0 + tid;
        tb_group_range(goffs, g, U, s_gs[tid], s_ge[tid]);
        s_i2[tid] = tb_clamp(__ldg(g_i2 + g), 0, d.P2 - 1);
        s_ok[tid] = tb_clamp(__ldg(g_i1 + g), 0, d.P1 - 1) == I;  // false: a bad plan
      }
      __syncthreads();
      tb_block_dP(d, nb, s_gs, s_ge, u_i3, g3, d_rows, dPs);
      __syncthreads();
      for (int k = 0; k < nb; ++k) {
        if (!s_ok[k]) continue;
        const float* dp = dPs + k * d.PSZ;
        const float* g2row = g2 + (size_t)s_i2[k] * d.R1K;
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
          if (pass * 32 >= d.r1) break;
          const int a = pass * 32 + tid / KP;
          float part[NQ1];
#pragma unroll
          for (int x1 = 0; x1 < NQ1; ++x1) part[x1] = 0.f;
          if (a < d.r1) {
            const float* gr = g2row + (size_t)a * d.K;
            if (VEC == 4) {
              for (int q = kp; q < d.K / 4; q += KP) {
                const float4 gv = __ldg(reinterpret_cast<const float4*>(gr) + q);
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
                const float gv = __ldg(gr + j);
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
              acc[pass][x1] += part[x1];
            }
          }
        }
      }
    }
    if (kp == 0) {
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        const int a = pass * 32 + tid / KP;
        if (a < d.r1) {
#pragma unroll
          for (int x1 = 0; x1 < NQ1; ++x1)
            if (Q1C || x1 < d.q1) dg1[((size_t)I * d.q1 + x1) * d.r1 + a] = acc[pass][x1];
        }
      }
    }
  }
}

// ------------------------------- backward: dg2 --------------------------------------

// dg2[I] = sum over the groups of I in ascending g (sorted_groups[bounds2[I] ..
// bounds2[I+1]), a stable sort by g_i2) of g1[g_i1[g]]^T . dP_g. The row [r1][K] is
// accumulated in shared memory, each element owned by one thread: VEC == 4 (r1 and K
// multiples of 4) 4x4 tiles (a0..a0+3, j0..j0+3) per thread, else single elements.
template <int VEC>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg2_kernel(TbDev d, const float* __restrict__ g1, const float* __restrict__ g3,
                  const float* __restrict__ d_rows, const int* __restrict__ u_i3,
                  const int* __restrict__ g_i1, const int* __restrict__ goffs,
                  const int* __restrict__ counts, int n, const int* __restrict__ bounds2,
                  const int* __restrict__ sorted_groups, int* ctr, float* __restrict__ dg2) {
  extern __shared__ float4 tb_smem4[];
  const int ld1 = tb_align4(d.Q1R1);
  float* acc = reinterpret_cast<float*>(tb_smem4);  // [r1][K]
  float* G1b = acc + tb_align4(d.R1K);              // [kTbBatch][ld1]
  float* dPs = G1b + kTbBatch * ld1;                // [kTbBatch][PSZ]
  __shared__ int s_item, s_gs[kTbBatch], s_ge[kTbBatch], s_i1[kTbBatch];
  const int tid = threadIdx.x;
  const int K4 = d.K / 4;
  const int owned = VEC == 4 ? (d.r1 / 4) * K4 : d.R1K;  // tiles or elements
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.P2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    for (int t = tid; t < owned; t += kTbThreads) {
      if (VEC == 4) {
        const int a0 = 4 * (t / K4), j0 = 4 * (t % K4);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          *reinterpret_cast<float4*>(acc + (a0 + i) * d.K + j0) = make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        acc[t] = 0.f;
      }
    }
    for (int j0 = lo; j0 < hi; j0 += kTbBatch) {
      const int nb = min(kTbBatch, hi - j0);
      __syncthreads();  // the previous batch's G1b / dPs are read
      if (tid < nb) {
        const int g = tb_clamp(__ldg(sorted_groups + j0 + tid), 0, gmax);
        tb_group_range(goffs, g, U, s_gs[tid], s_ge[tid]);
        s_i1[tid] = tb_clamp(__ldg(g_i1 + g), 0, d.P1 - 1);
      }
      __syncthreads();
      for (int e = tid; e < nb * d.Q1R1; e += kTbThreads) {
        const int k = e / d.Q1R1, r = e - k * d.Q1R1;
        G1b[k * ld1 + r] = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + r);
      }
      tb_block_dP(d, nb, s_gs, s_ge, u_i3, g3, d_rows, dPs);
      __syncthreads();
      for (int t = tid; t < owned; t += kTbThreads) {
        if (VEC == 4) {
          const int a0 = 4 * (t / K4), c0 = 4 * (t % K4);
          float v[4][4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float4 x = *reinterpret_cast<const float4*>(acc + (a0 + i) * d.K + c0);
            v[i][0] = x.x; v[i][1] = x.y; v[i][2] = x.z; v[i][3] = x.w;
          }
          for (int k = 0; k < nb; ++k) {
            float term[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int c = 0; c < 4; ++c) term[i][c] = 0.f;
            for (int x1 = 0; x1 < d.q1; ++x1) {
              const float4 gv = *reinterpret_cast<const float4*>(G1b + k * ld1 + x1 * d.r1 + a0);
              const float4 pv = *reinterpret_cast<const float4*>(dPs + k * d.PSZ + x1 * d.K + c0);
              const float ga[4] = {gv.x, gv.y, gv.z, gv.w};
              const float pb[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
              for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) term[i][c] = fmaf(ga[i], pb[c], term[i][c]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int c = 0; c < 4; ++c) v[i][c] += term[i][c];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i)
            *reinterpret_cast<float4*>(acc + (a0 + i) * d.K + c0) =
                make_float4(v[i][0], v[i][1], v[i][2], v[i][3]);
        } else {
          const int a = t / d.K, j = t - a * d.K;
          float v = acc[t];
          for (int k = 0; k < nb; ++k) {
            float term = 0.f;
            for (int x1 = 0; x1 < d.q1; ++x1)
              term = fmaf(G1b[k * ld1 + x1 * d.r1 + a], dPs[k * d.PSZ + x1 * d.K + j], term);
            v += term;
          }
          acc[t] = v;
        }
      }
    }
    float* out = dg2 + (size_t)I * d.R1K;
    for (int t = tid; t < owned; t += kTbThreads) {
      if (VEC == 4) {
        const int a0 = 4 * (t / K4), c0 = 4 * (t % K4);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          *reinterpret_cast<float4*>(out + (a0 + i) * d.K + c0) =
              *reinterpret_cast<const float4*>(acc + (a0 + i) * d.K + c0);
      } else {
        out[t] = acc[t];
      }
    }
  }
}

// ------------------------------- backward: dg3 --------------------------------------

// dg3[I] = sum over the unique indices u of I in ascending u (sorted_u[bounds3[I] ..
// bounds3[I+1]), a stable sort by u_i3) of P_{g(u)}^T . d_rows[u]. Per step of 8 ids a
// warp forms P of one id's group in its slice; then each output element (b, z) (thread
// tid, tid + 256) adds the 8 terms (each a sum over m ascending) in u order.
template <int Q1C, int VEC>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg3_kernel(TbDev d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ d_rows, const int* __restrict__ g_i1,
                  const int* __restrict__ g_i2, const int* __restrict__ counts, int n,
                  const int* __restrict__ bounds3, const int* __restrict__ sorted_u,
                  const int* __restrict__ ug, int* ctr, float* __restrict__ dg3) {
  extern __shared__ float4 tb_smem4[];
  float* smem = reinterpret_cast<float*>(tb_smem4);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wsz = tb_align4(d.Q1R1) + tb_align4(d.M * d.ldP);  // per warp: G1 row, P
  float* G1s = smem + warp * wsz;
  float* Pw = G1s + tb_align4(d.Q1R1);
  __shared__ int s_item, s_u[kTbWarps];
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.P3) break;
    const int lo = tb_clamp(bounds3[I], 0, n), hi = tb_clamp(bounds3[I + 1], lo, n);
    float acc[2] = {0.f, 0.f};  // elements tid, tid + 256 (r2*q3 <= 512)
    for (int j0 = lo; j0 < hi; j0 += kTbWarps) {
      const int nb = min(kTbWarps, hi - j0);
      if (warp < nb) {
        const int u = tb_clamp(__ldg(sorted_u + j0 + warp), 0, n - 1);
        const int g = tb_clamp(__ldg(ug + u), 0, gmax);
        if (lane == 0) s_u[warp] = u;
        tb_warp_load_g1(d, g1, tb_clamp(__ldg(g_i1 + g), 0, d.P1 - 1), G1s, lane);
        __syncwarp();
        tb_warp_prefix<Q1C, VEC>(d, G1s,
                                 g2 + (size_t)tb_clamp(__ldg(g_i2 + g), 0, d.P2 - 1) * d.R1K,
                                 Pw, lane);
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int e = tid + i * kTbThreads;
        if (e < d.S3) {
          const int b = e / d.q3, z = e - b * d.q3;
          float v = acc[i];
          for (int k = 0; k < nb; ++k) {
            const float* P = smem + k * wsz + tb_align4(d.Q1R1) + b;
            const float* dr = d_rows + (size_t)s_u[k] * d.D + z;
            float c = 0.f;
            for (int m = 0; m < d.M; ++m) c = fmaf(P[m * d.ldP], __ldg(dr + m * d.q3), c);
            v += c;
          }
          acc[i] = v;
        }
      }
      __syncthreads();  // the slices and s_u are read
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int e = tid + i * kTbThreads;
      if (e < d.S3) dg3[(size_t)I * d.S3 + e] = acc[i];
    }
  }
}

// ------------------------------- host side ------------------------------------------

int tb_num_sms() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

// A persistent grid: as many blocks as fit on the device at once.
template <typename Kernel, typename... Args>
cudaError_t tb_launch(Kernel kernel, size_t smem, cudaStream_t stream, Args... args) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  int occ = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kTbThreads, smem)) !=
      cudaSuccess)
    return err;
  occ = std::max(1, std::min(occ, 8));
  kernel<<<tb_num_sms() * occ, kTbThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

// The kernel instance for q1 (register blocking over q1 when q1 is 1, 2, 4 or 8).
#define TB_BY_Q1(KERNEL, VEC, q1)                              \
  ((q1) == 1   ? &KERNEL<1, VEC>                               \
   : (q1) == 2 ? &KERNEL<2, VEC>                               \
   : (q1) == 4 ? &KERNEL<4, VEC>                               \
   : (q1) == 8 ? &KERNEL<8, VEC>                               \
               : &KERNEL<0, VEC>)

bool tb_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

size_t tb_align256(size_t x) { return (x + 255) / 256 * 256; }

// Scratch carved from a 256-byte aligned base (the caller's block has 256 bytes spare).
struct TbBump {
  char* base;
  size_t off = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += tb_align256(count * sizeof(T));
    return p;
  }
};

char* tb_base(void* scratch) {
  if (scratch == nullptr) return nullptr;
  return reinterpret_cast<char*>(tb_align256(reinterpret_cast<uintptr_t>(scratch)));
}

int tb_end_bit(int max_key) {  // bits that hold keys in [0, max_key]
  int b = 1;
  while (b < 31 && (1LL << b) <= max_key) ++b;
  return b;
}

size_t tb_warp_slices_bytes(const TbDev& d) {
  return sizeof(float) * kTbWarps * (size_t)(tb_align4(d.Q1R1) + tb_align4(d.M * d.ldP));
}
size_t tb_dg1_smem(const TbDev& d) { return sizeof(float) * (size_t)kTbBatch * d.PSZ; }
size_t tb_dg2_smem(const TbDev& d) {
  return sizeof(float) *
         ((size_t)tb_align4(d.R1K) + (size_t)kTbBatch * (tb_align4(d.Q1R1) + d.PSZ));
}

struct TbBwdScratch {
  int* zeroed;  // ctrl [4] then bounds1 [P1+1]: one memset
  size_t zeroed_bytes;
  int *ctrl, *bounds1, *bounds2, *bounds3;
  int *ka, *kb, *va, *vb, *vc, *ug;
  void* cub_tmp;
  size_t cub_bytes, bytes;
};

size_t tb_sort_bytes(int n, int max_key) {
  size_t bytes = 0;
  cub::DoubleBuffer<int> k(nullptr, nullptr), v(nullptr, nullptr);
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, k, v, n, 0, tb_end_bit(max_key));
  return bytes;
}

TbBwdScratch tb_bwd_layout(const TbDev& d, int n, char* base) {
  TbBump bp{base};
  TbBwdScratch s;
  s.zeroed_bytes = sizeof(int) * (4 + (size_t)d.P1 + 1);
  s.zeroed = bp.take<int>(4 + (size_t)d.P1 + 1);
  s.ctrl = s.zeroed;
  s.bounds1 = s.zeroed ? s.zeroed + 4 : nullptr;
  s.bounds2 = bp.take<int>((size_t)d.P2 + 1);
  s.bounds3 = bp.take<int>((size_t)d.P3 + 1);
  s.ka = bp.take<int>(n);
  s.kb = bp.take<int>(n);
  s.va = bp.take<int>(n);
  s.vb = bp.take<int>(n);
  s.vc = bp.take<int>(n);
  s.ug = bp.take<int>(n);
  s.cub_bytes = std::max(tb_sort_bytes(n, d.P2), tb_sort_bytes(n, d.P3));
  s.cub_tmp = bp.take<char>(s.cub_bytes);
  s.bytes = bp.off + 256;
  return s;
}

}  // namespace

const char* tb_check_dims(const TbDims& t) {
  if (t.P1 < 1 || t.P2 < 1 || t.P3 < 1 || t.q1 < 1 || t.q2 < 1 || t.q3 < 1 || t.r1 < 1 ||
      t.r2 < 1)
    return "flowtt_tb CUDA: every core extent must be >= 1";
  if (t.q1 > kTbQ1Max || t.q1 * t.q2 > kTbMMax || t.q3 > kTbQ3Max || t.r1 > kTbRMax ||
      t.r2 > kTbRMax)
    return "flowtt_tb CUDA: unsupported core shape (need q1 <= 8, q1*q2 <= 16, q3 <= 8, "
           "r1 <= 64, r2 <= 64); use impl='reference'";
  if (tb_dg2_smem(tb_dev(t)) > 200 * 1024)
    return "flowtt_tb CUDA: g2 rows too large for the dg2 kernel's shared memory (r1*q2*r2 "
           "must be <= ~45k); use impl='reference'";
  return nullptr;
}

size_t tb_rows_fwd_scratch_bytes(const TbDims&, int) { return 2 * 256; }

cudaError_t tb_rows_fwd(const TbDims& t, const float* g1, const float* g2, const float* g3,
                        const int* u_i3, const int* g_i1, const int* g_i2,
                        const int* group_offsets, const int* counts, int n, float* rows,
                        void* scratch, cudaStream_t stream) {
  const TbDev d = tb_dev(t);
  int* ctr = reinterpret_cast<int*>(tb_base(scratch));
  cudaError_t err = cudaMemsetAsync(ctr, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  const bool vec = d.K % 4 == 0 && tb_aligned16(g2);
  auto kernel = vec ? TB_BY_Q1(tb_fwd_kernel, 4, d.q1) : TB_BY_Q1(tb_fwd_kernel, 1, d.q1);
  return tb_launch(kernel, tb_warp_slices_bytes(d), stream, d, g1, g2, g3, u_i3, g_i1, g_i2,
                   group_offsets, counts, n, ctr, rows);
}

size_t tb_rows_bwd_scratch_bytes(const TbDims& t, int n) {
  return tb_bwd_layout(tb_dev(t), n, nullptr).bytes;
}

cudaError_t tb_rows_bwd(const TbDims& t, const float* g1, const float* g2, const float* g3,
                        const float* d_rows, const int* u_i3, const int* g_i1, const int* g_i2,
                        const int* group_offsets, const int* counts, int n, float* dg1,
                        float* dg2, float* dg3, void* scratch, cudaStream_t stream,
                        unsigned stages) {
  const TbDev d = tb_dev(t);
  const TbBwdScratch s = tb_bwd_layout(d, n, tb_base(scratch));
  cudaError_t err;
  if ((err = cudaMemsetAsync(s.zeroed, 0, s.zeroed_bytes, stream)) != cudaSuccess) return err;
  const int eblocks = std::max(1, std::min((n + 255) / 256, tb_num_sms() * 8));
  const int bblocks = std::max(1, std::min(n / 256 + 1, tb_num_sms() * 8));  // n + 1 positions
  // groups by g_i2, bounds of the g2 rows; bounds of the g1 rows
  tb_prep_kernel<<<eblocks, 256, 0, stream>>>(d, g_i2, group_offsets, counts, n, s.ka, s.va,
                                              s.ug);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  cub::DoubleBuffer<int> k2(s.ka, s.kb), v2(s.va, s.vb);
  size_t cub_bytes = s.cub_bytes;
  if ((err = cub::DeviceRadixSort::SortPairs(s.cub_tmp, cub_bytes, k2, v2, n, 0,
                                             tb_end_bit(d.P2), stream)) != cudaSuccess)
    return err;
  const int* sorted_groups = v2.Current();
  tb_bounds_kernel<<<bblocks, 256, 0, stream>>>(k2.Current(), nullptr, counts, n, d.P2,
                                                s.bounds2);
  tb_bounds_kernel<<<bblocks, 256, 0, stream>>>(nullptr, g_i1, counts, n, d.P1, s.bounds1);
  // unique indices by u_i3 (values into the buffer the group sort left free), bounds of
  // the g3 rows
  int* v3_in = v2.Alternate();
  tb_keys3_kernel<<<eblocks, 256, 0, stream>>>(d, u_i3, counts, n, s.ka, v3_in);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  cub::DoubleBuffer<int> k3(s.ka, s.kb), v3(v3_in, s.vc);
  cub_bytes = s.cub_bytes;
  if ((err = cub::DeviceRadixSort::SortPairs(s.cub_tmp, cub_bytes, k3, v3, n, 0,
                                             tb_end_bit(d.P3), stream)) != cudaSuccess)
    return err;
  const int* sorted_u = v3.Current();
  tb_bounds_kernel<<<bblocks, 256, 0, stream>>>(k3.Current(), nullptr, counts, n, d.P3,
                                                s.bounds3);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  const bool vec_g2 = d.K % 4 == 0 && tb_aligned16(g2);
  if (stages & 1) {
    auto kernel = vec_g2 ? TB_BY_Q1(tb_dg1_kernel, 4, d.q1) : TB_BY_Q1(tb_dg1_kernel, 1, d.q1);
    if ((err = tb_launch(kernel, tb_dg1_smem(d), stream, d, g2, g3, d_rows, u_i3, g_i1, g_i2,
                         group_offsets, counts, n, (const int*)s.bounds1, s.ctrl + 0, dg1)) !=
        cudaSuccess)
      return err;
  }
  if (stages & 2) {
    const bool vec = d.K % 4 == 0 && d.r1 % 4 == 0 && tb_aligned16(dg2);
    auto kernel = vec ? &tb_dg2_kernel<4> : &tb_dg2_kernel<1>;
    if ((err = tb_launch(kernel, tb_dg2_smem(d), stream, d, g1, g3, d_rows, u_i3, g_i1,
                         group_offsets, counts, n, (const int*)s.bounds2, sorted_groups,
                         s.ctrl + 1, dg2)) != cudaSuccess)
      return err;
  }
  if (stages & 4) {
    auto kernel = vec_g2 ? TB_BY_Q1(tb_dg3_kernel, 4, d.q1) : TB_BY_Q1(tb_dg3_kernel, 1, d.q1);
    if ((err = tb_launch(kernel, tb_warp_slices_bytes(d), stream, d, g1, g2, d_rows, g_i1,
                         g_i2, counts, n, (const int*)s.bounds3, sorted_u,
                         (const int*)s.ug, s.ctrl + 2, dg3)) != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

}  // namespace flowtt::tb
