// What every CUDA handler (ffi/cuda/handlers.cc, ffi/cuda/tb_handlers.cc) does around a launch: a
// CUDA status as an ffi::Error, scratch from XLA's allocator, and the steps before a rows
// launch in one (PrepareLaunch).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
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

// XLA scratch of `bytes` for a plan launcher (none, *out = nullptr, when bytes == 0; the
// launchers realign to 256 bytes).
inline xla::ffi::Error AllocatePlanScratch(xla::ffi::ScratchAllocator& scratch, size_t bytes,
                                           void** out) {
  *out = nullptr;
  return bytes > 0 ? AllocateScratch(scratch, bytes, out) : xla::ffi::Error::Success();
}

// What a rows launch takes once its operands passed the contract's check: the kernels'
// dims (Dims), n, and its XLA scratch.
template <typename Dims>
struct Launch {
  Dims t;
  int n;
  void* ws;
};

// `checked` (the contract's check of the operands), then dims(&t) (the kernels' own
// limits), then bytes(t, n) of scratch; the first error, else the launch's arguments.
template <typename Dims, typename DimsFn, typename BytesFn>
xla::ffi::ErrorOr<Launch<Dims>> PrepareLaunch(const xla::ffi::Error& checked, int64_t n,
                                              DimsFn&& dims, BytesFn&& bytes,
                                              xla::ffi::ScratchAllocator& scratch) {
  using Unexpected = xla::ffi::Unexpected<xla::ffi::Error>;
  if (checked.failure()) return Unexpected(checked);
  Launch<Dims> l{};
  if (xla::ffi::Error e = dims(&l.t); e.failure()) return Unexpected(e);
  l.n = static_cast<int>(n);
  if (xla::ffi::Error e = AllocateScratch(scratch, bytes(l.t, l.n), &l.ws); e.failure()) {
    return Unexpected(e);
  }
  return l;
}

}  // namespace flowtt
