// The CUDA table-batched kernels (cuda/batched/tb_fwd_kernels.cuh, cuda/batched/tb_bwd_kernels.cuh,
// cuda/batched/tb_dg3_kernels.cuh) run on the CPU through the emulation of tests/native/tb_emu.h,
// against the float64 oracle (tests/native/tb_testing.h): checks the kernels' indexing, batching,
// barriers and shuffle trees where no GPU is at hand. The launch sequence mirrors
// cuda/batched/tb_rows.cu; the radix sort is also checked against std::stable_sort. Build and run
// (repository root):
//   g++ -std=c++17 -O2 -Icuda -Itests/native tests/native/tb_rows_emu_test.cc -o tb_rows_emu_test
//   ./tb_rows_emu_test     (add -fsanitize=address,undefined: invalid plans must not read
//                           out of bounds)
// Each standard case runs with the vectorised (float4) paths where the dims allow and
// again with the scalar paths. Prints PASS/FAIL lines; exit status 1 on any failure.
#include "tb_emu.h"  // first (its own block, kept first by clang-format): the CUDA built-ins

#include "batched/tb_bwd_kernels.cuh"
#include "batched/tb_dg2_mma_kernel.cuh"
#include "batched/tb_dg3_kernels.cuh"
#include "batched/tb_fwd_kernels.cuh"
#include "batched/tb_sort.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "tb_testing.h"

