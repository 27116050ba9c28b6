// flowtt_plan for platform cpu (docs/op_contract.md, "The plan op"): the
// handler symbol, defined in ffi/cpu_plan.cc, registered by ffi/cpu_module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPlanCpu);
