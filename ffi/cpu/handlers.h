// XLA FFI handler symbols (platform cpu) of the ops of docs/op_contract.md, defined in
// ffi/cpu/handlers.cc, registered by the nanobind module in ffi/cpu/module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttRowsFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttRowsBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPoolFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPoolBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttBagFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPlanCpu);
