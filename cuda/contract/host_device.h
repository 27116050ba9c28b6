// FLOWTT_HD: a function of the plain C++ contract headers that CUDA code calls on the device
// too (__host__ __device__ under nvcc, inline elsewhere).
#pragma once

#if defined(__CUDACC__)
#define FLOWTT_HD __host__ __device__ __forceinline__
#else
#define FLOWTT_HD inline
#endif
