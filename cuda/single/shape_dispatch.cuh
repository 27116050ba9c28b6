// The core shapes the kernels are compiled for. A kernel template takes its shape as
// template arguments (loops unrolled, index math folded to constants); a launcher
// looks the run-time shape up in a table, the first matching entry wins, and falls
// back to the generic instantiation (all arguments 0: run-time loops) where the
// kernel has one. Adding a shape is adding a table entry.
#pragma once

#include "common/common.cuh"

namespace flowtt {

// A table of shapes, each with a static matches(keys...).
template <typename... Shapes>
struct ShapeTable {
  // Calls f(Shape{}) for the first entry matching the keys; false when none does.
  template <typename F, typename... Key>
  static bool dispatch(F&& f, Key... key) {
    return ((Shapes::matches(key...) && (f(Shapes{}), true)) || ...);
  }
  template <typename... Key>
  static bool contains(Key... key) {
    return (Shapes::matches(key...) || ...);
  }
};

// (M = q1*q2, q3) of the GEMM tile kernels (forward and backward) and of the blocked
// dG3 pass.
template <int M_, int Q3_>
struct GemmShape {
  static constexpr int M = M_, Q3 = Q3_;
  static bool matches(int m, int q3) { return m == M && q3 == Q3; }
};
using GemmShapes = ShapeTable<GemmShape<4, 4>, GemmShape<8, 4>, GemmShape<16, 4>, GemmShape<4, 8>,
                              GemmShape<8, 8>, GemmShape<16, 8>>;

// The dims the GEMM tile kernels (forward and backward) take.
inline bool gemm_dims(const Dev& d) { return GemmShapes::contains(d.M, d.q3) && d.r2 % 4 == 0; }

// q1 of the forward warp kernel (the fallback of the GEMM one).
template <int Q1_>
struct WarpFwdShape {
  static constexpr int Q1 = Q1_;
  static bool matches(int q1) { return q1 == Q1; }
};
using WarpFwdShapes =
    ShapeTable<WarpFwdShape<1>, WarpFwdShape<2>, WarpFwdShape<4>, WarpFwdShape<8>>;
using WarpFwdGeneric = WarpFwdShape<0>;

// (q1, M, q3, BB) of the backward warp kernel, BB = columns b per lane (1 for r2 <= 32,
// else 2).
template <int Q1_, int M_, int Q3_, int BB_>
struct WarpBwdShape {
  static constexpr int Q1 = Q1_, M = M_, Q3 = Q3_, BB = BB_;
  static bool matches(int q1, int m, int q3, int bb) {
    return q1 == Q1 && m == M && q3 == Q3 && bb == BB;
  }
};
using WarpBwdShapes =
    ShapeTable<WarpBwdShape<2, 8, 4, 1>, WarpBwdShape<2, 8, 4, 2>, WarpBwdShape<4, 16, 8, 1>,
               WarpBwdShape<4, 16, 8, 2>, WarpBwdShape<2, 4, 4, 1>, WarpBwdShape<2, 4, 4, 2>,
               WarpBwdShape<4, 16, 4, 1>, WarpBwdShape<4, 16, 4, 2>>;
using WarpBwdGeneric = WarpBwdShape<0, 0, 0, 0>;

}  // namespace flowtt
