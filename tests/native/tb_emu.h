// CPU emulation of the CUDA built-ins the table-batched kernels use
// (cuda/batched/tb_fwd_kernels.cuh, cuda/batched/tb_bwd_kernels.cuh,
// cuda/batched/tb_dg3_kernels.cuh), to run the kernels' own code on a machine without a GPU
// (tests/native/tb_rows_emu_test.cc). Include it before the kernels, never with a CUDA header.
// A launch runs its blocks one after another; a block's threads are fibers (ucontext)
// on the calling thread, switched round-robin at every barrier: __syncthreads and
// __syncwarp wait for the block's / warp's threads, shuffles exchange through a per-warp
// buffer between two warp barriers. __shared__ variables are function statics (one block
// runs at a time); the dynamic shared memory is one buffer filled with NaN before each
// block (a read of an element not written first shows).
#pragma once
#define FLOWTT_TB_EMU 1  // cuda/batched/mma_tf32.cuh: the emulated tensor-core product

#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define TB_DYNAMIC_SMEM(name) float4* name = tb_emu::g_smem.data()
#define threadIdx (tb_emu::g_cur->idx)

using std::max;
using std::min;

namespace tb_emu {

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 idx;
  bool done = false;
};

// A barrier of `count` fibers: arrivals count up; the last one opens the generation.
struct Barrier {
  int count, waiting = 0;
  long gen = 0;
};

struct Warp {
  Barrier bar{32};
  uint32_t buf[32];
  std::vector<uint32_t> wide;  // tb_emu_exchange_n's
};

inline ucontext_t g_sched;            // the scheduler's context
inline Fiber* g_cur = nullptr;        // the running fiber
inline std::function<void()> g_body;  // the kernel call of the current launch
inline std::vector<float4> g_smem;    // dynamic shared memory of the current block
inline Barrier g_block_bar{0};
inline std::vector<Warp> g_warps;

inline void yield() { swapcontext(&g_cur->ctx, &g_sched); }

inline void wait(Barrier& b) {
  const long gen = b.gen;
  if (++b.waiting == b.count) {
    b.waiting = 0;
    ++b.gen;
  } else {
    while (b.gen == gen) yield();
  }
}

inline void trampoline() {
  g_body();
  g_cur->done = true;
  swapcontext(&g_cur->ctx, &g_sched);
}

}  // namespace tb_emu

inline dim3 blockIdx, blockDim, gridDim;

inline void __syncthreads() { tb_emu::wait(tb_emu::g_block_bar); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  tb_emu::wait(tb_emu::g_warps[threadIdx.x / 32].bar);
}

// Every warp operation below: each lane publishes its 32-bit value, then reads the warp's
// 32 values (two warp barriers around the read).
template <typename T>
std::array<T, 32> tb_emu_exchange(T v) {
  static_assert(sizeof(T) == 4, "32-bit warp operations only");
  tb_emu::Warp& w = tb_emu::g_warps[threadIdx.x / 32];
  std::memcpy(&w.buf[threadIdx.x % 32], &v, 4);
  tb_emu::wait(w.bar);
  std::array<T, 32> all;
  std::memcpy(all.data(), w.buf, sizeof w.buf);
  tb_emu::wait(w.bar);
  return all;
}

// Each lane publishes N 32-bit values and reads the warp's 32 x N (one exchange for a
// whole mma fragment set).
template <int N>
std::array<uint32_t, 32 * N> tb_emu_exchange_n(const uint32_t (&v)[N]) {
  tb_emu::Warp& w = tb_emu::g_warps[threadIdx.x / 32];
  if (w.wide.size() < 32 * N) w.wide.resize(32 * N);
  std::memcpy(&w.wide[(threadIdx.x % 32) * N], v, sizeof v);
  tb_emu::wait(w.bar);
  std::array<uint32_t, 32 * N> all;
  std::memcpy(all.data(), w.wide.data(), sizeof all);
  tb_emu::wait(w.bar);
  return all;
}

template <typename T>
T __shfl_sync(unsigned, T v, int src) {
  return tb_emu_exchange(v)[src & 31];
}

template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  const int lane = (int)(threadIdx.x % 32);
  return __shfl_sync(mask, v, lane >= (int)delta ? lane - (int)delta : lane);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return __shfl_sync(mask, v, (int)(threadIdx.x % 32) ^ lane_mask);
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }

// Warp votes and reductions.
inline unsigned __ballot_sync(unsigned, int pred) {
  const std::array<int, 32> all = tb_emu_exchange(pred != 0 ? 1 : 0);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= (all[l] ? 1u : 0u) << l;
  return bits;
}
inline unsigned __match_any_sync(unsigned, int v) {
  const std::array<int, 32> all = tb_emu_exchange(v);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= (all[l] == v ? 1u : 0u) << l;
  return bits;
}
inline int __reduce_min_sync(unsigned, int v) {
  const std::array<int, 32> all = tb_emu_exchange(v);
  return *std::min_element(all.begin(), all.end());
}

inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

// kernel<<<grid, threads, smem_bytes>>>(args...), run to completion.
template <typename Kernel, typename... Args>
void tb_emu_launch(int grid, int threads, size_t smem_bytes, Kernel kernel, Args... args) {
  using namespace tb_emu;
  gridDim.x = grid;
  blockDim.x = threads;
  g_body = [&] { kernel(args...); };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  static std::vector<Fiber> fibers;  // stacks reused across launches
  if ((int)fibers.size() < threads) fibers.resize(threads);
  for (int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    g_smem.assign(smem_bytes / sizeof(float4) + 1, float4{nan, nan, nan, nan});
    g_block_bar = Barrier{threads};
    g_warps = std::vector<Warp>(threads / 32);
    for (int t = 0; t < threads; ++t) {
      Fiber& f = fibers[t];
      if (f.stack.empty()) f.stack.resize(256 * 1024);
      f.idx.x = t;
      f.done = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, trampoline, 0);
    }
    for (int live = threads; live > 0;) {  // round-robin until every fiber returned
      live = 0;
      for (int t = 0; t < threads; ++t) {
        Fiber& f = fibers[t];
        if (f.done) continue;
        g_cur = &f;
        swapcontext(&g_sched, &f.ctx);
        live += !f.done;
      }
    }
  }
}
