// The window of a shape group's plan (flowtt_tb_window, docs/batched_contract.md): the rows
// ops' plan of the uniques [lo, lo + size) of a plan, capped at its num_unique (the capacity
// passes, docs/memory.md). Plain C++ shared by the CPU twin and the CUDA kernel, host and
// device: the window's head (the prefix group holding unique lo, the window's counts) and
// each output element from it.
#pragma once

#include <cstdint>

#include "contract/tb_plan_meta.h"  // TbClamp64

#include "contract/host_device.h"

namespace flowtt::tb {

struct TbWindowIn {
  const int32_t* group_offsets;  // [n+1]
  const int32_t* u_i3;           // [n]
  const int32_t* g_i1;           // [n]
  const int32_t* g_i2;           // [n]
  const int32_t* counts;         // [2]
  int64_t n, lo, size;           // n >= 1, lo >= 0, size >= 1
};

struct TbWindowOut {
  int32_t *group_offsets, *u_i3, *g_i1, *g_i2, *counts;  // [size+1], [size] x 3, [2]
};

// first: the prefix group holding unique lo; uniques, groups: the window's counts.
struct TbWindowHead {
  int64_t first, uniques, groups;
};

// The last g in [0, G) with go[g] <= u (go ascending on [0, G), go[0] = 0 <= u; G >= 1).
FLOWTT_HD int64_t TbGroupOf(const int32_t* go, int64_t G, int64_t u) {
  int64_t a = 0, b = G;
  while (b - a > 1) {
    const int64_t m = a + (b - a) / 2;
    if (go[m] <= u)
      a = m;
    else
      b = m;
  }
  return a;
}

FLOWTT_HD TbWindowHead TbWindowHeadOf(const TbWindowIn& in) {
  const int64_t U = TbClamp64(in.counts[0], 0, in.n), G = TbClamp64(in.counts[1], 0, U);
  const int64_t hi = TbClamp64(U, in.lo, in.lo + in.size);
  if (hi <= in.lo || G == 0) return {0, 0, 0};
  const int64_t first = in.lo == 0 ? 0 : TbGroupOf(in.group_offsets, G, in.lo);
  return {first, hi - in.lo, TbGroupOf(in.group_offsets, G, hi - 1) - first + 1};
}

// Output element i in [0, size] (i == size: the last group offset only): unique lo + i's
// u_i3, group first + i's g_i1, g_i2 and first unique (clipped into the window, relative to
// lo), 0 past the window's counts (offsets: the window's uniques); i == 0 writes counts.
FLOWTT_HD void TbWindowWrite(const TbWindowIn& in, const TbWindowHead& h, int64_t i,
                             const TbWindowOut& out) {
  const int64_t g = h.first + i;
  const int64_t offset = g <= in.n ? in.group_offsets[g] : in.lo + h.uniques;
  out.group_offsets[i] = static_cast<int32_t>(TbClamp64(offset, in.lo, in.lo + h.uniques) - in.lo);
  if (i == in.size) return;
  out.u_i3[i] = i < h.uniques ? in.u_i3[in.lo + i] : 0;
  out.g_i1[i] = i < h.groups ? in.g_i1[g] : 0;
  out.g_i2[i] = i < h.groups ? in.g_i2[g] : 0;
  if (i == 0) {
    out.counts[0] = static_cast<int32_t>(h.uniques);
    out.counts[1] = static_cast<int32_t>(h.groups);
  }
}

}  // namespace flowtt::tb