namespace {

using namespace flowtt::tb;
using namespace flowtt::tb::testing;

constexpr int kGrid = 2;  // persistent kernels: block 0 steals every item, block 1 none

struct Inputs {
  TbDev d;
  int n;
  const float *g1, *g2, *g3, *d_rows;
  const int *u_i3, *g_i1, *g_i2, *goffs, *counts;
};

// tb_rows_fwd: rows [n, D], the kernels' instances for dims type DD (TbDev, or the
// TbFixedDims of in.d).
template <class DD>
void EmuFwd(const Inputs& in, const DD& d, bool vec, float* rows) {
  int ctr = 0;
  auto kernel = vec && d.K % 4 == 0 ? TB_BY_Q1(tb_fwd_kernel, 4, d.q1, DD)
                                    : TB_BY_Q1(tb_fwd_kernel, 1, d.q1, DD);
  tb_emu_launch(kGrid, kTbThreads, tb_warp_slices_bytes(d), kernel, d, in.g1, in.g2, in.g3, in.u_i3,
                in.g_i1, in.g_i2, in.goffs, in.counts, in.n, &ctr, rows);
}

// Sorted-tile forward (when the dims take it): the group sort, then the tile kernel.
template <class DD>
void EmuFwdTile(const Inputs& in, const DD& d, const TbTileGeo& geo, float* rows);

// tb_radix_sort: the indices [0, num_groups) (which == 1) / [0, num_unique) (which == 0)
// stably sorted by key_src[i] clamped into [0, P).
std::vector<int> EmuRadixSort(const int* key_src, int P, const int* counts, int which, int n) {
  const int tiles = tb_sort_tiles(n);
  // hist and totals poisoned (only the live tiles' entries may be read); a grid smaller
  // than the tiles, so blocks stride over them
  std::vector<int> hist((size_t)kTbRadix * tiles, -1 << 20), totals(kTbRadix, -1 << 20);
  std::vector<int> out(n, -7), in;
  const int grid = std::max(1, std::min(tiles, 3));
  const TbSortPasses passes = tb_sort_passes(P - 1);
  for (int pass = 0; pass < passes.count; ++pass) {
    const TbSortPass ps = tb_sort_pass(passes, pass);
    const int shift = ps.shift, bits = ps.bits;
    const int* vals = in.empty() ? nullptr : in.data();
    tb_emu_launch(grid, kTbThreads, 0, tb_radix_hist_kernel, vals, key_src, P - 1, counts, which, n,
                  shift, bits, tiles, hist.data());
    tb_emu_launch(tb_sort_slots(bits), kTbThreads, 0, tb_radix_scan_kernel, counts, which, n, tiles,
                  hist.data(), totals.data());
    tb_emu_launch(grid, kTbThreads, 0, tb_radix_scatter_kernel, vals, key_src, P - 1, counts, which,
                  n, shift, bits, tiles, (const int*)hist.data(), (const int*)totals.data(),
                  out.data());
    in = out;
  }
  return in;
}

template <class DD>
void EmuFwdTile(const Inputs& in, const DD& d, const TbTileGeo& geo, float* rows) {
  const int n = in.n;
  std::vector<int> ctr(2, 0), bounds2(d.p2 + 1);
  const std::vector<int> sorted = EmuRadixSort(in.g_i2, d.p2, in.counts, 1, n);
  tb_emu_launch(kGrid, 256, 0, tb_bounds_kernel, sorted.data(), in.g_i2, in.counts, 1, n, d.p2,
                bounds2.data());
  tb_emu_launch(kGrid, kTbThreads, std::max(geo.smem, tb_warp_slices_bytes(d)),
                TB_TILE_KERNEL(d.q3, DD), d, geo, in.g1, in.g2, in.g3, in.u_i3, in.g_i1, in.g_i2,
                in.goffs, in.counts, n, (const int*)bounds2.data(), sorted.data(), ctr.data(),
                rows);
}

// tb_rows_bwd: dg2 (and the dg1 terms E when e_cap >= 0), dg1 (the sums of E when
// num_groups <= e_cap, else the merge kernel with geometry dg1_geo), dg3 (the P of the
// groups from the P cache built by tb_pcache_kernel with geometry pgeo, `cap` groups per
// pass, when the dims take it and vec, else formed by dg3 in one pass). E and the P cache
// share one buffer.
template <class DD>
void EmuBwd(const Inputs& in, const DD& d, bool vec, const TbDg1Geo& dg1_geo, float* dg1,
            float* dg2, float* dg3, int cap = 0, TbTileGeo pgeo = {}, int e_cap = -1,
            int nbatch = 8) {
  const int n = in.n;
  std::vector<int> ctrl(2, 0), bounds1(d.p1 + 1, 0), bounds2(d.p2 + 1), bounds3(d.p3 + 1);
  std::vector<int> ug(n, -1);
  tb_emu_launch(kGrid, 256, 0, tb_ug_kernel, in.goffs, in.counts, n, ug.data());
  const std::vector<int> sorted_groups = EmuRadixSort(in.g_i2, d.p2, in.counts, 1, n);
  tb_emu_launch(kGrid, 256, 0, tb_bounds_kernel, sorted_groups.data(), in.g_i2, in.counts, 1, n,
                d.p2, bounds2.data());
  tb_emu_launch(kGrid, 256, 0, tb_bounds_kernel, (const int*)nullptr, in.g_i1, in.counts, 1, n,
                d.p1, bounds1.data());
  const std::vector<int> sorted_u = EmuRadixSort(in.u_i3, d.p3, in.counts, 0, n);
  tb_emu_launch(kGrid, 256, 0, tb_bounds_kernel, sorted_u.data(), in.u_i3, in.counts, 0, n, d.p3,
                bounds3.data());
  std::vector<int> sg(n, -1);
  tb_emu_launch(kGrid, 256, 0, tb_sorted_groups_kernel, sorted_u.data(), (const int*)ug.data(),
                in.counts, n, sg.data());
  if (!vec || pgeo.GB == 0) cap = 0;
  // NaN: an E or a P read but not written shows
  std::vector<float> cache(std::max((size_t)cap * d.PSZ, (size_t)std::max(e_cap, 0) * d.Q1R1), NAN);
  const bool vec_g2 = vec && d.K % 4 == 0;
  const int stage_vec = (int)(vec && d.D % 4 == 0 && d.S3 % 4 == 0);
  float* E = e_cap >= 0 ? cache.data() : nullptr;
  if (vec && tb_dg2_mma_tiles(d) > 0) {  // the launcher's choice (cuda/batched/tb_rows.cu)
    tb_emu_launch(kGrid, kTbThreads, tb_dg2_mma_smem(d, e_cap >= 0, nbatch), tb_dg2_mma_kernel<DD>,
                  d, in.g1, in.g2, in.g3, in.d_rows, in.u_i3, in.g_i1, in.goffs, in.counts, n,
                  (const int*)bounds2.data(), sorted_groups.data(), e_cap, stage_vec, nbatch,
                  &ctrl[1], dg2, E);
  } else {
    auto k2 = vec && d.K % 4 == 0 && d.r1 % 4 == 0 ? TB_BY_Q1(tb_dg2_kernel, 4, d.q1, DD)
                                                   : TB_BY_Q1(tb_dg2_kernel, 1, d.q1, DD);
    tb_emu_launch(kGrid, kTbThreads, tb_dg2_smem(d, e_cap >= 0, nbatch), k2, d, in.g1, in.g2, in.g3,
                  in.d_rows, in.u_i3, in.g_i1, in.goffs, in.counts, n, (const int*)bounds2.data(),
                  sorted_groups.data(), (int)vec_g2, e_cap, stage_vec, nbatch, &ctrl[1], dg2, E);
  }
  if (e_cap >= 0)
    tb_emu_launch(kGrid, 256, 0, tb_dg1_reduce_kernel<DD>, d, (const float*)cache.data(), e_cap,
                  in.counts, n, (const int*)bounds1.data(), dg1);
  auto k1 = vec_g2 ? TB_BY_Q1(tb_dg1_kernel, 4, d.q1, DD) : TB_BY_Q1(tb_dg1_kernel, 1, d.q1, DD);
  tb_emu_launch(kGrid, kTbThreads, dg1_geo.smem, k1, d, dg1_geo, in.g2, in.g3, in.d_rows, in.u_i3,
                in.g_i2, in.goffs, in.counts, n, (const int*)bounds1.data(), e_cap, &ctrl[0], dg1);
  auto k3 = vec_g2 ? TB_BY_Q1(tb_dg3_kernel, 4, d.q1, DD) : TB_BY_Q1(tb_dg3_kernel, 1, d.q1, DD);
  // the passes of tb_rows.cu, up to the first past num_groups (the later ones return at
  // once as it does)
  const int passes = tb_dg3_passes(cap, n);
  for (int pass = 0; pass < passes && (pass == 0 || (pass - 1) * cap < in.counts[1]); ++pass) {
    int ctr[2] = {0, 0};
    std::fill(cache.begin(), cache.end(), NAN);
    if (cap > 0)
      tb_emu_launch(kGrid, kTbThreads, tb_pcache_smem(d, pgeo), tb_pcache_kernel<DD>, d, pgeo,
                    in.g1, in.g2, in.g_i1, in.counts, n, (const int*)bounds2.data(),
                    sorted_groups.data(), pass * cap, cap, &ctr[0], cache.data());
    tb_emu_launch(kGrid, kTbThreads, tb_dg3_smem(d), k3, d, in.g1, in.g2, in.d_rows, in.g_i1,
                  in.g_i2, in.counts, n, (const int*)bounds3.data(), sorted_u.data(),
                  (const int*)sg.data(), (const float*)cache.data(), pass * cap, cap,
                  (int)(vec && d.D % 4 == 0), &ctr[1], dg3);
  }
}

// The radix sort against std::stable_sort: n entries, the first `count` live, keys in
// [0, P) (many ties; some outside, clamped like the kernels do).
void CheckSort(int n, int count, int P, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> keys(n);
  for (int j = 0; j < n; ++j) keys[j] = (int)(rng() % (j % 5 == 0 ? 7 : P + 2)) - (j % 11 == 0);
  std::vector<int> ref(count);
  std::iota(ref.begin(), ref.end(), 0);
  auto key = [&](int i) { return std::min(std::max(keys[i], 0), P - 1); };
  std::stable_sort(ref.begin(), ref.end(), [&](int a, int b) { return key(a) < key(b); });
  const std::vector<int> counts = {count, count};
  const std::vector<int> got = EmuRadixSort(keys.data(), P, counts.data(), 0, n);
  TbReport(std::equal(ref.begin(), ref.end(), got.begin()),
           "radix sort: n=" + std::to_string(n) + " count=" + std::to_string(count) +
               " P=" + std::to_string(P) + " equals std::stable_sort");
}

struct Run {
  TbCores k;
  std::vector<float> d_rows;
  Inputs in;
};

Run MakeRun(const TbCase& c, const TbHostPlan& p, uint64_t seed) {
  Run r;
  r.k = TbRandomCores(c.s, seed);
  const int64_t D = c.s.dim();
  r.d_rows = TbRandom(p.n * D, seed + 7);
  for (int64_t i = int64_t(p.U) * D; i < p.n * D; ++i) r.d_rows[i] = NAN;  // never read
  r.in = {tb_dev(c.s),     (int)p.n,      r.k.g1.data(), r.k.g2.data(), r.k.g3.data(),
          r.d_rows.data(), p.u_i3.data(), p.g_i1.data(), p.g_i2.data(), p.group_offsets.data(),
          p.counts.data()};
  return r;
}

// One case on the kernels' instances for dims type DD: the forward (chunks, sorted tiles)
// and backward (three configurations) against the oracle, dg1 / dg2 / dg3 bitwise equal
// across the configurations. Returns every output, for RunCaseAllDims's comparison.
template <class DD>
std::vector<std::vector<float>> RunCase(const TbCase& c, const TbHostPlan& p, bool vec,
                                        const DD& d) {
  const std::string tag = c.name + (vec ? " [vec" : " [scalar") +
                          (DD::kFixed ? ", compile-time dims]" : "]") +
                          " (n=" + std::to_string(p.n) + " U=" + std::to_string(p.U) +
                          " G=" + std::to_string(p.G) + ")";
  Run r = MakeRun(c, p, 11);
  const int64_t D = c.s.dim();
  std::vector<float> rows(p.n * D, NAN);
  std::vector<std::vector<float>> outs;
  EmuFwd(r.in, d, vec, rows.data());
  outs.push_back(rows);
  const std::vector<double> ref = TbRefRows(c, p, r.k);
  const double e_rows = TbRelErr(rows.data(), ref.data(), ref.size());
  char buf[160];
  std::snprintf(buf, sizeof buf, " fwd (chunks) rel err %.2e", e_rows);
  TbReport(e_rows < kTbTol, tag + buf);
  // the sorted-tile forward: its geometries (the run-time and the compile-time dims
  // instances'), and batches of 4 groups (runs longer than a batch)
  for (int max_groups : {kTbTileGroups, kTbFwdFixedGroups, 4}) {
    const TbTileGeo geo = tb_tile_geo(r.in.d, 100 * 1024, max_groups);
    if (!vec || geo.GB == 0) break;
    std::fill(rows.begin(), rows.end(), NAN);
    EmuFwdTile(r.in, d, geo, rows.data());
    outs.push_back(rows);
    const double e = TbRelErr(rows.data(), ref.data(), ref.size());
    std::snprintf(buf, sizeof buf, " fwd (tiles of %d groups) rel err %.2e", geo.GB, e);
    TbReport(e < kTbTol, tag + buf);
  }
  std::vector<double> r1, r2, r3;
  TbRefGrads(c, p, r.k, r.d_rows, &r1, &r2, &r3);
  // the default dg1 geometry with every P cached (default P cache geometry) and the dg1
  // terms path; a small merge geometry (8 rows, one g2 row and 8 groups per step) with the
  // P cache of a third of the groups (dg3 in passes; batches of 4 groups) and E too small
  // (the merge kernel runs); then no P cached and no E: dg1 and dg3 bitwise equal across
  // the runs
  const int n = (int)p.n;
  const TbTileGeo pg_full = tb_tile_geo(r.in.d, 100 * 1024),
                  pg_small = tb_tile_geo(r.in.d, 100 * 1024, 4);
  struct Cfg {
    TbDg1Geo geo;
    int cap;
    TbTileGeo pgeo;
    int e_cap;
    int nbatch;
  };
  std::vector<std::vector<float>> dg1s, dg2s, dg3s;
  int caps[3];
  int ci = 0;
  for (Cfg cfg : {Cfg{tb_dg1_geo(r.in.d), n, pg_full, n, tb_dg2_batch(r.in.d, true)},
                  Cfg{TbDg1Geo{8, 1, 8, 0}, p.G / 3, pg_small, p.G - 1, 8},
                  Cfg{tb_dg1_geo(r.in.d), 0, TbTileGeo{}, -1, kTbBatch}}) {
    TbDg1Geo geo = cfg.geo;
    if (geo.smem == 0)
      geo.smem = sizeof(float) *
                 (tb_align4(r.in.d.R1K) + tb_align4(8 * r.in.d.Q1R1) + 8 * (size_t)r.in.d.PSZ);
    std::vector<float> dg1(r.k.g1.size(), NAN), dg2(r.k.g2.size(), NAN), dg3(r.k.g3.size(), NAN);
    const int cap = vec && cfg.pgeo.GB > 0 ? cfg.cap : 0;
    caps[ci++] = cap;
    EmuBwd(r.in, d, vec, geo, dg1.data(), dg2.data(), dg3.data(), cap, cfg.pgeo, cfg.e_cap,
           cfg.nbatch);
    const double e1 = TbRelErr(dg1.data(), r1.data(), r1.size());
    const double e2 = TbRelErr(dg2.data(), r2.data(), r2.size());
    const double e3 = TbRelErr(dg3.data(), r3.data(), r3.size());
    std::snprintf(buf, sizeof buf,
                  " bwd (dg1 %s, dg2 batches of %d, P cache %d groups) rel err dg1 %.2e dg2 "
                  "%.2e dg3 %.2e",
                  p.G <= cfg.e_cap ? "terms" : "merge", cfg.nbatch, cap, e1, e2, e3);
    TbReport(e1 < kTbTol && e2 < kTbTol && e3 < kTbTol, tag + buf);
    dg1s.push_back(std::move(dg1));
    dg2s.push_back(std::move(dg2));
    dg3s.push_back(std::move(dg3));
  }
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  if (vec && tb_dg2_mma_tiles(d) > 0)  // E on tensor cores: the merge's terms are FMA sums
    TbReport(same(dg1s[1], dg1s[2]),
             tag + " dg1 of the merge kernel bitwise equal across geometries");
  else
    TbReport(same(dg1s[0], dg1s[2]) && same(dg1s[1], dg1s[2]),
             tag + " dg1 from the terms E bitwise equal to the merge kernel's");
  // the tensor-core dP sums each staging round's ids in k-steps, so its bits follow the
  // rounds, which follow the batch size (fixed per dims: deterministic, not batch-free)
  const bool mma_dp = vec && tb_dg2_mma_tiles(d) > 0 && tb_dg2_mma_dp(d);
  if (!mma_dp)
    TbReport(same(dg2s[0], dg2s[2]) && same(dg2s[1], dg2s[2]),
             tag + " dg2 bitwise equal across batch sizes (8, 16)");
  if (tb_pcache_mma(d)) {  // P on tensor cores: not the FMA chain, so only cached runs compare
    if (caps[0] > 0 && caps[1] > 0)
      TbReport(same(dg3s[0], dg3s[1]),
               tag +
                   " dg3 with the P cache bitwise equal across passes and batches (all groups "
                   "in one pass / a third per pass in batches of 4)");
  } else if (caps[0] > 0 || caps[1] > 0) {
    TbReport(same(dg3s[0], dg3s[2]) && same(dg3s[1], dg3s[2]),
             tag +
                 " dg3 with the P cache (all groups in one pass / a third per pass) bitwise "
                 "equal to dg3 recomputing P");
  }
  for (auto* v : {&dg1s, &dg2s, &dg3s}) outs.insert(outs.end(), v->begin(), v->end());
  return outs;
}

// RunCase on the instances the launchers take for the case's dims; for dims compiled in
// (TB_FIXED_SHAPES) also on the run-time dims instances, every output bitwise equal.
void RunCaseAllDims(const TbCase& c, const TbHostPlan& p, bool vec) {
  const TbDev rt = tb_dev(c.s);
  tb_with_dims(rt, true, [&](auto d) {
    const auto a = RunCase(c, p, vec, d);
    if constexpr (decltype(d)::kFixed) {
      const auto b = RunCase(c, p, vec, rt);
      bool same = a.size() == b.size();
      for (size_t i = 0; same && i < a.size(); ++i)
        same = a[i].size() == b[i].size() &&
               std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) == 0;
      TbReport(same, c.name + (vec ? " [vec]" : " [scalar]") +
                         " compile-time dims: every output bitwise equal to the run-time dims "
                         "kernels'");
    }
  });
}

