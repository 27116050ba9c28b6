// Scratch layouts of the CUDA ops and the scratch byte sizes of cuda/include/ops.h.
#include "single/scratch.h"

#include <algorithm>

#include "include/ops.h"
#include "single/stages.h"

namespace flowtt {

FwdScratch fwd_layout(const Dev& d, int range, int passes, int buf_rows, void* base) {
  Bump bp{static_cast<char*>(base)};
  FwdScratch s;
  s.nslots = range / kCH + 2;
  s.passes = passes;
  s.map = bp.take<int>((size_t)d.p1 * d.p2);
  s.ctrl = bp.take<int>((size_t)passes * (2 + s.nslots));
  s.ckpt = bp.take<float>((size_t)s.nslots * d.PSZ);
  s.rows = bp.take<float>((size_t)buf_rows * d.D);
  s.bytes = bp.off;
  return s;
}

int bag_chunk(int n, long long chunk_rows) {
  const long long c = (std::max(chunk_rows, 1LL) + kCH - 1) / kCH * kCH;
  const long long cap = ((long long)n + kCH - 1) / kCH * kCH;
  return (int)std::min(c, cap);
}

BwdScratch bwd_layout(const Dev& d, int n, void* base) {
  Bump bp{static_cast<char*>(base)};
  BwdScratch s;
  s.slots = (int)std::min<long long>(n, (long long)d.p1 * d.p2);
  s.map = bp.take<int>((size_t)d.p1 * d.p2);
  s.ctrl = bp.take<int>(1 + (size_t)d.p2);
  s.Pbuf = bp.take<float>((size_t)s.slots * d.PSZ);
  const size_t shared = bp.off;
  // tile phase: dP goes through global memory only in the warp tile kernel (not the GEMM one)
  s.dPbuf = bp.take<float>(gemm_bwd_batch_groups(d) > 0 ? 0 : (size_t)s.slots * d.PSZ);
  s.dG1p = bp.take<float>((size_t)s.slots * d.Q1R1);
  const size_t tile_end = bp.off;
  bp.off = shared;  // dG3 phase, after the dG1 reduction
  s.ug = bp.take<int>(n);
  s.keys_in = bp.take<int>(std::max(n, d.p3 + 1));
  s.keys_out = bp.take<int>(n);
  s.vals_in = bp.take<int>(n);
  s.vals_out = bp.take<int>(n);
  s.dg3p = bp.take<float>((size_t)d.p3 * kS3 * d.r2 * d.q3);
  s.cub_bytes = dg3_sort_bytes(n);
  s.cub_tmp = bp.take<char>(s.cub_bytes + 16);
  s.bytes = std::max(tile_end, bp.off);
  return s;
}

size_t rows_fwd_scratch_bytes(const TTDims& t, int n) {
  return fwd_layout(make_dev(t), n, 1, 0, nullptr).bytes;
}

size_t bag_fwd_scratch_bytes(const TTDims& t, int n, long long chunk_rows) {
  const int C = bag_chunk(n, chunk_rows);
  return fwd_layout(make_dev(t), C, (n + C - 1) / C, C, nullptr).bytes;
}

size_t rows_bwd_scratch_bytes(const TTDims& t, int n) {
  return bwd_layout(make_dev(t), n, nullptr).bytes;
}

size_t bag_pool_bwd_scratch_bytes(int n, int D) {
  return sizeof(float) * pool_bwd_part_floats(n, D) +
         sizeof(int) * (1 + (size_t)pool_bwd_hot_capacity(n)) + 256;
}

}  // namespace flowtt
