// nanobind module `_flowtt_cuda`: registrations() hands the CUDA handlers'
// capsules (cuda/handlers.cu) to jax.ffi.register_ffi_target(platform="CUDA").
#include "handlers.h"
#include "nanobind/nanobind.h"

NB_MODULE(_flowtt_cuda, m) {
  m.def("registrations", []() {
    namespace nb = nanobind;
    nb::dict d;
    d["flowtt_tt_rows_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttRowsFwdCuda));
    d["flowtt_tt_rows_bwd"] = nb::capsule(reinterpret_cast<void*>(FlowttRowsBwdCuda));
    d["flowtt_bag_pool_fwd"] = nb::capsule(reinterpret_cast<void*>(FlowttPoolFwdCuda));
    d["flowtt_bag_pool_bwd"] = nb::capsule(reinterpret_cast<void*>(FlowttPoolBwdCuda));
    return d;
  });
}
