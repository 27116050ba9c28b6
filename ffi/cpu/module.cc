// nanobind module `_flowtt_cpu`: registrations() hands the CPU handlers
// (ffi/cpu/handlers.cc) to jax.ffi.register_ffi_target(platform="cpu");
// plan_bitmap_applies(n, num_rows) says whether the forward-only plan of n ids takes the
// table's bitmap (both platforms' rule, cuda/contract/plan_bitmap.h).
#include "binding/registrations.h"
#include "contract/plan_bitmap.h"
#include "cpu/handlers.h"
#include "cpu/tb_handlers.h"
#include "nanobind/nanobind.h"

NB_MODULE(_flowtt_cpu, m) {
  m.def("registrations", []() {
    // OpHandlers order: rows_fwd, rows_bwd, pool_fwd, pool_bwd, bag_fwd, plan, tb_rows_fwd,
    // tb_rows_bwd, tb_plan, tb_bags, tb_window
    return flowtt::Registrations({FlowttRowsFwdCpu, FlowttRowsBwdCpu, FlowttPoolFwdCpu,
                                  FlowttPoolBwdCpu, FlowttBagFwdCpu, FlowttPlanCpu,
                                  FlowttTbRowsFwdCpu, FlowttTbRowsBwdCpu, FlowttTbPlanCpu,
                                  FlowttTbBagsCpu, FlowttTbWindowCpu});
  });
  m.def("plan_bitmap_applies",
        [](int64_t n, int64_t num_rows) { return flowtt::plan_bitmap::Applies(n, num_rows); });
}
