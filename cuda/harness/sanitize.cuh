// `flowtt_harness --sanitize [SUBSTR]`: small cases that launch every kernel of the library
// once or more, for compute-sanitizer (scripts/gpu_race.sh runs it under memcheck, racecheck,
// synccheck and initcheck). Included by cuda/harness/harness.cu after its helpers (make_plan,
// run_case, rel_err, CK), so it is one more mode of the cmake target flowtt_harness. Every result
// is checked against a host reference (the harness's own, and tests/native/tb_testing.h's float64
// oracle for the table-batched ops); the exit status is 1 on any mismatch.
//
// Sized for racecheck (the timing cases' 27,549-id case took the sanitizer's host memory past
// 128 GiB): a few hundred to 1,500 ids a case. `SUBSTR`: only the cases whose name holds it.
//   1. single-table ops (run_case: rows_fwd, bag_pool_fwd, bag_pool_bwd, rows_bwd twice, bag_fwd
//      in one chunk and in chunks of 64, 128, 1024 rows), over the kernels' shape tables: the
//      GEMM tile kernels at each (M, Q3) of GemmShapes (narrow and wide backward CTAs, blocked
//      dG3 with BW 4 and 2), the warp kernels at each WarpFwdShapes / WarpBwdShapes entry and
//      the generic ones; hot prefix groups of more than kCH = 64 unique ids (the forward's
//      checkpoint path, a group split across bag_fwd's chunks);
//   2. flowtt_plan: the full plan (sort), the forward-only plan by the table's bitmap and by
//      the sort, ids out of range (clamped), one id; against the harness's make_plan;
//   3. the pooling ops alone, in windows of uniques lo = 0, C, 2C, ... (C below the uniques,
//      windows past them), weighted and not, batch-major output rows, prev copied and
//      aliased, D = 37 (scalar lanes; d_weights by its own kernel) and D = 132 (float4 lanes,
//      d_weights by its own kernel), one id of 1,100 positions (a run of more than kHotL
//      chunk partials: pass 3);
//   4. the table-batched op in capacity passes as flowtt_jax.ops.pooled runs it: flowtt_tb_bags
//      (both policies, against cpu::MakeTbBags), flowtt_tb_plan (prefix keys, row keys, 64-bit
//      keys: the same plan), then per window of C uniques flowtt_tb_window, flowtt_tb_rows_fwd,
//      flowtt_bag_pool_fwd onto the previous pass (window lo, counts-capped), and in the
//      backward flowtt_tb_window, flowtt_tb_rows_fwd (weighted), flowtt_bag_pool_bwd of the
//      window (pass 1 over the window's sorted positions only), flowtt_tb_rows_bwd, gradients
//      summed over the passes; windows past the uniques (empty) included;
//   5. flowtt_tb_rows_fwd / _bwd over their paths: compile-time and run-time dims (bitwise
//      equal), sorted-tile and chunked forward, dg2 on tensor cores (with and without the dP
//      rounds on them) and on the FMA pipes, dg1 by E and by the merge kernel, the P cache
//      (tensor-core and FMA) and dg3 without it, float4 and scalar kernels (misaligned
//      operands), q1 in {1, 2, 4, 8, 3}, tables sharing packed g2 rows, one group of every id.
// Not reachable here: dg3 in several P-cache passes (needs a build with a small
// FLOWTT_TB_PCACHE_MB: 2 GiB holds every group of these cases), and the profiling builds'
// partial stage masks.
#pragma once

#include <cstdarg>
#include <functional>

#include "../../ffi/cpu/tb_bags.h"          // cpu::MakeTbBags (XLA-free, header only)
#include "../../tests/native/tb_testing.h"  // TbCase, TbMakePlan, the float64 oracle
#include "contract/plan_bitmap.h"
#include "contract/pool_layout.h"
#include "contract/tb_window.h"
#include "include/plan.h"
#include "include/tb_bags.h"
#include "include/tb_plan.h"
#include "include/tb_rows.h"

