// XLA FFI handler symbol of flowtt_plan (platform CUDA), defined in
// cuda/plan_handler.cu, registered by ffi/cuda_module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FlowttPlanCuda);
