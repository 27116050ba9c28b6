// An XLA FFI handler as a nanobind capsule, the form jax.ffi.register_ffi_target takes
// (as in jax's examples/ffi); used by both modules' registrations().
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

}  // namespace flowtt
