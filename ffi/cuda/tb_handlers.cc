// XLA FFI handlers (platform CUDA) of the table-batched rows ops: shape checks
// (cuda/contract/tb_contract.h), the kernels' dims check (tb_check_dims), scratch from XLA's
// allocator, then the launchers (cuda/include/tb_rows.h) on XLA's stream; no synchronisation.
// Trailing operands are ignored (ffi/binding/tb_ffi.h).
#include "cuda/tb_handlers.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "binding/tb_ffi.h"
#include "contract/tb_contract.h"
#include "cuda/ffi_status.h"
#include "include/tb_bags.h"
#include "include/tb_plan.h"
#include "include/tb_rows.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt::tb {
namespace {

// TbDims of checked shapes (every extent >= 1, P < 2^31) the kernels take, else an error.
ffi::Error TbKernelDims(const TbShape& s, TbDims* t) {
  for (int64_t v : {s.q1, s.q2, s.q3, s.r1, s.r2}) {
    if (v > 1024) return ffi::Error::InvalidArgument("flowtt_tb CUDA: core extents too large");
  }
  *t = {(int)s.p1, (int)s.p2, (int)s.p3, (int)s.q1, (int)s.q2, (int)s.q3, (int)s.r1, (int)s.r2};
  if (const char* why = tb_check_dims(*t)) return ffi::Error::InvalidArgument(why);
  return ffi::Error::Success();
}

// PrepareLaunch after the table-batched shape checks (their error first).
ffi::ErrorOr<Launch<TbDims>> TbPrepareLaunch(const ffi::ErrorOr<TbChecked>& c,
                                             size_t (*bytes)(const TbDims&, int),
                                             ffi::ScratchAllocator& scratch) {
  if (c.has_error()) return ffi::Unexpected<ffi::Error>(c.error());
  const TbShape& s = c->s;
  return PrepareLaunch<TbDims>(
      ffi::Error::Success(), c->n, [&s](TbDims* t) { return TbKernelDims(s, t); }, bytes, scratch);
}

ffi::Error TbRowsFwdCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, TbF32 g1, TbF32 g2,
                             TbF32 g3, TbS32 u_i3, TbS32 g_i1, TbS32 g_i2, TbS32 group_offsets,
                             TbS32 counts, ffi::RemainingArgs, TbF32Out rows) {
  const ffi::ErrorOr<Launch<TbDims>> l =
      TbPrepareLaunch(TbCheckFwdBuffers(g1, g2, g3, u_i3, g_i1, g_i2, group_offsets, counts, *rows),
                      tb_rows_fwd_scratch_bytes, scratch);
  if (l.has_error()) return l.error();
  return CudaError(
      tb_rows_fwd(l->t, g1.typed_data(), g2.typed_data(), g3.typed_data(), u_i3.typed_data(),
                  g_i1.typed_data(), g_i2.typed_data(), group_offsets.typed_data(),
                  counts.typed_data(), l->n, rows->typed_data(), l->ws, stream),
      "tb_rows_fwd");
}

ffi::Error TbRowsBwdCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, TbF32 g1, TbF32 g2,
                             TbF32 g3, TbF32 d_rows, TbS32 u_i3, TbS32 g_i1, TbS32 g_i2,
                             TbS32 group_offsets, TbS32 counts, ffi::RemainingArgs, TbF32Out dg1,
                             TbF32Out dg2, TbF32Out dg3) {
  const ffi::ErrorOr<Launch<TbDims>> l =
      TbPrepareLaunch(TbCheckBwdBuffers(g1, g2, g3, d_rows, u_i3, g_i1, g_i2, group_offsets, counts,
                                        *dg1, *dg2, *dg3),
                      tb_rows_bwd_scratch_bytes, scratch);
  if (l.has_error()) return l.error();
  return CudaError(
      tb_rows_bwd(l->t, g1.typed_data(), g2.typed_data(), g3.typed_data(), d_rows.typed_data(),
                  u_i3.typed_data(), g_i1.typed_data(), g_i2.typed_data(),
                  group_offsets.typed_data(), counts.typed_data(), l->n, dg1->typed_data(),
                  dg2->typed_data(), dg3->typed_data(), l->ws, stream),
      "tb_rows_bwd");
}

