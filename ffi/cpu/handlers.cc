// XLA FFI handlers (platform cpu) for the op contract (docs/op_contract.md): the
// contract's checks (ffi/binding/op_contract.h), then the CPU kernels (ffi/cpu/ops.h,
// ffi/cpu/plan.h), which also check the plan's contents.
// Trailing operands past the contract's are ignored: tests alias each output to
// one of them, filled with NaN, to prove every output element is written.
#include "cpu/handlers.h"

#include <cstdint>
#include <string>

#include "binding/op_contract.h"
#include "binding/op_ffi.h"
#include "cpu/ops.h"
#include "cpu/plan.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt {
namespace {

using F32 = F32Buffer;
using S32 = S32Buffer;
using F32Out = ffi::ResultBuffer<ffi::F32>;

ffi::Error FromMessage(const std::string& message) {
  return message.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(message);
}

cpu::GroupPlan MakeGroupPlan(const S32& unique_ids, const S32& group_offsets, const S32& counts,
                             int64_t n) {
  return {unique_ids.typed_data(), group_offsets.typed_data(), n, counts.typed_data()[0],
          counts.typed_data()[1]};
}

ffi::Error RowsFwdImpl(F32 g1, F32 g2, F32 g3, S32 unique_ids, S32 group_offsets, S32 counts,
                       ffi::RemainingArgs, F32Out rows) {
  CoreShape s;
  int64_t n;
  if (ffi::Error e = CheckRowsFwd(g1, g2, g3, unique_ids, group_offsets, counts, *rows, &s, &n);
      e.failure()) {
    return e;
  }
  return FromMessage(cpu::RowsFwd(s, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                                  MakeGroupPlan(unique_ids, group_offsets, counts, n),
                                  rows->typed_data()));
}

ffi::Error RowsBwdImpl(F32 g1, F32 g2, F32 g3, F32 d_rows, S32 unique_ids, S32 group_offsets,
                       S32 counts, ffi::RemainingArgs, F32Out dg1, F32Out dg2, F32Out dg3) {
  CoreShape s;
  int64_t n;
  if (ffi::Error e = CheckRowsBwd(g1, g2, g3, d_rows, unique_ids, group_offsets, counts, *dg1, *dg2,
                                  *dg3, &s, &n);
      e.failure()) {
    return e;
  }
  return FromMessage(cpu::RowsBwd(s, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                                  d_rows.typed_data(),
                                  MakeGroupPlan(unique_ids, group_offsets, counts, n),
                                  dg1->typed_data(), dg2->typed_data(), dg3->typed_data()));
}

ffi::Error PoolFwdImpl(F32 rows, S32 inverse, F32 weights, S32 offsets, S32 counts, F32 prev,
                       ffi::RemainingArgs, F32Out out, int64_t batch, int64_t lo) {
  int64_t n, d, bags, m;
  if (ffi::Error e = CheckPoolFwd(rows, inverse, weights, offsets, counts, prev, *out, batch, lo,
                                  &n, &d, &bags, &m);
      e.failure()) {
    return e;
  }
  return FromMessage(cpu::PoolFwd(rows.typed_data(), n, d, inverse.typed_data(),
                                  weights.typed_data(), offsets.typed_data(), bags, batch,
                                  cpu::Window{lo, m, Length(counts) == 0 ? -1 : counts.typed_data()[0]},
                                  prev.element_count() == 0 ? nullptr : prev.typed_data(),
                                  out->typed_data()));
}

ffi::Error BagFwdImpl(F32 g1, F32 g2, F32 g3, S32 unique_ids, S32 group_offsets, S32 counts,
                      S32 inverse, F32 weights, S32 offsets, ffi::RemainingArgs, F32Out out,
                      int64_t chunk_rows) {
  CoreShape s;
  int64_t n, bags;
  if (ffi::Error e = CheckBagFwd(g1, g2, g3, unique_ids, group_offsets, counts, inverse, weights,
                                 offsets, *out, chunk_rows, &s, &n, &bags);
      e.failure()) {
    return e;
  }
  return FromMessage(cpu::BagFwd(s, g1.typed_data(), g2.typed_data(), g3.typed_data(),
                                 MakeGroupPlan(unique_ids, group_offsets, counts, n),
                                 inverse.typed_data(), weights.typed_data(), offsets.typed_data(),
                                 bags, chunk_rows, out->typed_data()));
}

ffi::Error PoolBwdImpl(F32 dout, F32 rows, F32 weights, S32 inverse, S32 bag_ids, S32 perm,
                       S32 run_offsets, S32 counts, ffi::RemainingArgs, F32Out d_rows,
                       F32Out d_weights, int64_t lo) {
  int64_t n, d, bags, m;
  if (ffi::Error e = CheckPoolBwd(dout, rows, weights, inverse, bag_ids, perm, run_offsets, counts,
                                  *d_rows, *d_weights, lo, &n, &d, &bags, &m);
      e.failure()) {
    return e;
  }
  return FromMessage(cpu::PoolBwd(
      dout.typed_data(), bags, rows.typed_data(), n, d, weights.typed_data(), inverse.typed_data(),
      bag_ids.typed_data(), perm.typed_data(), run_offsets.typed_data(), counts.typed_data()[0],
      cpu::Window{lo, m, counts.typed_data()[0]}, d_rows->typed_data(),
      Length(*d_weights) == 0 ? nullptr : d_weights->typed_data()));
}

ffi::Error PlanImpl(S32 ids, ffi::RemainingArgs, S32Out perm, S32Out inverse, S32Out unique_ids,
                    S32Out run_offsets, S32Out group_offsets, S32Out counts, int64_t last_extent,
                    int64_t num_rows) {
  if (ffi::Error e = CheckPlan(ids, *perm, *inverse, *unique_ids, *run_offsets, *group_offsets,
                               *counts, last_extent, num_rows);
      e.failure()) {
    return e;
  }
  if (ForwardOnly(*perm, *run_offsets)) {
    cpu::MakeForwardPlan(ids.typed_data(), Length(ids), last_extent, num_rows,
                         inverse->typed_data(), unique_ids->typed_data(),
                         group_offsets->typed_data(), counts->typed_data());
  } else {
    cpu::MakePlan(ids.typed_data(), Length(ids), last_extent, num_rows, perm->typed_data(),
                  inverse->typed_data(), unique_ids->typed_data(), run_offsets->typed_data(),
                  group_offsets->typed_data(), counts->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace flowtt

// One handler symbol per op: FlowttOpCpu runs flowtt::OpImpl with the contract's binding.
#define FLOWTT_CPU_HANDLER(Op)                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Flowtt##Op##Cpu, flowtt::Op##Impl, \
                                flowtt::Bind##Op(xla::ffi::Ffi::Bind()))

FLOWTT_CPU_HANDLER(RowsFwd);
FLOWTT_CPU_HANDLER(RowsBwd);
FLOWTT_CPU_HANDLER(PoolFwd);
FLOWTT_CPU_HANDLER(BagFwd);
FLOWTT_CPU_HANDLER(PoolBwd);
FLOWTT_CPU_HANDLER(Plan);