// Invalid plans: the kernels finish and (under the address sanitizer) read nothing out of
// bounds. On small cases (the emulated barriers are slow): `which` of the standard ones.
void InvalidPlans(int which) {
  const TbCase c = TbStandardCases()[which];
  auto check = [&](const std::string& what, const TbHostPlan& p) {
    Run r = MakeRun(c, p, 5);
    std::vector<float> rows(p.n * c.s.dim()), dg1(r.k.g1.size()), dg2(r.k.g2.size()),
        dg3(r.k.g3.size());
    const TbTileGeo geo = tb_tile_geo(r.in.d, 100 * 1024);
    const TbTileGeo small = tb_tile_geo(r.in.d, 100 * 1024, 4);
    auto run = [&](auto d) {  // the launchers' instances and, for compiled-in dims, TbDev's
      EmuFwd(r.in, d, true, rows.data());
      if (geo.GB > 0) EmuFwdTile(r.in, d, geo, rows.data());
      EmuBwd(r.in, d, true, tb_dg1_geo(r.in.d), dg1.data(), dg2.data(), dg3.data(), (int)p.n, geo,
             (int)p.n, kTbBatch);
      // dg3 in passes (a third of n per pass) and the merge dg1
      EmuBwd(r.in, d, true, tb_dg1_geo(r.in.d), dg1.data(), dg2.data(), dg3.data(),
             std::max(1, (int)p.n / 3), small, -1, 8);
      return decltype(d)::kFixed;
    };
    if (tb_with_dims(r.in.d, true, run)) run(r.in.d);
    TbReport(true, "invalid plan, finished: " + c.name + ", " + what);
  };
  TbForEachInvalidPlan(TbMakePlan(c, kTbPad), kTbPad, check);
}

}  // namespace

int main() {
  CheckSort(1, 1, 1, 1);
  CheckSort(5000, 0, 300, 2);
  CheckSort(9000, 4097, 1 << 20, 3);  // three passes, a partial last tile
  CheckSort(30000, 29999, 3000, 4);
  CheckSort(30000, 12000, 70000, 5);    // live tiles past the grid, dead tiles after them
  CheckSort(20000, 15000, 1 << 18, 6);  // two 9-bit passes (512 slots)
  for (const TbCase& c : TbStandardCases()) {
    const TbHostPlan p = TbMakePlan(c, kTbPad);
    RunCaseAllDims(c, p, true);
    RunCaseAllDims(c, p, false);
  }
  {  // num_unique = 0
    const auto [c, p] = TbNoUniqueIdsCase(kTbPad);
    RunCaseAllDims(c, p, true);
  }
  InvalidPlans(2);  // the scalar paths
  InvalidPlans(4);  // the vector paths and the sorted-tile forward, both dims instances
  return TbExitStatus();
}
