// XLA FFI handlers (platform cpu) of the table-batched ops: shape checks
// (cuda/contract/tb_contract.h), then the plain C++ implementations (ffi/cpu/tb_rows.h, which
// checks the plan's values; ffi/cpu/tb_plan.h). Trailing operands are ignored
// (ffi/binding/tb_ffi.h).
#include "cpu/tb_handlers.h"

#include <cstdint>

#include "binding/tb_ffi.h"
#include "contract/tb_contract.h"
#include "cpu/tb_bags.h"
#include "cpu/tb_plan.h"
#include "cpu/tb_rows.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt::tb {
namespace {

cpu::TbPlan MakePlan(const TbS32& u_i3, const TbS32& g_i1, const TbS32& g_i2,
                     const TbS32& group_offsets, const TbS32& counts, int64_t n) {
  return {u_i3.typed_data(),
          g_i1.typed_data(),
          g_i2.typed_data(),
          group_offsets.typed_data(),
          n,
          counts.typed_data()[0],
          counts.typed_data()[1]};
}

ffi::Error TbRowsFwdCpuImpl(TbF32 g1, TbF32 g2, TbF32 g3, TbS32 u_i3, TbS32 g_i1, TbS32 g_i2,
                            TbS32 group_offsets, TbS32 counts, ffi::RemainingArgs, TbF32Out rows) {
  ffi::ErrorOr<TbChecked> c =
      TbCheckFwdBuffers(g1, g2, g3, u_i3, g_i1, g_i2, group_offsets, counts, *rows);
  if (c.has_error()) return c.error();
  return TbError(cpu::TbRowsFwd(c->s, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                                MakePlan(u_i3, g_i1, g_i2, group_offsets, counts, c->n),
                                rows->typed_data()));
}

ffi::Error TbRowsBwdCpuImpl(TbF32 g1, TbF32 g2, TbF32 g3, TbF32 d_rows, TbS32 u_i3, TbS32 g_i1,
                            TbS32 g_i2, TbS32 group_offsets, TbS32 counts, ffi::RemainingArgs,
                            TbF32Out dg1, TbF32Out dg2, TbF32Out dg3) {
  ffi::ErrorOr<TbChecked> c = TbCheckBwdBuffers(g1, g2, g3, d_rows, u_i3, g_i1, g_i2, group_offsets,
                                                counts, *dg1, *dg2, *dg3);
  if (c.has_error()) return c.error();
  return TbError(cpu::TbRowsBwd(c->s, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                                d_rows.typed_data(),
                                MakePlan(u_i3, g_i1, g_i2, group_offsets, counts, c->n),
                                dg1->typed_data(), dg2->typed_data(), dg3->typed_data()));
}

ffi::Error TbPlanCpuImpl(TbS32 ids, TbS32 tables, TbS32 meta, ffi::RemainingArgs, TbS32Out perm,
                         TbS32Out inverse, TbS32Out run_offsets, TbS32Out group_offsets,
                         TbS32Out u_i3, TbS32Out g_i1, TbS32Out g_i2, TbS32Out counts,
                         int64_t extent, bool row_keys, int64_t num_keys) {
  ffi::ErrorOr<TbPlanChecked> c =
      TbCheckPlanOpBuffers(ids, tables, meta, *perm, *inverse, *run_offsets, *group_offsets, *u_i3,
                           *g_i1, *g_i2, *counts, extent, row_keys, num_keys);
  if (c.has_error()) return c.error();
  flowtt::cpu::MakeTbPlan(ids.typed_data(), tables.typed_data(), c->n, c->form, num_keys, c->out);
  return ffi::Error::Success();
}

ffi::Error TbBagsCpuImpl(TbS32 ids, TbS32 offsets, TbS32 feature_tables, TbS32 num_rows, TbS32 ends,
                         ffi::RemainingArgs, TbS32Out ids_out, TbS32Out tables, TbF32Out live,
                         TbS32Out bag_ids, TbS32Out offsets_out, int64_t batch, bool clip) {
  ffi::ErrorOr<TbBagsChecked> c =
      TbCheckBagsBuffers(ids, offsets, feature_tables, num_rows, ends, ids_out, tables, live,
                         bag_ids, offsets_out, batch, clip);
  if (c.has_error()) return c.error();
  flowtt::cpu::MakeTbBags(c->in, c->out);
  return ffi::Error::Success();
}

ffi::Error TbWindowCpuImpl(TbS32 group_offsets, TbS32 u_i3, TbS32 g_i1, TbS32 g_i2, TbS32 counts,
                           ffi::RemainingArgs, TbS32Out w_group_offsets, TbS32Out w_u_i3,
                           TbS32Out w_g_i1, TbS32Out w_g_i2, TbS32Out w_counts, int64_t lo) {
  ffi::ErrorOr<TbWindowChecked> c = TbCheckWindowBuffers(
      group_offsets, u_i3, g_i1, g_i2, counts, w_group_offsets, w_u_i3, w_g_i1, w_g_i2, w_counts, lo);
  if (c.has_error()) return c.error();
  const TbWindowHead h = TbWindowHeadOf(c->in);
  for (int64_t i = 0; i <= c->in.size; ++i) TbWindowWrite(c->in, h, i, c->out);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace flowtt::tb

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttTbRowsFwdCpu, flowtt::tb::TbRowsFwdCpuImpl,
                              flowtt::tb::TbBindRowsFwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttTbRowsBwdCpu, flowtt::tb::TbRowsBwdCpuImpl,
                              flowtt::tb::TbBindRowsBwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttTbPlanCpu, flowtt::tb::TbPlanCpuImpl,
                              flowtt::tb::TbBindPlan(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttTbBagsCpu, flowtt::tb::TbBagsCpuImpl,
                              flowtt::tb::TbBindBags(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttTbWindowCpu, flowtt::tb::TbWindowCpuImpl,
                              flowtt::tb::TbBindWindow(xla::ffi::Ffi::Bind()));
