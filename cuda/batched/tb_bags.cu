// flowtt_tb_bags (cuda/contract/tb_bags.h). Pass 0: a cub inclusive max-scan of the clamped offsets
// writes the valid CSR (its writer also resets the first live position); then the upper
// bound in the CSR of every span start s * kSpan (a thread per span start). Pass 1: a block per
// span of kSpan positions searches each position's bag between the bounds of its span and the next,
// and writes its bag, table, id and live flag; the first live position is an atomicMin (an
// order-free, so deterministic, minimum). Pass 2 parks the dropped positions on it.
#include "include/tb_bags.h"

#include "single/scratch.h"  // Bump

#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/cub.cuh>

#include <climits>
#include <cstdint>

namespace flowtt::tb {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;
constexpr int kBatch = 4;  // positions searched together
constexpr int64_t kSpan = int64_t{kThreads} * kPerThread;
constexpr size_t kAlign = 256;

// offsets[k] clamped into [0, n] (the scan's input).
struct ClampedOffset {
  const int32_t* offsets;
  int64_t n;
  __device__ int32_t operator()(int k) const { return TbCsrClamp(offsets[k], n); }
};

// The scan's output: csr[k] = the running maximum; at k = 0 also the reset of `first`.
struct CsrWriter {
  int32_t* csr;
  unsigned* first;
  __device__ void operator()(ptrdiff_t k, int32_t m) const {
    csr[k] = m;
    if (k == 0) *first = UINT_MAX;
  }
};

struct Max {
  __device__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

using OffsetIter = thrust::transform_iterator<ClampedOffset, thrust::counting_iterator<int>>;

// The scan over num_bags + 1 offsets (tmp null: its bytes only).
cudaError_t csr_scan(void* tmp, size_t& bytes, const int32_t* offsets, int64_t n, int64_t num_bags,
                     int32_t* csr, unsigned* first, cudaStream_t stream) {
  return cub::DeviceScan::InclusiveScan(
      tmp, bytes, OffsetIter(thrust::counting_iterator<int>(0), ClampedOffset{offsets, n}),
      thrust::tabulate_output_iterator<CsrWriter>(CsrWriter{csr, first}), Max{},
      (int)(num_bags + 1), stream);
}

// span_ub[s] (s = 0 .. spans) = the upper bound in csr[0 .. num_bags] of position
// s * kSpan: the first k with csr[k] > s * kSpan, num_bags + 1 if none. A thread per span
// start, a binary search (balanced whatever the bags' lengths).
__global__ void tb_span_bounds_kernel(const TbBagsIn a, const int32_t* __restrict__ csr,
                                      int64_t spans, int32_t* __restrict__ span_ub) {
  for (int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s <= spans;
       s += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = s * kSpan;
    int64_t lo = 0, hi = a.num_bags + 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (csr[mid] <= p) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    span_ub[s] = (int32_t)lo;
  }
}

__global__ void __launch_bounds__(kThreads)
    tb_bags_kernel(const TbBagsIn a, const TbBagsOut o, const int32_t* __restrict__ span_ub,
                   unsigned* first) {
  __shared__ unsigned block_first;
  const int32_t* csr = o.offsets;
  const int64_t p0 = (int64_t)blockIdx.x * kSpan;
  const int64_t p1 = (p0 + kSpan < a.n ? p0 + kSpan : a.n) - 1;
  if (threadIdx.x == 0) block_first = UINT_MAX;
  __syncthreads();
  unsigned mine = UINT_MAX;
  // positions of the span have upper bounds in [span_ub[b], span_ub[b + 1]] (monotone in p):
  // each searches there, kBatch positions at once with one trip count for the whole block,
  // so their load chains overlap
  const int64_t lo = span_ub[blockIdx.x], len = span_ub[blockIdx.x + 1] - lo;
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
        if (csr[base[j] + half] <= p[j]) base[j] += half;
      }
      m -= half;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (len > 0 && csr[base[j]] <= p[j]) ++base[j];
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

// The scratch of n positions in num_bags bags: first, the span bounds [spans + 1] and the
// scan's storage, each 256-byte aligned after the base (null: sizes only).
struct BagsScratch {
  unsigned* first;
  int32_t* span_ub;
  void* scan_tmp;
  size_t scan_bytes;
  size_t bytes;  // with the slack to align the base
};

cudaError_t bags_layout(int64_t n, int64_t num_bags, void* scratch, BagsScratch* s) {
  const int64_t spans = (n + kSpan - 1) / kSpan;
  s->scan_bytes = 0;
  cudaError_t e = csr_scan(nullptr, s->scan_bytes, nullptr, 0, num_bags, nullptr, nullptr, nullptr);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(scratch) + kAlign - 1) / kAlign * kAlign;
  Bump bp{scratch ? reinterpret_cast<char*>(base) : nullptr};
  s->first = bp.take<unsigned>(1);
  s->span_ub = bp.take<int32_t>(spans + 1);
  s->scan_tmp = bp.take<char>(s->scan_bytes);
  s->bytes = kAlign + bp.off;
  return e;
}

}  // namespace

cudaError_t tb_bags_scratch_bytes(int64_t n, int64_t num_bags, size_t* bytes) {
  BagsScratch s;
  cudaError_t e = bags_layout(n, num_bags, nullptr, &s);
  *bytes = s.bytes;
  return e;
}

cudaError_t tb_bags(const TbBagsIn& in, const TbBagsOut& out, void* scratch, cudaStream_t stream) {
  BagsScratch s;
  cudaError_t e = bags_layout(in.n, in.num_bags, scratch, &s);
  if (e != cudaSuccess) return e;
  if ((e = csr_scan(s.scan_tmp, s.scan_bytes, in.offsets, in.n, in.num_bags, out.offsets, s.first,
                    stream)) != cudaSuccess)
    return e;
  const int64_t blocks = (in.n + kSpan - 1) / kSpan;
  const int64_t kb = (blocks + 1 + kThreads - 1) / kThreads;
  tb_span_bounds_kernel<<<(unsigned)(kb < 8192 ? kb : 8192), kThreads, 0, stream>>>(
      in, out.offsets, blocks, s.span_ub);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  tb_bags_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(in, out, s.span_ub, s.first);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  const int64_t park_blocks = (in.n + 1023) / 1024;
  tb_bags_park_kernel<<<(unsigned)(park_blocks < 8192 ? park_blocks : 8192), 256, 0, stream>>>(
      in, out, s.first);
  return cudaGetLastError();
}

}  // namespace flowtt::tb
