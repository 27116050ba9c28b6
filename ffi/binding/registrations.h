// registrations() of both nanobind modules, as in jax's examples/ffi: every target of
// the op contract mapped to its handler as a capsule, the form
// jax.ffi.register_ffi_target takes.
#pragma once

#include <type_traits>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/c_api.h"

namespace flowtt {

template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// One platform's handlers of the targets (ffi/cpu/handlers.h, ffi/cuda/handlers.h).
struct OpHandlers {
  XLA_FFI_Handler* rows_fwd;
  XLA_FFI_Handler* rows_bwd;
  XLA_FFI_Handler* pool_fwd;
  XLA_FFI_Handler* pool_bwd;
  XLA_FFI_Handler* bag_fwd;
  XLA_FFI_Handler* plan;
  XLA_FFI_Handler* tb_rows_fwd;  // table-batched rows ops (docs/batched_contract.md)
  XLA_FFI_Handler* tb_rows_bwd;
  XLA_FFI_Handler* tb_plan;
  XLA_FFI_Handler* tb_bags;
  XLA_FFI_Handler* tb_window;
};

// {target name: handler capsule}.
inline nanobind::dict Registrations(const OpHandlers& h) {
  nanobind::dict d;
  d["flowtt_tt_rows_fwd"] = EncapsulateFfiHandler(h.rows_fwd);
  d["flowtt_tt_rows_bwd"] = EncapsulateFfiHandler(h.rows_bwd);
  d["flowtt_bag_pool_fwd"] = EncapsulateFfiHandler(h.pool_fwd);
  d["flowtt_bag_pool_bwd"] = EncapsulateFfiHandler(h.pool_bwd);
  d["flowtt_bag_fwd"] = EncapsulateFfiHandler(h.bag_fwd);
  d["flowtt_plan"] = EncapsulateFfiHandler(h.plan);
  d["flowtt_tb_rows_fwd"] = EncapsulateFfiHandler(h.tb_rows_fwd);
  d["flowtt_tb_rows_bwd"] = EncapsulateFfiHandler(h.tb_rows_bwd);
  d["flowtt_tb_plan"] = EncapsulateFfiHandler(h.tb_plan);
  d["flowtt_tb_bags"] = EncapsulateFfiHandler(h.tb_bags);
  d["flowtt_tb_window"] = EncapsulateFfiHandler(h.tb_window);
  return d;
}

}  // namespace flowtt
