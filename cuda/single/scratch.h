// Scratch layouts of the CUDA ops (one block from XLA's allocator, carved into
// 256-byte aligned arrays) and their sizes; the byte-size functions of cuda/include/ops.h
// are defined with them (cuda/single/scratch.cu). A layout computed on a nullptr base gives
// the size only.
#pragma once

#include <cstddef>

#include "common/common.cuh"

namespace flowtt {

// Carves a block front to back into 256-byte aligned arrays.
struct Bump {
  char* base;
  size_t off = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(base ? base + off : nullptr);
    off += align_up(count * sizeof(T));
    return p;
  }
};

// Forward scratch for `passes` passes over unique ranges of `range` rows (one
// pass of n rows for flowtt_tt_rows_fwd, one per chunk for flowtt_bag_fwd):
// the prefix map, per pass two work counters and the checkpoint flags (all three zeroed
// by one memset), one checkpoint buffer, plus `buf_rows` rows of D floats (the fused
// forward's rows buffer; 0 otherwise).
struct FwdScratch {
  int* map;
  int* ctrl;
  float* ckpt;
  float* rows;
  size_t bytes;
  int nslots;
  int passes;
  int* pass_ctrl(int p) const { return ctrl + (size_t)p * (2 + nslots); }  // flags at +2
  // map through the last counter: what the one memset zeroes
  size_t zeroed_bytes() const { return (char*)(ctrl + (size_t)passes * (2 + nslots)) - (char*)map; }
};
FwdScratch fwd_layout(const Dev& d, int range, int passes, int buf_rows, void* base);

// The fused forward's rows buffer: chunk_rows rounded up to kCH, at most n
// rounded up to kCH.
int bag_chunk(int n, long long chunk_rows);

// Backward scratch: the prefix map, the tile counter and one turn per i2 column (zeroed
// by one memset: map, ctrl[0], ctrl[1 + i2]); per group slot (min(n, p1*p2)) P (for dG3).
// Then one region the two phases share: the tile phase's dP (warp tile kernel only) and
// dG1 partials per group slot, and after the dG1 reduction the dG3 pass's sort
// keys/values, group of each unique id, per (i3, part) partials and cub's sort storage.
// (The tile kernel adds each tile's dG2 partial into dG2 itself: no buffer.)
struct BwdScratch {
  int* map;
  int* ctrl;
  float* Pbuf;
  float* dPbuf;
  float* dG1p;
  int* ug;
  int* keys_in;
  int* keys_out;
  int* vals_in;
  int* vals_out;
  float* dg3p;
  void* cub_tmp;
  size_t cub_bytes;
  size_t bytes;
  int slots;
  int* col_turn() const { return ctrl + 1; }
  // map through the last turn: what the one memset zeroes
  size_t zeroed_bytes(const Dev& d) const { return (char*)(ctrl + 1 + (size_t)d.p2) - (char*)map; }
};
BwdScratch bwd_layout(const Dev& d, int n, void* base);

}  // namespace flowtt
