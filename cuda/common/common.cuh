// Shared by every stage of the CUDA kernels (cuda/*/*.cu): the work decomposition's
// constants, the core dims as the kernels see them (Dev), the device helpers (index
// math, clamps, shared-memory loads, the work-stealing claim) and the persistent-grid
// launch. docs/kernels.md describes the kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/tile_fma.cuh"
#include "include/ops.h"

namespace flowtt {

// ---- work decomposition ----
constexpr int kThreads = 256;    // threads of the warp tile kernels and the dG1 / dG3 passes
constexpr int kGT = 256;         // threads of the GEMM tile kernels
constexpr int kT1F = 32;         // i1 values per forward tile
constexpr int kT1B = 32;         // i1 values per backward tile
constexpr int kCH = 64;          // unique ids per chunk (split threshold of a prefix group)
constexpr int kRPT = kTileRows;  // GEMM rows per thread (tile_gemm_P: tile_fma_rows)
constexpr int kPL = 32;          // sorted positions per chunk of the pooling backward
constexpr int kHotL = 32;        // runs of more chunk partials: the pooling backward's pass 3
#ifndef FLOWTT_DG3_PARTS
#define FLOWTT_DG3_PARTS 8
#endif
constexpr int kS3 = FLOWTT_DG3_PARTS;  // parts per i3 bucket in the dG3 pass

// ---- shape bounds of the kernels' register blocking (check_dims) ----
constexpr int kQ1Max = 8;  // q1
constexpr int kMMax = 16;  // q1*q2
constexpr int kQ3Max = 8;  // q3
constexpr int kBB = 2;     // r2 <= 32 * kBB: columns b per lane
constexpr int kAMax = 64;  // r1

// The core dims as the kernels take them (by value), with derived sizes.
struct Dev {
  int p1, p2, p3, q1, q2, q3, r1, r2;
  int D, M, Q1R1, R1Q2R2, PSZ, R2p;
  long long nrows;
};

inline Dev make_dev(const TTDims& t) {
  Dev d;
  d.p1 = t.p1;
  d.p2 = t.p2;
  d.p3 = t.p3;
  d.q1 = t.q1;
  d.q2 = t.q2;
  d.q3 = t.q3;
  d.r1 = t.r1;
  d.r2 = t.r2;
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

__device__ __forceinline__ void split_id(const Dev& d, int id, int& i1, int& i2, int& i3) {
  long long c = id;
  if (c < 0) c = 0;
  if (c >= d.nrows) c = d.nrows - 1;
  const int cc = (int)c;
  i3 = cc % d.p3;
  const int t = cc / d.p3;
  i2 = t % d.p2;
  i1 = t / d.p2;
}

__device__ __forceinline__ void load_smem(float* dst, const float* __restrict__ src, int n) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const int n4 = n >> 2;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = __ldg(s4 + i);
    for (int i = (n4 << 2) + threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldg(src + i);
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

// Work stealing in the persistent kernels: the next work item (a tile, or a chunk of
// unique ids) is first + the counter's old value. One thread of the block (or lane of
// the warp) claims and shares the item; the launcher zeroes the counter.
__device__ __forceinline__ int claim_tile(int* counter, int first = 0) {
  return first + atomicAdd(counter, 1);
}

// N float4s from global memory (read-only path) into the register array dst[4 * N].
template <int N>
__device__ __forceinline__ void ldg_float4s(const float4* __restrict__ src, float* dst) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float4 v = __ldg(src + i);
    dst[4 * i] = v.x;
    dst[4 * i + 1] = v.y;
    dst[4 * i + 2] = v.z;
    dst[4 * i + 3] = v.w;
  }
}

// Asks L2 for the 128-byte line holding `at` (no register, no wait): a load a loop
// issues later finds it there instead of in HBM.
__device__ __forceinline__ void prefetch_l2(const void* at) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
}

// claim_tile for a whole block: thread 0 claims, every thread returns the item (`slot`:
// a __shared__ int, free again on return).
__device__ __forceinline__ int claim_tile_block(int* counter, int first, int& slot) {
  if (threadIdx.x == 0) slot = claim_tile(counter, first);
  __syncthreads();
  const int t = slot;
  __syncthreads();
  return t;
}

// Group g's unique ids [gs, ge): group_offsets[g], group_offsets[g + 1] clamped into [0, U]
// (a malformed plan reads nothing out of range).
__device__ __forceinline__ void group_ids(const int* __restrict__ goffs, int g, int U, int& gs,
                                          int& ge) {
  gs = clampi(goffs[g], 0, U);
  ge = clampi(goffs[g + 1], gs, U);
}

// The prefix map's group of prefix (i1, i2): map holds group + 1, 0 where the plan has
// none (so one memset of 0 clears it with the work counters after it), here -1.
__device__ __forceinline__ int map_group(const int* __restrict__ map, int p2, int i1, int i2) {
  return map[i1 * p2 + i2] - 1;
}

// Tile t of the prefix grid (i2 = t % p2, i1 from i1b = (t / p2) * T1): the prefix map's
// group of prefix (i1b + threadIdx.x, i2) when this thread is one of the tile's T1 and that
// prefix exists and `keep(group)` holds, else -1.
template <int T1, typename Dims, typename Keep>
__device__ __forceinline__ int tile_prefix_group(const Dims& d, const int* __restrict__ map, int t,
                                                 int& i1b, int& i2, Keep keep) {
  i2 = t % d.p2;
  i1b = (t / d.p2) * T1;
  const int i1 = i1b + (int)threadIdx.x;
  if (threadIdx.x >= T1 || i1 >= d.p1) return -1;
  const int g = map_group(map, d.p2, i1, i2);
  return g >= 0 && keep(g) ? g : -1;
}

// The pooling backward's scratch: chunk partials [ceil(n / kPL)][2][D] floats, then the hot
// runs' count and queue (int [1 + pool_bwd_hot_capacity(n)]): runs of more than kHotL
// partials are longer than (kHotL - 1) * kPL positions, and runs are disjoint.
__host__ __device__ inline size_t pool_bwd_part_floats(int n, int D) {
  return (size_t)((n + kPL - 1) / kPL) * 2 * D;
}
__host__ __device__ inline int pool_bwd_hot_capacity(int n) { return n / ((kHotL - 1) * kPL) + 1; }

inline int num_sms() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

// CTAs of NT threads and `smem` bytes of dynamic shared memory that fit an SM at once (the
// kernel's shared-memory limit raised to smem first).
template <int NT = kThreads, typename Kernel>
cudaError_t ctas_per_sm(Kernel kernel, size_t smem, int& occ) {
  occ = 0;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, NT, smem);
}

// Persistent grid of occ CTAs per SM (ctas_per_sm's count; clamped to 1..8).
template <int NT = kThreads, typename Kernel, typename... Args>
cudaError_t launch_persistent_at(Kernel kernel, size_t smem, int occ, cudaStream_t stream, int sms,
                                 Args... args) {
  occ = std::max(1, std::min(occ, 8));
  kernel<<<sms * occ, NT, smem, stream>>>(args...);
  return cudaGetLastError();
}

// Persistent grid: as many CTAs of NT threads as fit on the device at once.
template <int NT = kThreads, typename Kernel, typename... Args>
cudaError_t launch_persistent(Kernel kernel, size_t smem, cudaStream_t stream, int sms,
                              Args... args) {
  int occ = 0;
  const cudaError_t err = ctas_per_sm<NT>(kernel, smem, occ);
  if (err != cudaSuccess) return err;
  return launch_persistent_at<NT>(kernel, smem, occ, stream, sms, args...);
}

}  // namespace flowtt
