// XLA FFI handlers (platform cpu) for the op contract, and the nanobind module
// `_flowtt_cpu` whose registrations() hands their capsules to jax.ffi.
// Trailing operands past the contract's are ignored: tests alias each output to
// one of them, filled with NaN, to prove every output element is written.
#include <cstdint>
#include <string>

#include "common/op_contract.h"
#include "cpu/ops.h"
#include "cpu/handlers.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt {
namespace {

using F32 = F32Buffer;
using S32 = S32Buffer;
using F32Out = ffi::ResultBuffer<ffi::F32>;

ffi::Error FromMessage(const std::string& message) {
  return message.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(message);
}

// Reads core shapes and the group plan; fills `plan`.
ffi::Error Prepare(const F32& g1, const F32& g2, const F32& g3, const S32& unique_ids,
                   const S32& group_offsets, const S32& counts, CoreShape* s,
                   cpu::GroupPlan* plan) {
  if (ffi::Error e = ReadCoreShape(g1, g2, g3, s); e.failure()) return e;
  int64_t n;
  if (ffi::Error e = CheckGroupPlan(unique_ids, group_offsets, counts, &n); e.failure()) return e;
  *plan = {unique_ids.typed_data(), group_offsets.typed_data(), n, counts.typed_data()[0],
           counts.typed_data()[1]};
  return ffi::Error::Success();
}

ffi::Error RowsFwdImpl(F32 g1, F32 g2, F32 g3, S32 unique_ids, S32 group_offsets, S32 counts,
                       ffi::RemainingArgs, F32Out rows) {
  CoreShape s;
  cpu::GroupPlan plan;
  if (ffi::Error e = Prepare(g1, g2, g3, unique_ids, group_offsets, counts, &s, &plan);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckMatrix(*rows, plan.n, s.dim(), "rows"); e.failure()) return e;
  return FromMessage(cpu::RowsFwd(s, g1.typed_data(), g2.typed_data(), g3.typed_data(), plan,
                                  rows->typed_data()));
}

ffi::Error RowsBwdImpl(F32 g1, F32 g2, F32 g3, F32 d_rows, S32 unique_ids, S32 group_offsets,
                       S32 counts, ffi::RemainingArgs, F32Out dg1, F32Out dg2, F32Out dg3) {
  CoreShape s;
  cpu::GroupPlan plan;
  if (ffi::Error e = Prepare(g1, g2, g3, unique_ids, group_offsets, counts, &s, &plan);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckMatrix(d_rows, plan.n, s.dim(), "d_rows"); e.failure()) return e;
  if (dg1->element_count() != g1.element_count() || dg2->element_count() != g2.element_count() ||
      dg3->element_count() != g3.element_count()) {
    return ffi::Error::InvalidArgument("core gradients must have the cores' shapes");
  }
  return FromMessage(cpu::RowsBwd(s, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                                  d_rows.typed_data(), plan, dg1->typed_data(),
                                  dg2->typed_data(), dg3->typed_data()));
}

ffi::Error PoolFwdImpl(F32 rows, S32 inverse, F32 weights, S32 offsets, ffi::RemainingArgs,
                       F32Out out) {
  const int64_t n = Length(inverse);
  const int64_t d = rows.dimensions().size() == 2 ? rows.dimensions()[1] : -1;
  int64_t bags;
  if (ffi::Error e = CheckPooling(inverse, weights, offsets, *out, n, d, &bags); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckMatrix(rows, n, d, "rows"); e.failure()) return e;
  return FromMessage(cpu::PoolFwd(rows.typed_data(), n, d, inverse.typed_data(),
                                  weights.typed_data(), offsets.typed_data(), bags,
                                  out->typed_data()));
}

ffi::Error BagFwdImpl(F32 g1, F32 g2, F32 g3, S32 unique_ids, S32 group_offsets, S32 counts,
                      S32 inverse, F32 weights, S32 offsets, ffi::RemainingArgs, F32Out out,
                      int64_t chunk_rows) {
  CoreShape s;
  cpu::GroupPlan plan;
  if (ffi::Error e = Prepare(g1, g2, g3, unique_ids, group_offsets, counts, &s, &plan);
      e.failure()) {
    return e;
  }
  int64_t bags;
  if (ffi::Error e = CheckBagFwd(inverse, weights, offsets, *out, plan.n, s.dim(), chunk_rows,
                                 &bags);
      e.failure()) {
    return e;
  }
  return FromMessage(cpu::BagFwd(s, g1.typed_data(), g2.typed_data(), g3.typed_data(), plan,
                                 inverse.typed_data(), weights.typed_data(), offsets.typed_data(),
                                 bags, chunk_rows, out->typed_data()));
}

ffi::Error PoolBwdImpl(F32 dout, F32 rows, F32 weights, S32 inverse, S32 bag_ids, S32 perm,
                       S32 run_offsets, S32 counts, ffi::RemainingArgs, F32Out d_rows, F32Out d_weights) {
  const int64_t n = Length(inverse);
  const int64_t d = rows.dimensions().size() == 2 ? rows.dimensions()[1] : -1;
  const int64_t bags = dout.dimensions().size() == 2 ? dout.dimensions()[0] : -1;
  if (n < 1 || Length(weights) != n || Length(bag_ids) != n || Length(perm) != n ||
      Length(run_offsets) != n + 1 || Length(counts) != 2 ||
      (Length(*d_weights) != n && Length(*d_weights) != 0)) {
    return ffi::Error::InvalidArgument(
        "need weights, inverse, bag_ids, perm [n], d_weights [n] or [0], run_offsets [n+1], "
        "counts [2]");
  }
  if (ffi::Error e = CheckMatrix(rows, n, d, "rows"); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(dout, bags, d, "dout"); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(*d_rows, n, d, "d_rows"); e.failure()) return e;
  return FromMessage(cpu::PoolBwd(dout.typed_data(), bags, rows.typed_data(), n, d,
                                  weights.typed_data(), inverse.typed_data(),
                                  bag_ids.typed_data(), perm.typed_data(),
                                  run_offsets.typed_data(), counts.typed_data()[0],
                                  d_rows->typed_data(),
                                  Length(*d_weights) == 0 ? nullptr : d_weights->typed_data()));
}

}  // namespace
}  // namespace flowtt

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttRowsFwdCpu, flowtt::RowsFwdImpl,
                              flowtt::BindRowsFwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttRowsBwdCpu, flowtt::RowsBwdImpl,
                              flowtt::BindRowsBwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttPoolFwdCpu, flowtt::PoolFwdImpl,
                              flowtt::BindPoolFwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttBagFwdCpu, flowtt::BagFwdImpl,
                              flowtt::BindBagFwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlowttPoolBwdCpu, flowtt::PoolBwdImpl,
                              flowtt::BindPoolBwd(xla::ffi::Ffi::Bind()));

NB_MODULE(_flowtt_cpu, m) {
  m.def("registrations", []() {
    namespace nb = nanobind;
    nb::dict d;
    d["flowtt_tt_rows_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttRowsFwdCpu));
    d["flowtt_tt_rows_bwd"] = nb::capsule(reinterpret_cast<void*>(FlowttRowsBwdCpu));
    d["flowtt_bag_pool_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttPoolFwdCpu));
    d["flowtt_bag_pool_bwd"] = nb::capsule(reinterpret_cast<void*>(FlowttPoolBwdCpu));
    d["flowtt_bag_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttBagFwdCpu));
    d["flowtt_plan"] = nb::capsule(reinterpret_cast<void*>(FlowttPlanCpu));  // ffi/cpu_plan.cc
    return d;
  });
}
