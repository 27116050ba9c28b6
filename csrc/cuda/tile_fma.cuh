// Register-tile helpers of the kernels. zero_fill: a register array set to 0, unrolled.
// tile_fma_rows<R>: the register tile of the prefix GEMMs (tile_gemm_P for
// one table, tb_batch_P for the table-batched kernels): a thread's R x 4 outputs (R = 4, 6, 8,
// chosen by tile_rows_for)
//   acc[i][c] = sum over a in [0, K), ascending, of A[a][i] * B[a][c],
// each an fmaf chain from 0 (the order every P of the project is formed in, so the
// results are bitwise those of the warp paths). A: R consecutive floats per a at stride
// ldA (16-byte aligned, 8 for R = 6), B: 4 per a at stride ldB, 16-byte aligned (shared
// memory). No CUDA header
// (the emulation of csrc/cuda/tb_emu.h compiles it too).
#pragma once

#include <type_traits>

namespace flowtt {

constexpr int kTileRows = 8;  // rows per thread of the register tile

#ifndef FLOWTT_P_ROWS4  // tuning knobs: 0 = never 4 / 6 rows a thread
#define FLOWTT_P_ROWS4 1
#endif
#ifndef FLOWTT_P_ROWS6
#define FLOWTT_P_ROWS6 1
#endif

// Rows a thread (R of tile_fma_rows) for a prefix GEMM of nR rows x NC4 column quads on NT
// threads, A's rows at stride ldA (a multiple of 8): kTileRows; 4 where 8 would give fewer
// items than threads; 6 where that takes fewer row steps a thread (rounds of NT items times
// R) than either choice and the rows it reads stay within ldA. D128 r64's forward batch (24
// rows x 64 quads, 256 threads): 6, one item each, where 8 left 64 threads idle and 4 took
// two rounds on half of them. Every output is the same fmaf chain for any R: same bits.
__device__ inline int tile_rows_for(int nR, int NC4, int ldA, int NT) {
  auto steps = [&](int R) { return (NC4 * ((nR + R - 1) / R) + NT - 1) / NT * R; };
  const int R = FLOWTT_P_ROWS4 && NC4 * ((nR + kTileRows - 1) / kTileRows) < NT ? 4 : kTileRows;
  return FLOWTT_P_ROWS6 && (nR + 5) / 6 * 6 <= ldA && steps(6) < steps(R) ? 6 : R;
}

// f(std::integral_constant<int, R>{}) for R = tile_rows_for(...) (4, 6 or kTileRows).
template <class F>
__device__ __forceinline__ void with_tile_rows(int R, F&& f) {
  if (R == 4)
    f(std::integral_constant<int, 4>{});
  else if (R == 6)
    f(std::integral_constant<int, 6>{});
  else
    f(std::integral_constant<int, kTileRows>{});
}

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
