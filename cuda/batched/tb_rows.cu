// Table-batched rows ops on CUDA: the launchers of cuda/include/tb_rows.h (scratch layouts, the
// radix sorts, path choice, launch configuration). The kernels and their design:
// cuda/batched/tb_fwd_kernels.cuh, cuda/batched/tb_bwd_kernels.cuh,
// cuda/batched/tb_dg2_mma_kernel.cuh, cuda/batched/tb_dg3_kernels.cuh.
#include "include/tb_rows.h"  // first (its own block): the header stands alone

#include <algorithm>
#include <cstdint>

#include "batched/tb_bwd_kernels.cuh"
#include "batched/tb_dg2_mma_kernel.cuh"
#include "batched/tb_dg3_kernels.cuh"
#include "batched/tb_fwd_kernels.cuh"
#include "batched/tb_sort.cuh"

namespace flowtt::tb {
namespace {

int tb_num_sms() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

// A persistent grid: as many blocks as fit on the device at once.
template <typename Kernel, typename... Args>
cudaError_t tb_launch(Kernel kernel, size_t smem, cudaStream_t stream, Args... args) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  int occ = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kTbThreads, smem)) !=
      cudaSuccess)
    return err;
  occ = std::max(1, std::min(occ, 8));
  kernel<<<tb_num_sms() * occ, kTbThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

bool tb_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

size_t tb_align256(size_t x) { return (x + 255) / 256 * 256; }

// Scratch carved from a 256-byte aligned base (the caller's block has 256 bytes spare).
struct TbBump {
  char* base;
  size_t off = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += tb_align256(count * sizeof(T));
    return p;
  }
};

char* tb_base(void* scratch) {
  if (scratch == nullptr) return nullptr;
  return reinterpret_cast<char*>(tb_align256(reinterpret_cast<uintptr_t>(scratch)));
}

// Radix sort scratch (cuda/batched/tb_sort.cuh): the digit histograms [kTbRadix][tiles] (scanned
// in place) and the digits' totals [kTbRadix].
struct TbSortTmp {
  int *hist, *totals;
  int tiles;
};

TbSortTmp tb_sort_tmp_layout(TbBump& bp, int n) {
  TbSortTmp t;
  t.tiles = tb_sort_tiles(n);
  t.hist = bp.take<int>((size_t)kTbRadix * t.tiles);
  t.totals = bp.take<int>(kTbRadix);
  return t;
}

// Sorts the indices [0, num_groups) (which == 1) or [0, num_unique) (which == 0) stably
// by key_src[i] clamped into [0, P), ping-ponging between *out and *alt: on return *out
// points at the sorted indices, *alt at the other buffer.
cudaError_t tb_radix_sort(const TbSortTmp& t, const int* key_src, int P, const int* counts,
                          int which, int n, int** out, int** alt, cudaStream_t stream) {
  const int* in = nullptr;                                            // the identity
  const int grid = std::max(1, std::min(t.tiles, tb_num_sms() * 8));  // over the live tiles
  const TbSortPasses passes = tb_sort_passes(P - 1);
  for (int pass = 0; pass < passes.count; ++pass) {
    const TbSortPass ps = tb_sort_pass(passes, pass);
    const int shift = ps.shift, bits = ps.bits;
    tb_radix_hist_kernel<<<grid, kTbThreads, 0, stream>>>(in, key_src, P - 1, counts, which, n,
                                                          shift, bits, t.tiles, t.hist);
    tb_radix_scan_kernel<<<tb_sort_slots(bits), kTbThreads, 0, stream>>>(counts, which, n, t.tiles,
                                                                         t.hist, t.totals);
    tb_radix_scatter_kernel<<<grid, kTbThreads, 0, stream>>>(
        in, key_src, P - 1, counts, which, n, shift, bits, t.tiles, t.hist, t.totals, *out);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    in = *out;
    std::swap(*out, *alt);
  }
  std::swap(*out, *alt);
  return cudaSuccess;
}

// Shared memory cap of the sorted-tile forward (room for two blocks per SM).
constexpr size_t kTbTileSmemCap = 100 * 1024;

