// Shapes of the three TT cores: g1 [p1,1,q1,r1], g2 [p2,r1,q2,r2], g3 [p3,r2,q3,1].
#pragma once

#include <cstdint>

namespace flowtt {

struct CoreShape {
  int64_t p1, p2, p3, q1, q2, q3, r1, r2;
  int64_t dim() const { return q1 * q2 * q3; }
  int64_t rows() const { return p1 * p2 * p3; }
};

// The same extents as the CUDA launchers take them (each checked < 2^31 by the handlers).
struct TTDims {
  int p1, p2, p3, q1, q2, q3, r1, r2;
  int D() const { return q1 * q2 * q3; }
};

}  // namespace flowtt
