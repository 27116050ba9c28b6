// XLA FFI handlers (platform CUDA) for the op contract (docs/op_contract.md): the
// contract's checks (ffi/binding/op_contract.h), the CUDA kernels' own limits
// (check_dims), then the launchers (cuda/include/ops.h, cuda/include/plan.h).
// Every launch goes on the stream XLA hands us; scratch comes from XLA's
// scratch allocator; no device synchronisation, no cudaMalloc.
// Trailing operands past the contract's are ignored (RemainingArgs): tests
// alias each output to one of them, filled with NaN, to prove every output
// element is written.
#include "cuda/handlers.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "binding/op_contract.h"
#include "binding/op_ffi.h"
#include "cuda/ffi_status.h"
#include "include/ops.h"
#include "include/plan.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt {
namespace {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using F32Out = ffi::ResultBuffer<ffi::F32>;

// The CUDA kernels' limits past the contract: n < 2^30 and the core shapes they take.
ffi::Error CheckKernelLimits(const CoreShape& s, int64_t n, TTDims* t) {
  if (n >= (int64_t{1} << 31) / 2) return ffi::Error::InvalidArgument("flowtt CUDA: n too large");
  *t = TTDims{(int)s.p1, (int)s.p2, (int)s.p3, (int)s.q1,
              (int)s.q2, (int)s.q3, (int)s.r1, (int)s.r2};
  if (const char* msg = check_dims(*t)) return ffi::Error::InvalidArgument(msg);
  return ffi::Error::Success();
}

// CheckKernelLimits as PrepareLaunch's dims step.
auto KernelDims(const CoreShape& s, int64_t n) {
  return [&s, n](TTDims* t) { return CheckKernelLimits(s, n, t); };
}

ffi::Error RowsFwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, F32 g1, F32 g2, F32 g3,
                       S32 unique_ids, S32 group_offsets, S32 counts, ffi::RemainingArgs,
                       F32Out rows) {
  CoreShape s{};
  int64_t n = 0;
  const ffi::Error checked =
      CheckRowsFwd(g1, g2, g3, unique_ids, group_offsets, counts, *rows, &s, &n);
  const auto l =
      PrepareLaunch<TTDims>(checked, n, KernelDims(s, n), rows_fwd_scratch_bytes, scratch);
  if (l.has_error()) return l.error();
  return CudaError(rows_fwd(l->t, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                            unique_ids.typed_data(), group_offsets.typed_data(),
                            counts.typed_data(), l->n, rows->typed_data(), l->ws, stream),
                   "rows_fwd");
}

ffi::Error RowsBwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, F32 g1, F32 g2, F32 g3,
                       F32 d_rows, S32 unique_ids, S32 group_offsets, S32 counts,
                       ffi::RemainingArgs, F32Out dg1, F32Out dg2, F32Out dg3) {
  CoreShape s{};
  int64_t n = 0;
  const ffi::Error checked =
      CheckRowsBwd(g1, g2, g3, d_rows, unique_ids, group_offsets, counts, *dg1, *dg2, *dg3, &s, &n);
  const auto l =
      PrepareLaunch<TTDims>(checked, n, KernelDims(s, n), rows_bwd_scratch_bytes, scratch);
  if (l.has_error()) return l.error();
  return CudaError(
      rows_bwd(l->t, g1.typed_data(), g2.typed_data(), g3.typed_data(), d_rows.typed_data(),
               unique_ids.typed_data(), group_offsets.typed_data(), counts.typed_data(), l->n,
               dg1->typed_data(), dg2->typed_data(), dg3->typed_data(), l->ws, stream),
      "rows_bwd");
}

ffi::Error BagFwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, F32 g1, F32 g2, F32 g3,
                      S32 unique_ids, S32 group_offsets, S32 counts, S32 inverse, F32 weights,
                      S32 offsets, ffi::RemainingArgs, F32Out out, int64_t chunk_rows) {
  CoreShape s{};
  int64_t n = 0, bags = 0;
  const ffi::Error checked = CheckBagFwd(g1, g2, g3, unique_ids, group_offsets, counts, inverse,
                                         weights, offsets, *out, chunk_rows, &s, &n, &bags);
  const auto l = PrepareLaunch<TTDims>(
      checked, n, KernelDims(s, n),
      [&](const TTDims& t, int rows_n) { return bag_fwd_scratch_bytes(t, rows_n, chunk_rows); },
      scratch);
  if (l.has_error()) return l.error();
  return CudaError(bag_fwd(l->t, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                           unique_ids.typed_data(), group_offsets.typed_data(), counts.typed_data(),
                           inverse.typed_data(), weights.typed_data(), offsets.typed_data(), l->n,
                           (int)bags, chunk_rows, out->typed_data(), l->ws, stream),
                   "bag_fwd");
}

