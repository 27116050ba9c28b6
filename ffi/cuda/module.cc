// nanobind module `_flowtt_cuda`: registrations() hands the CUDA handlers
// (ffi/cuda/handlers.cc) to jax.ffi.register_ffi_target(platform="CUDA");
// scratch_bytes() reports the handlers' run-time scratch (for benchmarks; chunk_rows
// is flowtt_bag_fwd's attribute);
// unsupported_reason() / tb_unsupported_reason() say why the (table-batched) kernels cannot
// take a core shape (None if they can); tb_scratch_bytes() the table-batched rows ops' scratch,
// tb_plan_scratch_bytes() flowtt_tb_plan's.
#include <string>

#include "binding/registrations.h"
#include "cuda/handlers.h"
#include "cuda/tb_handlers.h"
#include "include/ops.h"
#include "include/plan.h"
#include "include/tb_plan.h"
#include "include/tb_rows.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

NB_MODULE(_flowtt_cuda, m) {
  namespace nb = nanobind;
  m.def("registrations", []() {
    // OpHandlers order: rows_fwd, rows_bwd, pool_fwd, pool_bwd, bag_fwd, plan, tb_rows_fwd,
    // tb_rows_bwd, tb_plan, tb_bags, tb_window
    return flowtt::Registrations({FlowttRowsFwdCuda, FlowttRowsBwdCuda, FlowttPoolFwdCuda,
                                  FlowttPoolBwdCuda, FlowttBagFwdCuda, FlowttPlanCuda,
                                  FlowttTbRowsFwdCuda, FlowttTbRowsBwdCuda, FlowttTbPlanCuda,
                                  FlowttTbBagsCuda, FlowttTbWindowCuda});
  });
  // CMake's CUDA_ARCHITECTURES the kernels were built for, comma-separated (e.g. "90")
  m.def("cuda_architectures", []() { return std::string(FLOWTT_CUDA_ARCHS); });
  m.def("unsupported_reason",
        [](int p1, int p2, int p3, int q1, int q2, int q3, int r1, int r2) -> nb::object {
          const char* why = flowtt::check_dims(flowtt::TTDims{p1, p2, p3, q1, q2, q3, r1, r2});
          return why == nullptr ? nb::none() : nb::cast(std::string(why));
        });
  m.def("tb_unsupported_reason",
        [](int p1, int p2, int p3, int q1, int q2, int q3, int r1, int r2) -> nb::object {
          const char* why = flowtt::tb::tb_check_dims({p1, p2, p3, q1, q2, q3, r1, r2});
          return why == nullptr ? nb::none() : nb::cast(std::string(why));
        });
  m.def("tb_scratch_bytes",
        [](int p1, int p2, int p3, int q1, int q2, int q3, int r1, int r2, int n) {
          const flowtt::tb::TbDims t{p1, p2, p3, q1, q2, q3, r1, r2};
          nb::dict d;
          d["tb_rows_fwd"] = flowtt::tb::tb_rows_fwd_scratch_bytes(t, n);
          d["tb_rows_bwd"] = flowtt::tb::tb_rows_bwd_scratch_bytes(t, n);
          return d;
        });
  m.def("tb_plan_scratch_bytes", [](int n, long long num_keys) -> nb::object {
    size_t bytes = 0;
    if (flowtt::tb::tb_plan_scratch_bytes(n, num_keys, &bytes) != cudaSuccess) return nb::none();
    return nb::cast(bytes);
  });
  m.def("scratch_bytes", [](int p1, int p2, int p3, int q1, int q2, int q3, int r1, int r2, int n,
                            long long chunk_rows) {
    flowtt::TTDims t{p1, p2, p3, q1, q2, q3, r1, r2};
    nb::dict d;
    d["rows_fwd"] = flowtt::rows_fwd_scratch_bytes(t, n);
    d["bag_fwd"] = flowtt::bag_fwd_scratch_bytes(t, n, chunk_rows);
    d["rows_bwd"] = flowtt::rows_bwd_scratch_bytes(t, n);
    d["pool_bwd"] = flowtt::bag_pool_bwd_scratch_bytes(n, t.D());
    size_t plan_bytes = 0;
    if (flowtt::plan_scratch_bytes(n, p1 * p2 * p3, false, &plan_bytes) == cudaSuccess)
      d["plan"] = plan_bytes;
    if (flowtt::plan_scratch_bytes(n, p1 * p2 * p3, true, &plan_bytes) == cudaSuccess)
      d["plan_fwd"] = plan_bytes;
    return d;
  });
}
