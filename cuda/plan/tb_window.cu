// The window of a shape group's plan (flowtt_tb_window): one kernel over the window's
// elements; each block's first thread finds the window's head (two binary searches of the
// plan's group offsets, cuda/contract/tb_window.h) for the block. No allocation, no sync.
#include <algorithm>

#include "common/common.cuh"  // num_sms
#include "include/tb_plan.h"

namespace flowtt::tb {
namespace {

constexpr int kWindowBlock = 256;

__global__ void tb_window_kernel(TbWindowIn in, TbWindowOut out) {
  __shared__ TbWindowHead head;
  if (threadIdx.x == 0) head = TbWindowHeadOf(in);
  __syncthreads();
  for (int64_t i = int64_t(blockIdx.x) * kWindowBlock + threadIdx.x; i <= in.size;
       i += int64_t(gridDim.x) * kWindowBlock) {
    TbWindowWrite(in, head, i, out);
  }
}

}  // namespace

cudaError_t tb_window(const TbWindowIn& in, const TbWindowOut& out, cudaStream_t stream) {
  const int blocks = static_cast<int>(
      std::min<int64_t>((in.size + kWindowBlock) / kWindowBlock, int64_t(num_sms()) * 8));
  tb_window_kernel<<<blocks, kWindowBlock, 0, stream>>>(in, out);
  return cudaGetLastError();
}

}  // namespace flowtt::tb