// The groups stably sorted by g_i2 (both ops): two index buffers, the sort's scratch,
// bounds2 [p2+1].
struct TbGroupSort {
  int *va, *vb, *bounds2;
  TbSortTmp tmp;
};

TbGroupSort tb_group_sort_layout(TbBump& bp, const TbDev& d, int n) {
  TbGroupSort s;
  s.va = bp.take<int>(n);
  s.vb = bp.take<int>(n);
  s.bounds2 = bp.take<int>((size_t)d.p2 + 1);
  s.tmp = tb_sort_tmp_layout(bp, n);
  return s;
}

int tb_grid_stride_blocks(int n) { return std::max(1, std::min(n / 256 + 1, tb_num_sms() * 8)); }

// The groups by g_i2 into *sorted (one of the sort's buffers; *free_buf: the other), then
// bounds2.
cudaError_t tb_sort_groups(const TbDev& d, const TbGroupSort& s, const int* g_i2, const int* counts,
                           int n, const int** sorted, int** free_buf, cudaStream_t stream) {
  int *out = s.va, *alt = s.vb;
  cudaError_t err = tb_radix_sort(s.tmp, g_i2, d.p2, counts, 1, n, &out, &alt, stream);
  if (err != cudaSuccess) return err;
  tb_bounds_kernel<<<tb_grid_stride_blocks(n), 256, 0, stream>>>(out, g_i2, counts, 1, n, d.p2,
                                                                 s.bounds2);
  *sorted = out;
  *free_buf = alt;
  return cudaGetLastError();
}

// Forward scratch: the work counters, and the group sort when the tile path may run.
struct TbFwdScratch {
  int* ctr;  // [2]
  TbGroupSort sort;
  size_t bytes;
};

TbFwdScratch tb_fwd_layout(const TbDev& d, int n, char* base) {
  TbBump bp{base};
  TbFwdScratch s;
  s.ctr = bp.take<int>(2);
  if (tb_tile_geo(d, kTbTileSmemCap).GB > 0) s.sort = tb_group_sort_layout(bp, d, n);
  s.bytes = bp.off + 256;
  return s;
}

// Byte budget of the backward's cache buffer, used twice: first for the dg1 terms E
// (tb_dg2_kernel -> tb_dg1_reduce_kernel, q1*r1 floats per group), then for the P cache
// (tb_pcache_kernel -> tb_dg3_kernel, P_g: q1*q2*r2 floats, 1 KB at q = (2, 4, *), r2 =
// 32). E covers every group when num_groups <= e_cap (else tb_dg1_kernel merges per g1
// row as before); the P cache `cap` groups at a time (dg3 runs in passes over the groups,
// each pass after the cache of its groups: ceil(n / cap) passes, those past num_groups
// return at once).
#ifndef FLOWTT_TB_PCACHE_MB  // a smaller budget forces passes (harness timing)
#define FLOWTT_TB_PCACHE_MB 2048
#endif
constexpr size_t kTbPCacheBytes = size_t{FLOWTT_TB_PCACHE_MB} << 20;

// Groups the P cache holds for these dims (0: the dims do not take the tile GEMM, dg3
// forms every P itself in one pass).
int tb_pcache_groups(const TbDev& d, int n) {
  if (tb_tile_geo(d, kTbTileSmemCap).GB == 0 || n <= 0) return 0;
  return (int)std::min<size_t>((size_t)n, kTbPCacheBytes / (sizeof(float) * (size_t)d.PSZ));
}

// Shared memory cap of the dg2 kernel (with the staged g2 row when it writes E).
constexpr size_t kTbDg2SmemCap = 200 * 1024;

// Groups the dg1 terms E may hold (-1: the dims do not take that path).
int tb_e_groups(const TbDev& d, int n) {
  if (tb_dg2_smem(d, true, tb_dg2_batch(d, true)) > kTbDg2SmemCap) return -1;
  return (int)std::min<size_t>((size_t)n, kTbPCacheBytes / (sizeof(float) * (size_t)d.Q1R1));
}