namespace sanitize {

namespace tt = flowtt::tb::testing;
using flowtt::PoolOutRow;
using flowtt::PoolWindow;

// A device buffer of count T, `offset` elements past a cudaMalloc'ed base (offset 1: a
// float buffer that is not 16-byte aligned, for the kernels' scalar paths).
template <typename T>
struct DBuf {
  T* base = nullptr;
  T* p = nullptr;
  size_t count = 0;
  explicit DBuf(size_t c, int offset = 0) : count(c) {
    CK(cudaMalloc(&base, (std::max<size_t>(c, 1) + offset) * sizeof(T)));
    p = base + offset;
  }
  explicit DBuf(const std::vector<T>& v, int offset = 0) : DBuf(v.size(), offset) { set(v); }
  ~DBuf() { cudaFree(base); }
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
  void set(const std::vector<T>& v) {
    if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> get(size_t c) const {
    std::vector<T> v(c);
    if (c) CK(cudaMemcpy(v.data(), p, c * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  std::vector<T> get() const { return get(count); }
  void fill(unsigned char byte) { CK(cudaMemset(p, byte, std::max<size_t>(count, 1) * sizeof(T))); }
  void poison() { fill(0xFF); }  // NaN for floats, -1 for ints
};

// One PASS / FAIL line (tb_testing.h's, which counts the failures); checks counts them all.
int checks = 0;
void report(bool ok, const std::string& what) {
  ++checks;
  tt::TbReport(ok, what);
}

void sync() {
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
}

// Relative L2 error of got[:count] against ref, +inf if got has a non-finite value there.
double rel(const std::vector<float>& got, const std::vector<double>& ref, size_t count = SIZE_MAX) {
  count = std::min({count, got.size(), ref.size()});
  return tt::TbRelErr(got.data(), ref.data(), count);
}

bool bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::vector<float> randn(std::mt19937_64& rng, size_t count, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(count);
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---- 1. single-table ops ----

// n ids of a table of N rows (row shape t): a share `hot` of them in `hot_groups` prefix
// groups spread over the table (uniform over each group's p3 rows: with p3 > 64 and enough
// ids, groups of more than kCH unique ids), the rest uniform, the last one the table's last row.
std::vector<int> hot_prefix_ids(std::mt19937_64& rng, const TTDims& t, long long N, int n,
                                double hot, int hot_groups) {
  const long long groups = std::max(1LL, N / t.p3), spacing = std::max(1LL, groups / hot_groups);
  std::uniform_real_distribution<double> x(0.0, 1.0);
  std::uniform_int_distribution<long long> any(0, N - 1);
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) {
    if (x(rng) < hot) {
      const long long g = std::min(groups - 1, (long long)(x(rng) * hot_groups) * spacing);
      ids[i] = (int)std::min(N - 1, g * t.p3 + (long long)(x(rng) * t.p3));
    } else {
      ids[i] = (int)any(rng);
    }
  }
  if (n > 1) ids[n - 1] = (int)(N - 1);
  return ids;
}

void single_table(std::mt19937_64& rng, const std::function<bool(const std::string&)>& want) {
  struct S {
    const char* name;
    TTDims t;
    int bags, maxlen;  // bags of U[0, maxlen] ids
    double hot;
    int hot_groups;
  };
  const S list[] = {
      // GEMM tile kernels, (M, Q3) = (8, 4), narrow backward CTA, dG3 blocked BW 4: three hot
      // groups of ~100 unique ids (checkpoints; split across bag_fwd's chunks)
      {"san_gemm_m8q4_r32_hot", {8, 10, 200, 2, 4, 4, 32, 32}, 70, 24, 0.6, 3},
      // (16, 8) at r 64: the wide backward CTA (FLOWTT_BWD_WIDE threads), dG3 BW 2, the
      // forward compiled for 2 CTAs per SM
      {"san_gemm_m16q8_r64_wide", {10, 10, 100, 4, 4, 8, 64, 64}, 40, 24, 0.7, 2},
      {"san_gemm_m4q4_r16", {10, 10, 100, 2, 2, 4, 16, 16}, 24, 20, 0.6, 2},
      {"san_gemm_m16q4_r16", {10, 10, 100, 4, 4, 4, 16, 16}, 24, 20, 0.6, 2},
      {"san_gemm_m4q8_r8", {10, 10, 100, 2, 2, 8, 8, 8}, 24, 20, 0.6, 2},
      {"san_gemm_m8q8_r16", {10, 10, 100, 2, 4, 8, 16, 16}, 24, 20, 0.6, 2},
      // warp kernels (r2 % 4 != 0: no GEMM tile): each WarpBwdShapes entry (BB 1 at r <= 32,
      // 2 past it), WarpFwdShapes q1 = 1, 2, 4, 8, the generic instances (q1 = 3)
      {"san_warp_q244_r30", {10, 10, 100, 2, 4, 4, 30, 30}, 24, 20, 0.6, 2},
      {"san_warp_q244_r42", {10, 10, 100, 2, 4, 4, 42, 42}, 24, 20, 0.6, 2},
      {"san_warp_q448_r30", {10, 10, 100, 4, 4, 8, 30, 30}, 24, 20, 0.6, 2},
      {"san_warp_q448_r42", {10, 10, 100, 4, 4, 8, 42, 42}, 24, 20, 0.6, 2},
      {"san_warp_q224_r30", {10, 10, 100, 2, 2, 4, 30, 30}, 24, 20, 0.6, 2},
      {"san_warp_q224_r42", {10, 10, 100, 2, 2, 4, 42, 42}, 24, 20, 0.6, 2},
      {"san_warp_q444_r30", {10, 10, 100, 4, 4, 4, 30, 30}, 24, 20, 0.6, 2},
      {"san_warp_q444_r42", {10, 10, 100, 4, 4, 4, 42, 42}, 24, 20, 0.6, 2},
      {"san_warp_generic_q315_r5_7", {10, 10, 100, 3, 1, 5, 5, 7}, 24, 20, 0.6, 2},
      {"san_warp_q133_r5", {10, 10, 100, 1, 3, 3, 5, 5}, 24, 20, 0.6, 2},
      {"san_warp_q821_r8", {10, 10, 100, 8, 2, 1, 8, 8}, 24, 20, 0.6, 2},
  };
  for (const S& s : list) {
    if (!want(s.name)) continue;
    Case c;
    c.name = s.name;
    c.t = s.t;
    c.N = (long long)s.t.p1 * s.t.p2 * s.t.p3 - 7;  // the last prefix group partly past N
    c.bag_offsets = bags_uniform(rng, s.bags, 0, s.maxlen);
    c.ids = hot_prefix_ids(rng, s.t, c.N, c.bag_offsets.back(), s.hot, s.hot_groups);
    const Plan p = make_plan(c.ids, c.t);
    int largest = 0;
    for (int g = 0; g < p.G; ++g)
      largest = std::max(largest, p.group_offsets[g + 1] - p.group_offsets[g]);
    // kCH = 64 (cuda/common/common.cuh): a larger group leaves the forward's tile phase a
    // checkpoint of its P for the chunk phase
    report(run_case(c, rng, false) == 0,
           fmt("single-table ops %s (largest prefix group %d unique ids%s)", s.name, largest,
               largest > 64 ? ": checkpoints" : ""));
  }
}

// ---- 2. flowtt_plan ----

void plan_case(const std::string& name, std::vector<int> ids, int last_extent, int num_rows) {
  const int n = (int)ids.size();
  std::vector<int> clamped(ids);
  for (int& x : clamped) x = std::min(std::max(x, 0), num_rows - 1);
  const Plan ref = make_plan(clamped, TTDims{1, 1, last_extent, 1, 1, 1, 1, 1});
  const std::vector<int> counts = {ref.U, ref.G};
  DBuf<int> d_ids(ids), perm(n), inverse(n), uids(n), runs(n + 1), goffs(n + 1), cnt(2);
  for (bool forward_only : {false, true}) {
    size_t bytes = 0;
    CK(flowtt::plan_scratch_bytes(n, num_rows, forward_only, &bytes));
    DBuf<char> scratch(bytes);
    scratch.fill(0xAB);
    for (auto* b : {&perm, &inverse, &uids, &runs, &goffs, &cnt}) b->poison();
    const flowtt::PlanOutputs out{forward_only ? nullptr : perm.p, inverse.p, uids.p,
                                  forward_only ? nullptr : runs.p, goffs.p,   cnt.p};
    CK(flowtt::build_plan(d_ids.p, n, last_extent, num_rows, out, scratch.p, 0));
    sync();
    bool ok = inverse.get() == ref.inverse && uids.get() == ref.unique_ids &&
              goffs.get() == ref.group_offsets && cnt.get() == counts;
    if (!forward_only) ok = ok && perm.get() == ref.perm && runs.get() == ref.run_offsets;
    const char* how = !forward_only                               ? "full plan (sort)"
                      : flowtt::plan_bitmap::Applies(n, num_rows) ? "forward-only plan (bitmap)"
                                                                  : "forward-only plan (sort)";
    report(ok, fmt("%s: flowtt_plan %s n=%d U=%d G=%d equals make_plan", name.c_str(), how, n,
                   ref.U, ref.G));
  }
}

void plans(std::mt19937_64& rng, const std::function<bool(const std::string&)>& want) {
  if (!want("san_plan")) return;
  const TTDims t{10, 10, 200, 1, 1, 1, 1, 1};
  const int N = 20000;
  // hot prefixes, 625 bitmap words against 1,500 ids: the bitmap plan
  plan_case("san_plan_hot", hot_prefix_ids(rng, t, N, 1500, 0.6, 3), 200, N);
  // 300 ids in 10^6 rows (31,250 words): the forward-only plan sorts; ids out of range
  std::vector<int> sparse = uniform_ids(rng, 0, 999999, 300);
  sparse[3] = -5;
  sparse[7] = 1000000 + 12;
  sparse[11] = 999999;
  plan_case("san_plan_sparse_clamped", sparse, 1000, 1000000);
  plan_case("san_plan_one_id", {4321}, 100, 10000);
}

// ---- 3. the pooling ops alone, in windows ----

// float64 reference of the pooling for the window of uniques [lo, hi) (rows: every
// unique's row, [U, D]). Forward: adds the window's bag sums onto out [B, D] (rows
// PoolOutRow). Backward: the window's d_rows [hi - lo, D] and d_weights [n] (0 outside it).
void pool_ref_fwd(const std::vector<int>& csr, int B, int batch, const std::vector<int>& inverse,
                  const std::vector<float>& w, const std::vector<double>& rows, int D, int lo,
                  int hi, std::vector<double>* out) {
  for (int j = 0; j < B; ++j) {
    const size_t o = (size_t)PoolOutRow(j, B, batch) * D;
    for (int k = csr[j]; k < csr[j + 1]; ++k) {
      const int u = inverse[k];
      if (u < lo || u >= hi || w[k] == 0.f) continue;
      for (int e = 0; e < D; ++e) (*out)[o + e] += (double)w[k] * rows[(size_t)u * D + e];
    }
  }
}

void pool_ref_bwd(const std::vector<int>& inverse, const std::vector<float>& w,
                  const std::vector<double>& rows, int D, int lo, int hi,
                  const std::vector<float>& dout, const std::vector<int>& out_rows,
                  std::vector<double>* d_rows, std::vector<double>* d_w) {
  const int n = (int)inverse.size();
  d_rows->assign((size_t)std::max(hi - lo, 0) * D, 0.0);
  d_w->assign(n, 0.0);
  for (int k = 0; k < n; ++k) {
    const int u = inverse[k];
    if (u < lo || u >= hi) continue;
    const float* g = &dout[(size_t)out_rows[k] * D];
    double s = 0;
    for (int e = 0; e < D; ++e) {
      (*d_rows)[(size_t)(u - lo) * D + e] += (double)w[k] * g[e];
      s += (double)g[e] * rows[(size_t)u * D + e];
    }
    (*d_w)[k] = s;
  }
}

void pool_windows(const std::string& name, int D, int batch, int C, std::mt19937_64& rng) {
  // one id 1,100 times (its run spans 35 chunks of kPL = 32 sorted positions: pass 3), 400
  // others over 300 rows, shuffled
  std::vector<int> ids(1100, 77);
  for (int i = 0; i < 400; ++i) ids.push_back((int)(rng() % 300));
  std::shuffle(ids.begin(), ids.end(), rng);
  const int n = (int)ids.size();
  const int B = batch > 0 ? 3 * batch : 60;  // batch > 0: 3 features of `batch` bags
  std::vector<int> csr = {0, n};
  for (int j = 1; j < B; ++j) csr.push_back((int)(rng() % (n + 1)));
  std::sort(csr.begin(), csr.end());  // some bags empty
  std::vector<int> out_rows(n);
  for (int j = 0; j < B; ++j)
    for (int k = csr[j]; k < csr[j + 1]; ++k) out_rows[k] = (int)PoolOutRow(j, B, batch);
  const Plan p = make_plan(ids, TTDims{1, 1, 10, 1, 1, 1, 1, 1});
  const int U = p.U;
  std::vector<double> rows((size_t)U * D);
  {
    const std::vector<float> r = randn(rng, rows.size());
    std::copy(r.begin(), r.end(), rows.begin());
  }
  std::vector<float> w(n);
  std::uniform_real_distribution<float> uw(0.5f, 1.5f);
  for (auto& x : w) x = rng() % 10 == 0 ? 0.f : uw(rng);  // zero weights never read their row
  const std::vector<float> dout = randn(rng, (size_t)B * D);
  const std::vector<int> counts = {p.U, p.G};
  DBuf<int> inv(p.inverse), perm(p.perm), runs(p.run_offsets), cnt(counts), offs(csr),
      orow(out_rows);
  DBuf<float> wts(w), d_dout(dout), rows_w((size_t)C * D), outA((size_t)B * D), outB((size_t)B * D),
      d_rows((size_t)C * D), d_w(n);
  DBuf<char> scratch(flowtt::bag_pool_bwd_scratch_bytes(n, D));
  scratch.fill(0xAB);
  for (bool weighted : {true, false}) {
    std::vector<double> out_ref((size_t)B * D, 0.0), dr_ref, dw_ref;
    outA.poison();
    outB.poison();
    double worst = 0;
    int passes = 0;
    // the windows up to two past the uniques (the op's passes would run to n: the later
    // ones are empty windows as well)
    for (int lo = 0; lo < std::min(n, U + 2 * C); lo += C, ++passes) {
      const int hi = std::min(lo + C, U), cnt_w = std::max(hi - lo, 0);
      std::vector<float> rw((size_t)C * D, NAN);  // rows past the window's uniques: NaN
      for (size_t i = 0; i < (size_t)cnt_w * D; ++i) rw[i] = (float)rows[(size_t)lo * D + i];
      rows_w.set(rw);
      // pass 0 writes A; pass 1 copies A into B and adds (prev != out); later passes add
      // onto B in place (prev == out, as XLA aliases it)
      const float* prev = lo == 0 ? nullptr : lo == C ? outA.p : outB.p;
      float* out = lo == 0 ? outA.p : outB.p;
      CK(flowtt::bag_pool_fwd(rows_w.p, inv.p, wts.p, offs.p, n, B, D, batch, PoolWindow{lo, C},
                              cnt.p, prev, out, 0));
      pool_ref_fwd(csr, B, batch, p.inverse, w, rows, D, lo, hi, &out_ref);
      pool_ref_bwd(p.inverse, w, rows, D, lo, hi, dout, out_rows, &dr_ref, &dw_ref);
      d_rows.poison();
      d_w.poison();
      CK(flowtt::bag_pool_bwd(d_dout.p, weighted ? rows_w.p : nullptr, wts.p, inv.p, orow.p, perm.p,
                              runs.p, cnt.p, n, B, D, PoolWindow{lo, C}, d_rows.p,
                              weighted ? d_w.p : nullptr, scratch.p, 0));
      sync();
      const double e_dr = rel(d_rows.get(), dr_ref, (size_t)cnt_w * D);
      worst = std::max(worst, cnt_w > 0 ? e_dr : 0.0);
      if (weighted) worst = std::max(worst, rel(d_w.get(), dw_ref));
    }
    const std::vector<float> out = (passes > 1 ? outB : outA).get();
    const double e_out = rel(out, out_ref);
    worst = std::max(worst, e_out);
    report(worst < 1e-5, fmt("%s: pooling fwd/bwd %s in %d windows of %d (U=%d, n=%d, B=%d, D=%d, "
                             "batch %d): worst rel err %.2e (out %.2e)",
                             name.c_str(), weighted ? "weighted (d_weights)" : "unweighted", passes,
                             C, U, n, B, D, batch, worst, e_out));
  }
}

void pools(std::mt19937_64& rng, const std::function<bool(const std::string&)>& want) {
  if (want("san_pool_d37")) pool_windows("san_pool_d37", 37, 4, 64, rng);
  if (want("san_pool_d132")) pool_windows("san_pool_d132", 132, 0, 100, rng);
}

}  // namespace sanitize

#include "sanitize_tb.cuh"  // sections 4 and 5

namespace sanitize {

// The whole mode; `only`: just the cases whose name contains it ("" all).
int run(const std::string& only) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("sanitize mode: %s, %d SMs%s%s\n", prop.name, prop.multiProcessorCount,
              only.empty() ? "" : ", cases matching ", only.c_str());
  const auto want = [&](const std::string& name) {
    return only.empty() || name.find(only) != std::string::npos;
  };
  std::mt19937_64 rng(777);
  single_table(rng, want);
  plans(rng, want);
  pools(rng, want);
  tb_capacities(rng, want);
  tb_rows_cases(want);
  const bool ok = tt::TbFailures() == 0 && checks > 0;
  std::printf("SANITIZE %s (%d checks, %d failure(s)%s)\n", ok ? "PASS" : "FAIL", checks,
              tt::TbFailures(), checks > 0 ? "" : ", no case matches");
  return ok ? 0 : 1;
}

}  // namespace sanitize
