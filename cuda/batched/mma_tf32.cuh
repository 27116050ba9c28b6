// 3xTF32 tensor-core products (sm_80+ mma.sync m16n8k8, f32 accumulate) at float32
// accuracy: x = hi + lo with hi = tf32(x) and lo = tf32(x - hi) (round to nearest, ties
// away), and a . b ~ a_lo . b_hi + a_hi . b_lo + a_hi . b_hi, the small terms first
// (CUTLASS's "3xTF32"; the dropped a_lo . b_lo is ~2^-22 of the product), each k-step's
// product added to the caller's accumulator in float32. Fragments of
// one m16n8k8 tile, per lane (g = lane / 4, t = lane % 4; PTX ISA "mma.m16n8k8"):
//   A [16][8]: a[0] (g, t), a[1] (g + 8, t), a[2] (g, t + 4), a[3] (g + 8, t + 4);
//   B [8][8]:  b[0] (t, g), b[1] (t + 4, g);
//   C [16][8]: c[0] (g, 2t), c[1] (g, 2t + 1), c[2] (g + 8, 2t), c[3] (g + 8, 2t + 1).
// Every lane of the warp must call (warp-uniform control flow). No CUDA header: under the
// CPU emulation (tests/native/tb_emu.h, FLOWTT_TB_EMU) the product is formed from the warp's
// exchanged fragments in float32 (same layout, not the hardware's bits).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace flowtt::tb {

struct TbTf32 {
  uint32_t hi, lo;
};

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint32_t tb_to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float tb_bits_float(uint32_t u) { return __uint_as_float(u); }
#else
inline uint32_t tb_to_tf32(float x) {  // cvt.rna.tf32.f32: 10 mantissa bits, ties away
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;  // inf, NaN kept
  return (u + 0x1000u) & 0xffffe000u;
}
inline float tb_bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

__device__ __forceinline__ TbTf32 tb_split_tf32(float x) {
  const uint32_t hi = tb_to_tf32(x);
  return {hi, tb_to_tf32(x - tb_bits_float(hi))};
}

#if defined(__CUDA_ARCH__)
// c += a . b, one m16n8k8 TF32 product (fragments as above, operands tf32 bit patterns).
__device__ __forceinline__ void tb_mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                            uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

// acc += a . b at float32 accuracy (3xTF32) from split fragments: the three products
// from 0, then one IEEE float32 addition per element (the tensor cores' accumulation
// does not round to nearest; a long chain of k-steps inside one accumulator drifts,
// ~1e-4 relative over thousands of steps). Emulated: the warp's 12 fragment values in
// one exchange, each product a float32 fmaf chain over k.
__device__ __forceinline__ void tb_mma_3xtf32(float (&acc)[4], const TbTf32 (&a)[4],
                                              const TbTf32 (&b)[2]) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(__CUDA_ARCH__)
  tb_mma_tf32(c, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[0].hi, b[1].hi);
  tb_mma_tf32(c, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].lo, b[1].lo);
  tb_mma_tf32(c, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].hi, b[1].hi);
#elif defined(FLOWTT_TB_EMU)
  const uint32_t mine[12] = {a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].hi, b[1].hi,
                             a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[0].lo, b[1].lo};
  const std::array<uint32_t, 32 * 12> all = tb_emu_exchange_n<12>(mine);
  const int lane = (int)(threadIdx.x % 32), g = lane / 4, t = lane % 4;
  auto A = [&](int part, int row, int col) {  // part 0: hi, 1: lo
    return tb_bits_float(
        all[((row % 8) * 4 + col % 4) * 12 + 6 * part + (row >= 8) + 2 * (col >= 4)]);
  };
  auto B = [&](int part, int row, int col) {
    return tb_bits_float(all[(col * 4 + row % 4) * 12 + 6 * part + 4 + (row >= 4)]);
  };
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    for (const auto [pa, pb] : {std::pair{1, 0}, std::pair{0, 1}, std::pair{0, 0}}) {
      float s = c[i];
      for (int k = 0; k < 8; ++k) s = fmaf(A(pa, row, k), B(pb, k, col), s);
      c[i] = s;
    }
  }
#endif
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += c[i];
}

}  // namespace flowtt::tb
