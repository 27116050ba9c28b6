// What every CUDA handler (cuda/handlers.cc, cuda/tb_handlers.cc) does around a launch: a
// CUDA status as an ffi::Error, and scratch from XLA's allocator.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace flowtt {

// ffi::Error of a CUDA status ("flowtt CUDA <what>: <message>"), Success for cudaSuccess.
inline xla::ffi::Error CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string("flowtt CUDA ") + what + ": " +
                                   cudaGetErrorString(e));
}

// Scratch of `bytes` (at least 256) from XLA's allocator into *out. The alignment asked is
// 16: XLA rejects larger ones (the launchers that need 256 realign inside the block).
inline xla::ffi::Error AllocateScratch(xla::ffi::ScratchAllocator& scratch, size_t bytes,
                                       void** out) {
  auto p = scratch.Allocate(bytes < 256 ? 256 : bytes, 16);
  if (!p.has_value()) return xla::ffi::Error::Internal("flowtt CUDA: scratch allocation failed");
  *out = *p;
  return xla::ffi::Error::Success();
}

}  // namespace flowtt