// Backward scratch: the work counters ctrl [2 + 2 * passes] (dg1's merge, dg2, then per
// dg3 pass the P cache's and dg3's) and bounds1 [p1+1] (one memset), the group sort, a third
// index buffer (the unique index sort uses it and the one the group sort left free),
// bounds3, ug, the cache buffer (E [e_cap][q1*r1], then P [cap][PSZ]).
struct TbBwdScratch {
  int* zeroed;
  size_t zeroed_bytes;
  int *ctrl, *bounds1, *bounds3, *vc, *ug;
  TbGroupSort sort;
  float* Pc;
  int cap, e_cap;
  size_t bytes;
};

TbBwdScratch tb_bwd_layout(const TbDev& d, int n, char* base) {
  TbBump bp{base};
  TbBwdScratch s;
  s.cap = tb_pcache_groups(d, n);
  const size_t nctrl = 2 + 2 * (size_t)tb_dg3_passes(s.cap, n);
  s.zeroed_bytes = sizeof(int) * (nctrl + (size_t)d.p1 + 1);
  s.zeroed = bp.take<int>(nctrl + (size_t)d.p1 + 1);
  s.ctrl = s.zeroed;
  s.bounds1 = s.zeroed ? s.zeroed + nctrl : nullptr;
  s.sort = tb_group_sort_layout(bp, d, n);
  s.bounds3 = bp.take<int>((size_t)d.p3 + 1);
  s.vc = bp.take<int>(n);
  s.ug = bp.take<int>(n);
  s.e_cap = tb_e_groups(d, n);
  s.Pc = bp.take<float>(std::max((size_t)s.cap * d.PSZ, (size_t)std::max(s.e_cap, 0) * d.Q1R1));
  s.bytes = bp.off + 256;
  return s;
}

}  // namespace

const char* tb_check_dims(const TbDims& t) {
  if (t.p1 < 1 || t.p2 < 1 || t.p3 < 1 || t.q1 < 1 || t.q2 < 1 || t.q3 < 1 || t.r1 < 1 || t.r2 < 1)
    return "flowtt_tb CUDA: every core extent must be >= 1";
  if (t.q1 > kTbQ1Max || t.q1 * t.q2 > kTbMMax || t.q3 > kTbQ3Max || t.r1 > kTbRMax ||
      t.r2 > kTbRMax)
    return "flowtt_tb CUDA: unsupported core shape (need q1 <= 8, q1*q2 <= 16, q3 <= 8, "
           "r1 <= 64, r2 <= 64); use impl='reference'";
  const TbDev d = tb_dev(t);
  if (d.R1K > kTbMaxG2Row || tb_dg2_smem(d) > kTbDg2SmemCap || tb_dg1_geo(d).R == 0)
    return "flowtt_tb CUDA: g2 rows too large for the kernels' shared memory (need "
           "r1*q2*r2 <= 24576); use impl='reference'";
  return nullptr;
}

bool tb_has_fixed_dims(const TbDims& t) {
  return tb_with_dims(tb_dev(t), true, [](auto d) { return decltype(d)::kFixed; });
}

size_t tb_rows_fwd_scratch_bytes(const TbDims& t, int n) {
  return tb_fwd_layout(tb_dev(t), n, nullptr).bytes;
}

