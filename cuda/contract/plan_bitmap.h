// The forward-only plan by a bitmap of the table's rows (flowtt_plan with perm and
// run_offsets of length 0, docs/op_contract.md), shared by the CPU (ffi/cpu/plan.cc) and CUDA
// (cuda/plan/plan.cu) implementations (plain C++, host and device). Bit i of word i / 32 marks
// id i; the set bits in increasing order are the ascending unique ids, so no sort is
// needed: an exclusive scan of the words' Spans gives each word the unique index and
// prefix group of its first set bit, and an id's unique index is its word's index plus
// the set bits below it in the word.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLOWTT_BITMAP_HD __host__ __device__ __forceinline__
#else
#define FLOWTT_BITMAP_HD inline
#endif

namespace flowtt::plan_bitmap {

// Words of the bitmap of num_rows ids.
FLOWTT_BITMAP_HD int64_t Words(int64_t num_rows) { return (num_rows + 31) / 32; }

// Whether a forward-only plan of n >= 1 ids takes the bitmap: at most kWordsPerId words
// per id (memset and scan of the words against a radix sort of the ids; S1: 312,500 words
// for 457,971 ids). Otherwise the sort's plan, with perm and run_offsets in scratch.
constexpr int64_t kWordsPerId = 2;
FLOWTT_BITMAP_HD bool Applies(int64_t n, int64_t num_rows) {
  return n >= 1 && Words(num_rows) <= kWordsPerId * n;
}

FLOWTT_BITMAP_HD int Popc(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// Index of the lowest / highest set bit of x != 0.
FLOWTT_BITMAP_HD int LowBit(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __ffs(x) - 1;
#else
  return __builtin_ctz(x);
#endif
}
FLOWTT_BITMAP_HD int HighBit(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(x);
#else
  return 31 - __builtin_clz(x);
#endif
}

// Bits [lo, hi) of a word, 0 <= lo < hi <= 32.
FLOWTT_BITMAP_HD uint32_t BitRange(int lo, int hi) {
  const uint32_t below_hi = hi == 32 ? ~0u : (1u << hi) - 1u;
  return below_hi & ~((1u << lo) - 1u);
}

// A range of words: its set bits u (unique ids), its prefix groups g (distinct
// id / last_extent among them) and the prefixes of its first and last set bit (-1: none).
struct Span {
  int32_t u, g, first, last;
};
constexpr Span kEmpty{0, 0, -1, -1};

// The Span of two adjacent ranges, a before b (associative; kEmpty is its identity): a
// group that runs across the boundary counts once.
FLOWTT_BITMAP_HD Span Join(const Span& a, const Span& b) {
  if (b.u == 0) return a;
  if (a.u == 0) return b;
  return {a.u + b.u, a.g + b.g - (a.last == b.first ? 1 : 0), a.first, b.last};
}

// The Span of word w (ids 32 w .. 32 w + 31 where its bits are set).
FLOWTT_BITMAP_HD Span WordSpan(uint32_t bits, int64_t w, int32_t last_extent) {
  if (bits == 0) return kEmpty;
  const int64_t base = 32 * w;
  const int32_t first = static_cast<int32_t>((base + LowBit(bits)) / last_extent);
  const int32_t last = static_cast<int32_t>((base + HighBit(bits)) / last_extent);
  int32_t g = 1;
  for (int64_t p = first + 1; p <= last; ++p) {  // the word's other prefixes, in order
    const int64_t lo = p * last_extent - base, hi = lo + last_extent;
    if (bits & BitRange(static_cast<int>(lo), static_cast<int>(hi < 32 ? hi : 32))) ++g;
  }
  return {Popc(bits), g, first, last};
}

// Writes word w's unique ids and group starts after the words before it (`before`, their
// Span): its j-th set bit is unique index before.u + j, and starts a group (its index goes
// to group_offsets) where its prefix differs from the previous set bit's.
FLOWTT_BITMAP_HD void EmitWord(uint32_t bits, int64_t w, int32_t last_extent, const Span& before,
                               int32_t* unique_ids, int32_t* group_offsets) {
  int32_t u = before.u, g = before.g, prev = before.last;
  while (bits != 0) {
    const int32_t id = static_cast<int32_t>(32 * w + LowBit(bits));
    bits &= bits - 1u;
    const int32_t p = id / last_extent;
    if (p != prev) group_offsets[g++] = u;
    prev = p;
    unique_ids[u++] = id;
  }
}

// Unique index of a marked id whose word holds `bits` and has unique index `word_rank`
// (the u of the words before it).
FLOWTT_BITMAP_HD int32_t Rank(uint32_t bits, int32_t word_rank, int32_t id) {
  return word_rank + Popc(bits & ((1u << (id & 31)) - 1u));
}

}  // namespace flowtt::plan_bitmap

#undef FLOWTT_BITMAP_HD
