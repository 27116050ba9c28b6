// XLA FFI handler of flowtt_plan (platform CUDA): checks shapes and attributes
// (ffi/contract.h), takes scratch from XLA's allocator and queues the plan
// (cuda/plan_kernels.cu) on the stream XLA hands us. Trailing operands are
// ignored (RemainingArgs): tests alias the outputs to poisoned buffers there.
#include "cuda/plan_handler.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/op_contract.h"
#include "cuda/handler_util.h"
#include "cuda/plan.h"

namespace flowtt {
namespace {

ffi::Error PlanImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, S32Buffer ids,
                    ffi::RemainingArgs, S32Out perm, S32Out inverse, S32Out unique_ids,
                    S32Out run_offsets, S32Out group_offsets, S32Out counts,
                    int64_t last_extent, int64_t num_rows) {
  if (ffi::Error e = CheckPlan(ids, *perm, *inverse, *unique_ids, *run_offsets, *group_offsets,
                               *counts, last_extent, num_rows);
      e.failure())
    return e;
  const int n = static_cast<int>(Length(ids));
  size_t bytes = 0;
  if (cudaError_t err = plan_scratch_bytes(n, static_cast<int>(num_rows), &bytes);
      err != cudaSuccess)
    return CudaError(err, "plan");
  void* ws = nullptr;  // build_plan realigns to 256 bytes
  if (bytes > 0) {
    if (ffi::Error e = AllocateScratch(scratch, bytes, &ws); e.failure()) return e;
  }
  const PlanOutputs out{perm->typed_data(),        inverse->typed_data(),
                        unique_ids->typed_data(),   run_offsets->typed_data(),
                        group_offsets->typed_data(), counts->typed_data()};
  return CudaError(build_plan(ids.typed_data(), n, static_cast<int>(last_extent),
                              static_cast<int>(num_rows), out, ws, stream),
                   "plan");
}

}  // namespace
}  // namespace flowtt

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttPlanCuda, flowtt::PlanImpl,
    flowtt::BindPlan(xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                         .Ctx<xla::ffi::ScratchAllocator>()));