ffi::Error PoolFwdImpl(cudaStream_t stream, F32 rows, S32 inverse, F32 weights, S32 offsets,
                       S32 counts, F32 prev, ffi::RemainingArgs, F32Out out, int64_t batch,
                       int64_t lo) {
  int64_t n, d, bags, m;
  if (ffi::Error e = CheckPoolFwd(rows, inverse, weights, offsets, counts, prev, *out, batch, lo,
                                  &n, &d, &bags, &m);
      e.failure())
    return e;
  return CudaError(bag_pool_fwd(rows.typed_data(), inverse.typed_data(), weights.typed_data(),
                                offsets.typed_data(), (int)n, (int)bags, (int)d, (int)batch,
                                PoolWindow{(int)lo, (int)m},
                                Length(counts) == 0 ? nullptr : counts.typed_data(),
                                prev.element_count() == 0 ? nullptr : prev.typed_data(),
                                out->typed_data(), stream),
                   "bag_pool_fwd");
}

ffi::Error PoolBwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, F32 dout, F32 rows,
                       F32 weights, S32 inverse, S32 bag_ids, S32 perm, S32 run_offsets, S32 counts,
                       ffi::RemainingArgs, F32Out d_rows, F32Out d_weights, int64_t lo) {
  int64_t n, d, bags, m;
  if (ffi::Error e = CheckPoolBwd(dout, rows, weights, inverse, bag_ids, perm, run_offsets, counts,
                                  *d_rows, *d_weights, lo, &n, &d, &bags, &m);
      e.failure())
    return e;
  void* ws;
  if (ffi::Error e = AllocateScratch(scratch, bag_pool_bwd_scratch_bytes((int)n, (int)d), &ws);
      e.failure())
    return e;
  return CudaError(
      bag_pool_bwd(dout.typed_data(), rows.typed_data(), weights.typed_data(), inverse.typed_data(),
                   bag_ids.typed_data(), perm.typed_data(), run_offsets.typed_data(),
                   counts.typed_data(), (int)n, (int)bags, (int)d, PoolWindow{(int)lo, (int)m},
                   d_rows->typed_data(),
                   Length(*d_weights) == 0 ? nullptr : d_weights->typed_data(), ws, stream),
      "bag_pool_bwd");
}

ffi::Error PlanImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, S32 ids, ffi::RemainingArgs,
                    S32Out perm, S32Out inverse, S32Out unique_ids, S32Out run_offsets,
                    S32Out group_offsets, S32Out counts, int64_t last_extent, int64_t num_rows) {
  if (ffi::Error e = CheckPlan(ids, *perm, *inverse, *unique_ids, *run_offsets, *group_offsets,
                               *counts, last_extent, num_rows);
      e.failure())
    return e;
  const int n = static_cast<int>(Length(ids));
  const bool forward_only = ForwardOnly(*perm, *run_offsets);
  size_t bytes = 0;
  if (cudaError_t err = plan_scratch_bytes(n, static_cast<int>(num_rows), forward_only, &bytes);
      err != cudaSuccess)
    return CudaError(err, "plan");
  void* ws;
  if (ffi::Error e = AllocatePlanScratch(scratch, bytes, &ws); e.failure()) return e;
  const PlanOutputs out{forward_only ? nullptr : perm->typed_data(),
                        inverse->typed_data(),
                        unique_ids->typed_data(),
                        forward_only ? nullptr : run_offsets->typed_data(),
                        group_offsets->typed_data(),
                        counts->typed_data()};
  return CudaError(build_plan(ids.typed_data(), n, static_cast<int>(last_extent),
                              static_cast<int>(num_rows), out, ws, stream),
                   "plan");
}

// Context first (the stream XLA hands us, its scratch allocator), then the
// contract's operands and results (ffi/binding/op_ffi.h).
auto WithStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
auto WithStreamAndScratch() { return WithStream().Ctx<ffi::ScratchAllocator>(); }

}  // namespace
}  // namespace flowtt

// One handler symbol per op: FlowttOpCuda runs flowtt::OpImpl with the contract's binding
// behind the context it needs (the stream, and the scratch allocator where it takes one).
#define FLOWTT_CUDA_HANDLER(Op, Context)                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Flowtt##Op##Cuda, flowtt::Op##Impl, \
                                flowtt::Bind##Op(flowtt::Context()))

FLOWTT_CUDA_HANDLER(RowsFwd, WithStreamAndScratch);
FLOWTT_CUDA_HANDLER(RowsBwd, WithStreamAndScratch);
FLOWTT_CUDA_HANDLER(BagFwd, WithStreamAndScratch);
FLOWTT_CUDA_HANDLER(PoolFwd, WithStream);
FLOWTT_CUDA_HANDLER(PoolBwd, WithStreamAndScratch);
FLOWTT_CUDA_HANDLER(Plan, WithStreamAndScratch);
