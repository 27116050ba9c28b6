// The dense prefix map of the rows kernels: map[i1*p2 + i2] = 1 + the prefix group of
// (i1, i2), 0 where the plan has none (the caller zeroes the map, with its work counters,
// in one memset; map_group in cuda/common/common.cuh reads it). The forward and backward tile
// kernels find a tile's groups through it, the chunk phase and the dG1 / dG3 passes a unique id's
// group.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/common.cuh"
#include "single/stages.h"

namespace flowtt {
namespace {

__global__ void build_map_kernel(Dev d, const int* __restrict__ uids, const int* __restrict__ goffs,
                                 const int* __restrict__ counts, int n, int* __restrict__ map) {
  const int U = clampi(counts[0], 0, n);
  const int G = clampi(counts[1], 0, U);
  const int stride = gridDim.x * blockDim.x;
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < G; g += stride) {
    const int gs = clampi(goffs[g], 0, n - 1);
    int i1, i2, i3;
    split_id(d, uids[gs], i1, i2, i3);
    map[i1 * d.p2 + i2] = g + 1;
  }
}

}  // namespace

cudaError_t launch_build_map(const Dev& d, const int* unique_ids, const int* group_offsets,
                             const int* counts, int n, int* map, cudaStream_t stream) {
  const int blocks = std::max(1, std::min((n + 255) / 256, num_sms() * 8));
  build_map_kernel<<<blocks, 256, 0, stream>>>(d, unique_ids, group_offsets, counts, n, map);
  return cudaGetLastError();
}

}  // namespace flowtt