ffi::Error TbPlanCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, TbS32 ids,
                          TbS32 tables, TbS32 meta, ffi::RemainingArgs, TbS32Out perm,
                          TbS32Out inverse, TbS32Out run_offsets, TbS32Out group_offsets,
                          TbS32Out u_i3, TbS32Out g_i1, TbS32Out g_i2, TbS32Out counts,
                          int64_t extent, bool row_keys, int64_t num_keys) {
  ffi::ErrorOr<TbPlanChecked> c =
      TbCheckPlanOpBuffers(ids, tables, meta, *perm, *inverse, *run_offsets, *group_offsets, *u_i3,
                           *g_i1, *g_i2, *counts, extent, row_keys, num_keys);
  if (c.has_error()) return c.error();
  const int n = static_cast<int>(c->n);
  size_t bytes = 0;
  if (cudaError_t err = tb_plan_scratch_bytes(n, num_keys, &bytes); err != cudaSuccess)
    return CudaError(err, "tb_plan");
  void* ws;
  if (ffi::Error e = AllocatePlanScratch(scratch, bytes, &ws); e.failure()) return e;
  return CudaError(build_tb_plan(ids.typed_data(), tables.typed_data(), n, c->form, num_keys,
                                 c->out, ws, stream),
                   "tb_plan");
}

ffi::Error TbBagsCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, TbS32 ids,
                          TbS32 offsets, TbS32 feature_tables, TbS32 num_rows, TbS32 ends,
                          ffi::RemainingArgs, TbS32Out ids_out, TbS32Out tables, TbF32Out live,
                          TbS32Out bag_ids, TbS32Out offsets_out, int64_t batch, bool clip) {
  ffi::ErrorOr<TbBagsChecked> c =
      TbCheckBagsBuffers(ids, offsets, feature_tables, num_rows, ends, ids_out, tables, live,
                         bag_ids, offsets_out, batch, clip);
  if (c.has_error()) return c.error();
  size_t bytes = 0;
  if (cudaError_t err = tb_bags_scratch_bytes(c->in.n, c->in.num_bags, &bytes); err != cudaSuccess)
    return CudaError(err, "tb_bags");
  void* ws;
  if (ffi::Error e = AllocateScratch(scratch, bytes, &ws); e.failure()) return e;
  return CudaError(tb_bags(c->in, c->out, ws, stream), "tb_bags");
}

ffi::Error TbWindowCudaImpl(cudaStream_t stream, TbS32 group_offsets, TbS32 u_i3, TbS32 g_i1,
                            TbS32 g_i2, TbS32 counts, ffi::RemainingArgs, TbS32Out w_group_offsets,
                            TbS32Out w_u_i3, TbS32Out w_g_i1, TbS32Out w_g_i2, TbS32Out w_counts,
                            int64_t lo) {
  ffi::ErrorOr<TbWindowChecked> c = TbCheckWindowBuffers(
      group_offsets, u_i3, g_i1, g_i2, counts, w_group_offsets, w_u_i3, w_g_i1, w_g_i2, w_counts, lo);
  if (c.has_error()) return c.error();
  return CudaError(tb_window(c->in, c->out, stream), "tb_window");
}

}  // namespace
}  // namespace flowtt::tb

// Context first (XLA's stream and scratch allocator), then the contract's operands.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttTbRowsFwdCuda, flowtt::tb::TbRowsFwdCudaImpl,
    flowtt::tb::TbBindRowsFwd(xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttTbRowsBwdCuda, flowtt::tb::TbRowsBwdCudaImpl,
    flowtt::tb::TbBindRowsBwd(xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttTbPlanCuda, flowtt::tb::TbPlanCudaImpl,
    flowtt::tb::TbBindPlan(xla::ffi::Ffi::Bind()
                               .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                               .Ctx<xla::ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttTbBagsCuda, flowtt::tb::TbBagsCudaImpl,
    flowtt::tb::TbBindBags(xla::ffi::Ffi::Bind()
                               .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                               .Ctx<xla::ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlowttTbWindowCuda, flowtt::tb::TbWindowCudaImpl,
    flowtt::tb::TbBindWindow(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
