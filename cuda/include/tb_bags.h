// flowtt_tb_bags on the GPU (cuda/contract/tb_bags.h, docs/batched_contract.md): launcher, no XLA
// dependency. The FFI handler is in ffi/cuda/tb_handlers.cc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "contract/tb_bags.h"

namespace flowtt::tb {

// Scratch bytes tb_bags needs for n positions in num_bags bags (the first live position,
// the bounds of each span of positions, the scan's storage; any base alignment).
cudaError_t tb_bags_scratch_bytes(int64_t n, int64_t num_bags, size_t* bytes);

// Every output of `out` for the checked operands `in` (TbCheckBags), as cpu::MakeTbBags
// writes them; queued on `stream`, `scratch` holds tb_bags_scratch_bytes(in.n, in.num_bags).
cudaError_t tb_bags(const TbBagsIn& in, const TbBagsOut& out, void* scratch, cudaStream_t stream);

}  // namespace flowtt::tb
