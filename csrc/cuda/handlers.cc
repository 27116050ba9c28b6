// XLA FFI handlers (platform CUDA) for the op contract (docs/op_contract.md).
// Every launch goes on the stream XLA hands us; scratch comes from XLA's
// scratch allocator; no device synchronisation, no cudaMalloc.
// Trailing operands past the contract's are ignored (RemainingArgs): tests
// alias each output to one of them, filled with NaN, to prove every output
// element is written.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/op_contract.h"
#include "cuda/handler_util.h"
#include "cuda/handlers.h"
#include "cuda/ops.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt {
namespace {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using F32Out = ffi::ResultBuffer<ffi::F32>;

ffi::Error PrepareCores(const F32& g1, const F32& g2, const F32& g3,
                        const S32& unique_ids, const S32& group_offsets,
                        const S32& counts, TTDims* t, int64_t* n) {
  CoreShape s;
  if (ffi::Error e = ReadCoreShape(g1, g2, g3, &s); e.failure()) return e;
  if (ffi::Error e = CheckGroupPlan(unique_ids, group_offsets, counts, n);
      e.failure())
    return e;
  if (*n >= (int64_t{1} << 31) / 2)
    return ffi::Error::InvalidArgument("flowtt CUDA: n too large");
  *t = TTDims{(int)s.p1, (int)s.p2, (int)s.p3, (int)s.q1,
              (int)s.q2, (int)s.q3, (int)s.r1, (int)s.r2};
  if (const char* msg = check_dims(*t))
    return ffi::Error::InvalidArgument(msg);
  return ffi::Error::Success();
}

ffi::Error RowsFwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                       F32 g1, F32 g2, F32 g3, S32 unique_ids,
                       S32 group_offsets, S32 counts, ffi::RemainingArgs,
                       F32Out rows) {
  TTDims t;
  int64_t n;
  if (ffi::Error e = PrepareCores(g1, g2, g3, unique_ids, group_offsets,
                                  counts, &t, &n);
      e.failure())
    return e;
  if (ffi::Error e = CheckMatrix(*rows, n, t.D(), "rows"); e.failure())
    return e;
  void* ws;
  if (ffi::Error e = AllocateScratch(scratch, rows_fwd_scratch_bytes(t, (int)n), &ws);
      e.failure())
    return e;
  return CudaError(
      rows_fwd(t, g1.typed_data(), g2.typed_data(), g3.typed_data(),
               unique_ids.typed_data(), group_offsets.typed_data(),
               counts.typed_data(), (int)n, rows->typed_data(), ws, stream),
      "rows_fwd");
}

ffi::Error RowsBwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                       F32 g1, F32 g2, F32 g3, F32 d_rows, S32 unique_ids,
                       S32 group_offsets, S32 counts, ffi::RemainingArgs,
                       F32Out dg1, F32Out dg2, F32Out dg3) {
  TTDims t;
  int64_t n;
  if (ffi::Error e = PrepareCores(g1, g2, g3, unique_ids, group_offsets,
                                  counts, &t, &n);
      e.failure())
    return e;
  if (ffi::Error e = CheckMatrix(d_rows, n, t.D(), "d_rows"); e.failure())
    return e;
  if (dg1->element_count() != g1.element_count() ||
      dg2->element_count() != g2.element_count() ||
      dg3->element_count() != g3.element_count())
    return ffi::Error::InvalidArgument(
        "core gradients must have the cores' shapes");
  void* ws;
  if (ffi::Error e = AllocateScratch(scratch, rows_bwd_scratch_bytes(t, (int)n), &ws);
      e.failure())
    return e;
  return CudaError(
      rows_bwd(t, g1.typed_data(), g2.typed_data(), g3.typed_data(),
               d_rows.typed_data(), unique_ids.typed_data(),
               group_offsets.typed_data(), counts.typed_data(), (int)n,
               dg1->typed_data(), dg2->typed_data(), dg3->typed_data(), ws,
               stream),
      "rows_bwd");
}

