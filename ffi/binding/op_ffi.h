// XLA FFI operand/result lists of the single-table targets (docs/op_contract.md), shared by
// the CPU (ffi/cpu/handlers.cc) and CUDA (ffi/cuda/handlers.cc) handlers; the checks are in
// ffi/binding/op_contract.h.
#pragma once

#include <cstdint>
#include <utility>

#include "binding/ffi_binding.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt {

namespace ffi = xla::ffi;

// Operand and result lists of the targets, appended to a binding that may
// already hold context arguments (the CUDA stream, the scratch allocator).
// Trailing operands past the contract's are accepted and ignored (RemainingArgs).
using F32Buffer = ffi::Buffer<ffi::F32>;
using S32Buffer = ffi::Buffer<ffi::S32>;
using S32Out = ffi::ResultBuffer<ffi::S32>;

template <typename Binding>
auto BindRowsFwd(Binding b) {  // g1 g2 g3 unique_ids group_offsets counts -> rows
  return BindBuffers(std::move(b),
                     Buffers<F32Buffer, F32Buffer, F32Buffer, S32Buffer, S32Buffer, S32Buffer>{},
                     Buffers<F32Buffer>{});
}

template <typename Binding>
auto BindRowsBwd(Binding b) {  // g1 g2 g3 d_rows unique_ids group_offsets counts -> dg1 dg2 dg3
  return BindBuffers(
      std::move(b),
      Buffers<F32Buffer, F32Buffer, F32Buffer, F32Buffer, S32Buffer, S32Buffer, S32Buffer>{},
      Buffers<F32Buffer, F32Buffer, F32Buffer>{});
}

template <typename Binding>
auto BindPoolFwd(Binding b) {  // rows inverse weights offsets counts prev -> out; attrs batch, lo
  return BindBuffers(std::move(b),
                     Buffers<F32Buffer, S32Buffer, F32Buffer, S32Buffer, S32Buffer, F32Buffer>{},
                     Buffers<F32Buffer>{})
      .template Attr<int64_t>("batch")
      .template Attr<int64_t>("lo");
}

template <typename Binding>
auto BindPoolBwd(Binding b) {
  // dout rows weights inverse bag_ids perm run_offsets counts -> d_rows d_weights; attr lo
  return BindBuffers(std::move(b),
                     Buffers<F32Buffer, F32Buffer, F32Buffer, S32Buffer, S32Buffer, S32Buffer,
                             S32Buffer, S32Buffer>{},
                     Buffers<F32Buffer, F32Buffer>{})
      .template Attr<int64_t>("lo");
}

template <typename Binding>
auto BindBagFwd(Binding b) {
  // g1 g2 g3 unique_ids group_offsets counts inverse weights offsets -> out; attr chunk_rows
  return BindBuffers(std::move(b),
                     Buffers<F32Buffer, F32Buffer, F32Buffer, S32Buffer, S32Buffer, S32Buffer,
                             S32Buffer, F32Buffer, S32Buffer>{},
                     Buffers<F32Buffer>{})
      .template Attr<int64_t>("chunk_rows");
}

template <typename Binding>
auto BindPlan(Binding b) {
  // ids -> perm inverse unique_ids run_offsets group_offsets counts; attrs last_extent, num_rows
  return BindBuffers(std::move(b), Buffers<S32Buffer>{},
                     Buffers<S32Buffer, S32Buffer, S32Buffer, S32Buffer, S32Buffer, S32Buffer>{})
      .template Attr<int64_t>("last_extent")
      .template Attr<int64_t>("num_rows");
}

}  // namespace flowtt