cudaError_t tb_rows_fwd(const TbDims& t, const float* g1, const float* g2, const float* g3,
                        const int* u_i3, const int* g_i1, const int* g_i2, const int* group_offsets,
                        const int* counts, int n, float* rows, void* scratch, cudaStream_t stream,
                        bool tiles, bool fixed_dims) {
  const TbDev rt = tb_dev(t);
  const TbFwdScratch s = tb_fwd_layout(rt, n, tb_base(scratch));
  cudaError_t err = cudaMemsetAsync(s.ctr, 0, 2 * sizeof(int), stream);
  if (err != cudaSuccess) return err;
  const TbTileGeo geo = tb_tile_geo(rt, kTbTileSmemCap);
  const int* sorted = nullptr;
  int* free_buf;
  const bool tile =
      tiles && geo.GB > 0 && tb_aligned16(g2) && tb_aligned16(g3) && tb_aligned16(rows);
  if (tile && (err = tb_sort_groups(rt, s.sort, g_i2, counts, n, &sorted, &free_buf, stream)) !=
                  cudaSuccess)
    return err;
  return tb_with_dims(rt, fixed_dims, [&](auto d) {
    using DD = decltype(d);
    if (tile) {  // GB > 0 at either batch cap
      const TbTileGeo dgeo =
          tb_tile_geo(d, kTbTileSmemCap, DD::kFixed ? kTbFwdFixedGroups : kTbTileGroups);
      const size_t smem = std::max(dgeo.smem, tb_warp_slices_bytes(d));
      return tb_launch(TB_TILE_KERNEL(d.q3, DD), smem, stream, d, dgeo, g1, g2, g3, u_i3, g_i1,
                       g_i2, group_offsets, counts, n, (const int*)s.sort.bounds2, sorted, s.ctr,
                       rows);
    }
    const bool vec = d.K % 4 == 0 && tb_aligned16(g2);
    auto kernel = vec ? TB_BY_Q1(tb_fwd_kernel, 4, d.q1, DD) : TB_BY_Q1(tb_fwd_kernel, 1, d.q1, DD);
    return tb_launch(kernel, tb_warp_slices_bytes(d), stream, d, g1, g2, g3, u_i3, g_i1, g_i2,
                     group_offsets, counts, n, s.ctr, rows);
  });
}

size_t tb_rows_bwd_scratch_bytes(const TbDims& t, int n) {
  return tb_bwd_layout(tb_dev(t), n, nullptr).bytes;
}

