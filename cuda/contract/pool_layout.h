// Where flowtt_bag_pool_fwd writes a bag (the attribute `batch`), shared by the CPU and
// CUDA handlers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLOWTT_POOL_HD __host__ __device__ __forceinline__
#else
#define FLOWTT_POOL_HD inline
#endif

namespace flowtt {

// Output row of bag j of num_bags: j (batch == 0), or, for feature-major bags (bag
// f * batch + b of F = num_bags / batch features) written batch-major, b * F + f.
FLOWTT_POOL_HD int64_t PoolOutRow(int64_t bag, int64_t num_bags, int64_t batch) {
  return batch > 0 ? (bag % batch) * (num_bags / batch) + bag / batch : bag;
}

}  // namespace flowtt

#undef FLOWTT_POOL_HD
