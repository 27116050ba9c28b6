// snake_slots: how the backward GEMM tile kernel (cuda/single/rows_bwd.cu) deals a batch's dP items
// to its threads. Host-compilable (tests/native/snake_slots_test.cc checks it without a GPU).
#pragma once

#ifndef __CUDACC__  // a host compiler: the qualifiers mean nothing
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#endif

namespace flowtt {

// Slot order of a batch's dP items (snake draft): thread t takes slots t / IPG + j * S,
// S = NT / IPG slots a row, j = 0, 1, ...; lane `lane` of warp 0 (all 32 lanes call it)
// writes ord[p] = the batch group (0..nB-1) of slot p so that row j takes the groups of
// size ranks j*S .. j*S + S - 1 (largest first, ties by index), every other full row
// reversed: a thread's groups pair large with small and the barrier after the dP pass
// waits for the largest pair, not for the largest groups dealt to one thread. Each
// group's dP is the same sum whoever computes it: same bits (harness rows backward, D128
// r64 B65536: 16 groups a batch on 512 threads, 2.541 -> 2.511 ms; B4096 0.878 -> 0.870).
// sizes(k): unique ids of batch group k; nB <= 32.
template <class Sizes>
__host__ __device__ __forceinline__ void snake_slots(int nB, int S, int lane, int* ord,
                                                     Sizes&& sizes) {
  if (lane < nB) {
    const int mine = sizes(lane);
    int r = 0;  // rank: larger groups first, ties by index
    for (int k = 0; k < nB; ++k) {
      const int o = sizes(k);
      r += (o > mine) || (o == mine && k < lane);
    }
    const int j = r / S, s = r - j * S;
    const bool rev = (j & 1) && (j + 1) * S <= nB;
    ord[j * S + (rev ? S - 1 - s : s)] = lane;
  }
}

}  // namespace flowtt