cudaError_t tb_rows_bwd(const TbDims& t, const float* g1, const float* g2, const float* g3,
                        const float* d_rows, const int* u_i3, const int* g_i1, const int* g_i2,
                        const int* group_offsets, const int* counts, int n, float* dg1, float* dg2,
                        float* dg3, void* scratch, cudaStream_t stream, unsigned stages,
                        bool fixed_dims) {
  const TbDev rt = tb_dev(t);
  const TbBwdScratch s = tb_bwd_layout(rt, n, tb_base(scratch));
  cudaError_t err;
  if ((err = cudaMemsetAsync(s.zeroed, 0, s.zeroed_bytes, stream)) != cudaSuccess) return err;
  // the group of each unique index; the groups by g_i2 and the bounds of the g2 rows; the
  // bounds of the g1 rows; the unique indices by u_i3 and the bounds of the g3 rows
  const int bblocks = tb_grid_stride_blocks(n);
  tb_ug_kernel<<<bblocks, 256, 0, stream>>>(group_offsets, counts, n, s.ug);
  const int* sorted_groups;
  int* free_buf;
  if ((err = tb_sort_groups(rt, s.sort, g_i2, counts, n, &sorted_groups, &free_buf, stream)) !=
      cudaSuccess)
    return err;
  tb_bounds_kernel<<<bblocks, 256, 0, stream>>>(nullptr, g_i1, counts, 1, n, rt.p1, s.bounds1);
  int *out = free_buf, *alt = s.vc;
  if ((err = tb_radix_sort(s.sort.tmp, u_i3, rt.p3, counts, 0, n, &out, &alt, stream)) !=
      cudaSuccess)
    return err;
  const int* sorted_u = out;
  int* sg = alt;  // free after the sort: the group of each sorted unique index
  tb_bounds_kernel<<<bblocks, 256, 0, stream>>>(out, u_i3, counts, 0, n, rt.p3, s.bounds3);
  tb_sorted_groups_kernel<<<bblocks, 256, 0, stream>>>(sorted_u, s.ug, counts, n, sg);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  return tb_with_dims(rt, fixed_dims, [&](auto d) -> cudaError_t {
    using DD = decltype(d);
    // dg2, and with it the dg1 terms E of every group (when they fit), then dg1: the sums
    // of E per g1 row, or the merge kernel (each returns at once when the other runs)
    const bool vec_g2 = d.K % 4 == 0 && tb_aligned16(g2);
    if (stages & 3) {
      const int stage_vec =
          (int)(d.D % 4 == 0 && d.S3 % 4 == 0 && tb_aligned16(d_rows) && tb_aligned16(g3));
      float* E = s.e_cap >= 0 ? s.Pc : nullptr;
      if (tb_dg2_mma_tiles(d) > 0 && tb_aligned16(dg2)) {
        const int nbatch = tb_dg2_mma_batch(d, s.e_cap >= 0);
        err = tb_launch(&tb_dg2_mma_kernel<DD>, tb_dg2_mma_smem(d, s.e_cap >= 0, nbatch), stream, d,
                        g1, g2, g3, d_rows, u_i3, g_i1, group_offsets, counts, n,
                        (const int*)s.sort.bounds2, sorted_groups, s.e_cap, stage_vec, nbatch,
                        s.ctrl + 1, dg2, E);
      } else {
        const bool vec = d.K % 4 == 0 && d.r1 % 4 == 0 && tb_aligned16(dg2);
        auto kernel =
            vec ? TB_BY_Q1(tb_dg2_kernel, 4, d.q1, DD) : TB_BY_Q1(tb_dg2_kernel, 1, d.q1, DD);
        const int nbatch = tb_dg2_batch(d, s.e_cap >= 0);
        err = tb_launch(kernel, tb_dg2_smem(d, s.e_cap >= 0, nbatch), stream, d, g1, g2, g3, d_rows,
                        u_i3, g_i1, group_offsets, counts, n, (const int*)s.sort.bounds2,
                        sorted_groups, (int)vec_g2, s.e_cap, stage_vec, nbatch, s.ctrl + 1, dg2, E);
      }
      if (err != cudaSuccess) return err;
    }
    if (stages & 1) {
      if (s.e_cap >= 0) {
        const long long total = (long long)d.p1 * d.Q1R1;
        const int blocks = (int)std::max<long long>(
            1, std::min<long long>(total / 256 + 1, (long long)tb_num_sms() * 8));
        tb_dg1_reduce_kernel<DD><<<blocks, 256, 0, stream>>>(d, (const float*)s.Pc, s.e_cap, counts,
                                                             n, (const int*)s.bounds1, dg1);
        if ((err = cudaGetLastError()) != cudaSuccess) return err;
      }
      const TbDg1Geo geo = tb_dg1_geo(d);
      auto kernel =
          vec_g2 ? TB_BY_Q1(tb_dg1_kernel, 4, d.q1, DD) : TB_BY_Q1(tb_dg1_kernel, 1, d.q1, DD);
      if ((err = tb_launch(kernel, geo.smem, stream, d, geo, g2, g3, d_rows, u_i3, g_i2,
                           group_offsets, counts, n, (const int*)s.bounds1, s.e_cap, s.ctrl + 0,
                           dg1)) != cudaSuccess)
        return err;
    }
    if (stages & 4) {
      // per pass: P of the pass's cap groups once (bitwise the P dg3 would form), then dg3
      // over the ids of those groups
      const int cap = tb_aligned16(g2) ? s.cap : 0;
      const TbTileGeo geo = tb_tile_geo(d, kTbTileSmemCap);
      auto kernel =
          vec_g2 ? TB_BY_Q1(tb_dg3_kernel, 4, d.q1, DD) : TB_BY_Q1(tb_dg3_kernel, 1, d.q1, DD);
      for (int pass = 0, passes = tb_dg3_passes(cap, n); pass < passes; ++pass) {
        const int glo = pass * cap;  // < n
        int* ctr = s.ctrl + 2 + 2 * pass;
        if (cap > 0 && (err = tb_launch(&tb_pcache_kernel<DD>, tb_pcache_smem(d, geo), stream, d,
                                        geo, g1, g2, g_i1, counts, n, (const int*)s.sort.bounds2,
                                        sorted_groups, glo, cap, ctr, s.Pc)) != cudaSuccess)
          return err;
        if ((err = tb_launch(kernel, tb_dg3_smem(d), stream, d, g1, g2, d_rows, g_i1, g_i2, counts,
                             n, (const int*)s.bounds3, sorted_u, (const int*)sg, (const float*)s.Pc,
                             glo, cap, (int)(d.D % 4 == 0 && tb_aligned16(d_rows)), ctr + 1,
                             dg3)) != cudaSuccess)
          return err;
      }
    }
    return cudaSuccess;
  });
}

}  // namespace flowtt::tb
