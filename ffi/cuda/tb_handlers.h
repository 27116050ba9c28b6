// XLA FFI handler symbols (platform CUDA) of the table-batched ops
// (docs/batched_contract.md), defined in ffi/cuda/tb_handlers.cc. Registered by the CUDA
// module's registrations() as "flowtt_tb_rows_fwd" / "flowtt_tb_rows_bwd" / "flowtt_tb_plan" /
// "flowtt_tb_bags".
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbRowsFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbRowsBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbPlanCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbBagsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttTbWindowCuda);