ffi::Error BagFwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                      F32 g1, F32 g2, F32 g3, S32 unique_ids, S32 group_offsets,
                      S32 counts, S32 inverse, F32 weights, S32 offsets,
                      ffi::RemainingArgs, F32Out out, int64_t chunk_rows) {
  TTDims t;
  int64_t n, bags;
  if (ffi::Error e = PrepareCores(g1, g2, g3, unique_ids, group_offsets,
                                  counts, &t, &n);
      e.failure())
    return e;
  if (ffi::Error e = CheckBagFwd(inverse, weights, offsets, *out, n, t.D(),
                                 chunk_rows, &bags);
      e.failure())
    return e;
  void* ws;
  if (ffi::Error e = AllocateScratch(scratch, bag_fwd_scratch_bytes(t, (int)n, chunk_rows), &ws);
      e.failure())
    return e;
  return CudaError(
      bag_fwd(t, g1.typed_data(), g2.typed_data(), g3.typed_data(),
              unique_ids.typed_data(), group_offsets.typed_data(),
              counts.typed_data(), inverse.typed_data(), weights.typed_data(),
              offsets.typed_data(), (int)n, (int)bags, chunk_rows,
              out->typed_data(), ws, stream),
      "bag_fwd");
}

ffi::Error PoolFwdImpl(cudaStream_t stream, F32 rows, S32 inverse, F32 weights,
                       S32 offsets, ffi::RemainingArgs, F32Out out) {
  const int64_t n = Length(inverse);
  const int64_t d =
      rows.dimensions().size() == 2 ? rows.dimensions()[1] : -1;
  int64_t bags;
  if (ffi::Error e = CheckPooling(inverse, weights, offsets, *out, n, d, &bags);
      e.failure())
    return e;
  if (ffi::Error e = CheckMatrix(rows, n, d, "rows"); e.failure()) return e;
  return CudaError(
      bag_pool_fwd(rows.typed_data(), inverse.typed_data(),
                   weights.typed_data(), offsets.typed_data(), (int)n,
                   (int)bags, (int)d, out->typed_data(), stream),
      "bag_pool_fwd");
}

ffi::Error PoolBwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                       F32 dout, F32 rows, F32 weights,
                       S32 inverse, S32 bag_ids, S32 perm, S32 run_offsets,
                       S32 counts, ffi::RemainingArgs, F32Out d_rows,
                       F32Out d_weights) {
  const int64_t n = Length(inverse);
  const int64_t d =
      rows.dimensions().size() == 2 ? rows.dimensions()[1] : -1;
  const int64_t bags =
      dout.dimensions().size() == 2 ? dout.dimensions()[0] : -1;
  if (n < 1 || Length(weights) != n || Length(bag_ids) != n ||
      Length(perm) != n || Length(run_offsets) != n + 1 ||
      Length(counts) != 2 ||
      (Length(*d_weights) != n && Length(*d_weights) != 0))
    return ffi::Error::InvalidArgument(
        "need weights, inverse, bag_ids, perm [n], d_weights [n] or [0], "
        "run_offsets [n+1], counts [2]");
  if (ffi::Error e = CheckMatrix(rows, n, d, "rows"); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(dout, bags, d, "dout"); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(*d_rows, n, d, "d_rows"); e.failure())
    return e;
  void* ws;
  if (ffi::Error e = AllocateScratch(scratch, bag_pool_bwd_scratch_bytes((int)n, (int)d), &ws);
      e.failure())
    return e;
  return CudaError(
      bag_pool_bwd(dout.typed_data(), rows.typed_data(), weights.typed_data(),
                   inverse.typed_data(), bag_ids.typed_data(),
                   perm.typed_data(), run_offsets.typed_data(),
                   counts.typed_data(), (int)n, (int)bags, (int)d,
                   d_rows->typed_data(),
                   Length(*d_weights) == 0 ? nullptr : d_weights->typed_data(),
                   ws, stream),
      "bag_pool_bwd");
}

}  // namespace
}  // namespace flowtt

namespace ffi = xla::ffi;

// Context first (the stream XLA hands us, its scratch allocator), then the
// contract's operands and results (ffi/contract.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttRowsFwdCuda, flowtt::RowsFwdImpl,
    flowtt::BindRowsFwd(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttRowsBwdCuda, flowtt::RowsBwdImpl,
    flowtt::BindRowsBwd(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttBagFwdCuda, flowtt::BagFwdImpl,
    flowtt::BindBagFwd(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttPoolFwdCuda, flowtt::PoolFwdImpl,
                              flowtt::BindPoolFwd(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttPoolBwdCuda, flowtt::PoolBwdImpl,
    flowtt::BindPoolBwd(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()));
