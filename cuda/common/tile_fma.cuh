// Register-tile helpers of the kernels. zero_fill: a register array set to 0, unrolled.
// tile_fma_rows<R>: the register tile of the prefix GEMMs (tile_gemm_P for one table,
// tb_batch_P for the table-batched kernels): a thread's R x 4 outputs (R = 4, 6, 8)
//   acc[i][c] = sum over a in [0, K), ascending, of A[a][i] * B[a][c],
// each an fmaf chain from 0 (the order every P of the project is formed in, so the
// results are bitwise those of the warp paths). A: R consecutive floats per a at stride
// ldA (16-byte aligned, 8 for R = 6), B: 4 per a at stride ldB, 16-byte aligned (shared
// memory). No CUDA header (the emulation of tests/native/tb_emu.h compiles it too).
#pragma once

namespace flowtt {

constexpr int kTileRows = 8;  // rows per thread of the register tile

template <int A, int B>
__device__ __forceinline__ void zero_fill(float (&x)[A][B]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j) x[i][j] = 0.f;
}

template <int R>
__device__ __forceinline__ void tile_fma_rows(const float* ap, int ldA, const float* bp, int ldB,
                                              int K, float (&acc)[R][4]) {
  static_assert(R == 4 || R == 6 || R == 8, "R rows: float4 (R 4, 8) or float2 (R 6) of A");
  zero_fill(acc);
#pragma unroll 4
  for (int a = 0; a < K; ++a) {
    float av[R];
    if constexpr (R % 4 == 0) {
#pragma unroll
      for (int h = 0; h < R / 4; ++h) {
        const float4 v = *reinterpret_cast<const float4*>(ap + a * ldA + 4 * h);
        av[4 * h] = v.x, av[4 * h + 1] = v.y, av[4 * h + 2] = v.z, av[4 * h + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int h = 0; h < R / 2; ++h) {
        const float2 v = *reinterpret_cast<const float2*>(ap + a * ldA + 2 * h);
        av[2 * h] = v.x, av[2 * h + 1] = v.y;
      }
    }
    const float4 bv = *reinterpret_cast<const float4*>(bp + a * ldB);
    const float bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(av[i], bw[c], acc[i][c]);
  }
}

}  // namespace flowtt
