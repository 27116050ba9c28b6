// nanobind module `_flowtt_cuda`: registrations() hands the CUDA handlers'
// capsules (cuda/handlers.cu, cuda/plan_handler.cu) to
// jax.ffi.register_ffi_target(platform="CUDA");
// scratch_bytes() reports the handlers' run-time scratch (for benchmarks; chunk_rows
// is flowtt_bag_fwd's attribute);
// unsupported_reason() says why the kernels cannot take a core shape (None if they can).
#include <string>

#include "cuda/handlers.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "cuda/plan_handler.h"
#include "cuda/plan.h"
#include "cuda/ops.h"

NB_MODULE(_flowtt_cuda, m) {
  namespace nb = nanobind;
  m.def("registrations", []() {
    nb::dict d;
    d["flowtt_tt_rows_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttRowsFwdCuda));
    d["flowtt_tt_rows_bwd"] = nb::capsule(reinterpret_cast<void*>(FlowttRowsBwdCuda));
    d["flowtt_bag_pool_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttPoolFwdCuda));
    d["flowtt_bag_pool_bwd"] = nb::capsule(reinterpret_cast<void*>(FlowttPoolBwdCuda));
    d["flowtt_bag_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttBagFwdCuda));
    d["flowtt_plan"] = nb::capsule(reinterpret_cast<void*>(FlowttPlanCuda));
    return d;
  });
  m.def("unsupported_reason",
        [](int p1, int p2, int p3, int q1, int q2, int q3, int r1, int r2) -> nb::object {
          const char* why = flowtt::check_dims(flowtt::TTDims{p1, p2, p3, q1, q2, q3, r1, r2});
          return why == nullptr ? nb::none() : nb::cast(std::string(why));
        });
  m.def("scratch_bytes", [](int p1, int p2, int p3, int q1, int q2, int q3, int r1, int r2,
                            int n, long long chunk_rows) {
    flowtt::TTDims t{p1, p2, p3, q1, q2, q3, r1, r2};
    nb::dict d;
    d["rows_fwd"] = flowtt::rows_fwd_scratch_bytes(t, n);
    d["bag_fwd"] = flowtt::bag_fwd_scratch_bytes(t, n, chunk_rows);
    d["rows_bwd"] = flowtt::rows_bwd_scratch_bytes(t, n);
    d["pool_bwd"] = flowtt::bag_pool_bwd_scratch_bytes(n, t.D());
    size_t plan_bytes = 0;
    if (flowtt::plan_scratch_bytes(n, p1 * p2 * p3, &plan_bytes) == cudaSuccess)
      d["plan"] = plan_bytes;
    return d;
  });
}
