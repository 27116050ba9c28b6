// flowtt_tb_bags on the GPU (common/tb_bags.h, docs/batched_contract.md): launcher, no XLA
// dependency. The FFI handler is in cuda/tb_handlers.cc.
#pragma once

#include <cuda_runtime.h>

#include "common/tb_bags.h"

namespace flowtt::tb {

// Scratch bytes tb_bags needs (the first live position).
constexpr size_t kTbBagsScratchBytes = sizeof(unsigned);

// Every output of `out` for the checked operands `in` (TbCheckBags), as cpu::MakeTbBags
// writes them; queued on `stream`, `scratch` holds kTbBagsScratchBytes.
cudaError_t tb_bags(const TbBagsIn& in, const TbBagsOut& out, void* scratch, cudaStream_t stream);

}  // namespace flowtt::tb
