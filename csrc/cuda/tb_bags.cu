// flowtt_tb_bags (common/tb_bags.h). Pass 1: a block per span of kSpan positions finds the
// span's bag range (two binary searches of the offsets), then each position's bag in that
// range, and writes its bag, table, id and live flag; the first live position is an
// atomicMin (an order-free, so deterministic, minimum). Pass 2 parks the dropped positions
// on it.
#include "cuda/tb_bags.h"

#include <climits>
#include <cstdint>

namespace flowtt::tb {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;
constexpr int kBatch = 4;  // positions searched together
constexpr int64_t kSpan = int64_t{kThreads} * kPerThread;

__global__ void __launch_bounds__(kThreads)
    tb_bags_kernel(const TbBagsIn a, const TbBagsOut o, unsigned* first) {
  __shared__ int64_t range[2];
  __shared__ unsigned block_first;
  const int64_t p0 = (int64_t)blockIdx.x * kSpan;
  const int64_t p1 = (p0 + kSpan < a.n ? p0 + kSpan : a.n) - 1;
  if (threadIdx.x < 2) {
    range[threadIdx.x] = TbUpperBound(a.offsets, 0, a.num_bags + 1, threadIdx.x ? p1 : p0);
  }
  if (threadIdx.x == 0) block_first = UINT_MAX;
  __syncthreads();
  unsigned mine = UINT_MAX;
  // positions of the span have upper bounds in [range[0], range[1]] (monotone in p): each
  // searches there, kBatch positions at once with one trip count for the whole block, so
  // their load chains overlap
  const int64_t lo = range[0], len = range[1] - range[0];
  for (int i0 = 0; i0 < kPerThread; i0 += kBatch) {
    int64_t base[kBatch], p[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      base[j] = lo;
      p[j] = p0 + (int64_t)(i0 + j) * kThreads + threadIdx.x;
    }
    // the branchless lower bound: base stays in [lo, lo + len), m halves alike for all
    for (int64_t m = len; m > 1;) {
      const int64_t half = m / 2;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (a.offsets[base[j] + half] <= p[j]) base[j] += half;
      }
      m -= half;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (len > 0 && a.offsets[base[j]] <= p[j]) ++base[j];
      if (p[j] <= p1 && TbBagsPosition(a, p[j], base[j], o) && mine == UINT_MAX) {
        mine = (unsigned)p[j];
      }
    }
  }
  for (int off = 16; off > 0; off >>= 1) mine = min(mine, __shfl_xor_sync(0xffffffffu, mine, off));
  if ((threadIdx.x & 31) == 0 && mine != UINT_MAX) atomicMin(&block_first, mine);
  __syncthreads();
  if (threadIdx.x == 0 && block_first != UINT_MAX) atomicMin(first, block_first);
}

__global__ void tb_bags_park_kernel(const TbBagsIn a, const TbBagsOut o, const unsigned* first) {
  const unsigned f = *first;
  const int64_t src = f == UINT_MAX ? 0 : f;  // nothing live: every output is 0 anyway
  const int32_t id = o.ids[src], table = o.tables[src];
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < a.n;
       p += (int64_t)gridDim.x * blockDim.x) {
    if (o.live[p] == 0.f) {
      o.ids[p] = id;
      o.tables[p] = table;
    }
  }
}

}  // namespace

cudaError_t tb_bags(const TbBagsIn& in, const TbBagsOut& out, void* scratch, cudaStream_t stream) {
  unsigned* first = static_cast<unsigned*>(scratch);
  cudaError_t e = cudaMemsetAsync(first, 0xff, sizeof(unsigned), stream);
  if (e != cudaSuccess) return e;
  const int64_t blocks = (in.n + kSpan - 1) / kSpan;
  tb_bags_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(in, out, first);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  const int64_t park_blocks = (in.n + 1023) / 1024;
  tb_bags_park_kernel<<<(unsigned)(park_blocks < 8192 ? park_blocks : 8192), 256, 0, stream>>>(
      in, out, first);
  return cudaGetLastError();
}

}  // namespace flowtt::tb
