// XLA FFI handler symbols (platform cpu) of the table-batched ops
// (docs/batched_contract.md), defined in ffi/cpu/tb_handlers.cc. Registered by the cpu
// module's registrations() as "flowtt_tb_rows_fwd" / "flowtt_tb_rows_bwd" / "flowtt_tb_plan" /
// "flowtt_tb_bags".
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbRowsFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbRowsBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbPlanCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbBagsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbWindowCpu);
