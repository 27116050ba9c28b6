// XLA FFI handler symbols (platform CUDA) of the ops of docs/op_contract.md, defined in
// ffi/cuda/handlers.cc, registered by the nanobind module in ffi/cuda/module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttRowsFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttRowsBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPoolFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPoolBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttBagFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPlanCuda);
