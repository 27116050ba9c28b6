// nanobind module `_flowtt_cpu`: registrations() hands the CPU handlers
// (cpu/handlers.cc) to jax.ffi.register_ffi_target(platform="cpu").
#include "common/ffi_capsule.h"
#include "cpu/handlers.h"
#include "nanobind/nanobind.h"

NB_MODULE(_flowtt_cpu, m) {
  m.def("registrations", []() {
    using flowtt::EncapsulateFfiHandler;
    nanobind::dict d;
    d["flowtt_tt_rows_fwd"] = EncapsulateFfiHandler(FlowttRowsFwdCpu);
    d["flowtt_tt_rows_bwd"] = EncapsulateFfiHandler(FlowttRowsBwdCpu);
    d["flowtt_bag_pool_fwd"] = EncapsulateFfiHandler(FlowttPoolFwdCpu);
    d["flowtt_bag_pool_bwd"] = EncapsulateFfiHandler(FlowttPoolBwdCpu);
    d["flowtt_bag_fwd"] = EncapsulateFfiHandler(FlowttBagFwdCpu);
    d["flowtt_plan"] = EncapsulateFfiHandler(FlowttPlanCpu);
    return d;
  });
}
