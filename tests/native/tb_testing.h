// Test support for the table-batched rows ops (host only, no XLA): test cases of several
// tables packed per core index, the plan of docs/batched_contract.md built on the host
// (as flowtt_jax.batched_plan.make_group_plan), and a float64 oracle that works from each
// unique row's (table, id), not from the plan's indices; the cases and plans every check
// runs, and its PASS/FAIL lines. Used by tests/native/tb_rows_test.cc,
// tests/native/tb_rows_emu_test.cc and cuda/harness/tb_rows_harness.cu.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "contract/tb_contract.h"

namespace flowtt::tb::testing {

constexpr double kTbTol = 2e-5;         // relative L2 error allowed against the oracle
constexpr int32_t kTbPad = 0x7fffffff;  // plan padding the ops must never read

// The failures reported so far.
inline int& TbFailures() {
  static int failures = 0;
  return failures;
}

// One "PASS what" / "FAIL what" line (flushed: a crash later leaves it printed).
inline void TbReport(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++TbFailures();
}

// The last line ("PASS: 0 failure(s)" or "FAIL: k failure(s)"); main's exit status.
inline int TbExitStatus() {
  std::printf("%s: %d failure(s)\n", TbFailures() ? "FAIL" : "PASS", TbFailures());
  return TbFailures() ? 1 : 0;
}

// One table: N rows, row shape (p1, p2, p3), its first row in each packed core.
struct TbTable {
  int64_t N, p1, p2, p3;
  int64_t o1, o2, o3;
};

struct TbCase {
  std::string name;
  TbShape s;  // packed extents p1, p2, p3 and the shared q, r
  std::vector<TbTable> tables;
  std::vector<int32_t> ids, tab;  // one (id, table) per position
};

// Tables stacked in the packed cores in order (each core k gets rows [o_k, o_k + p_k)).
inline TbCase TbStack(const std::string& name, int64_t q1, int64_t q2, int64_t q3, int64_t r1,
                      int64_t r2, const std::vector<std::vector<int64_t>>& shapes) {
  TbCase c;
  c.name = name;
  c.s = {0, 0, 0, q1, q2, q3, r1, r2};
  for (const auto& sh : shapes) {  // {N, p1, p2, p3}
    c.tables.push_back({sh[0], sh[1], sh[2], sh[3], c.s.p1, c.s.p2, c.s.p3});
    c.s.p1 += sh[1];
    c.s.p2 += sh[2];
    c.s.p3 += sh[3];
  }
  return c;
}

// `count` ids of table t, skewed towards small ids (id = N * x^skew, x uniform), so the
// first prefixes are hot; skew = 1 is uniform.
inline void TbAddIds(TbCase* c, int t, int64_t count, double skew, std::mt19937_64* rng) {
  std::uniform_real_distribution<double> x(0.0, 1.0);
  const int64_t N = c->tables[t].N;
  for (int64_t k = 0; k < count; ++k) {
    int64_t id = (int64_t)(N * std::pow(x(*rng), skew));
    c->ids.push_back((int32_t)std::min(id, N - 1));
    c->tab.push_back(t);
  }
}

inline void TbAddId(TbCase* c, int t, int64_t id) {
  c->ids.push_back((int32_t)id);
  c->tab.push_back(t);
}

// The plan. Padding past num_unique / num_groups holds `pad` (the contract says 0; tests
// pass a huge value to show the kernels never read it).
struct TbHostPlan {
  int64_t n = 0;
  int32_t U = 0, G = 0;
  std::vector<int32_t> u_i3, g_i1, g_i2, group_offsets, counts;
  std::vector<int32_t> ut, uid;  // (table, id) of each unique row (oracle only)
};

inline TbHostPlan TbMakePlan(const TbCase& c, int32_t pad) {
  TbHostPlan p;
  const int64_t n = (int64_t)c.ids.size();
  p.n = n;
  std::vector<int64_t> base(c.tables.size() + 1, 0);
  for (size_t t = 0; t < c.tables.size(); ++t) {
    const TbTable& tb = c.tables[t];
    base[t + 1] = base[t] + tb.p1 * tb.p2 * tb.p3;
  }
  std::vector<int64_t> key(n);
  for (int64_t k = 0; k < n; ++k) key[k] = base[c.tab[k]] + c.ids[k];
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  p.u_i3.assign(n, pad);
  p.g_i1.assign(n, pad);
  p.g_i2.assign(n, pad);
  p.ut.assign(n, 0);
  p.uid.assign(n, 0);
  p.group_offsets.assign(n + 1, 0);
  int64_t prev_t = -1, prev_prefix = -1;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t k = perm[j];
    if (j > 0 && key[k] == key[perm[j - 1]]) continue;
    const int t = c.tab[k];
    const TbTable& tb = c.tables[t];
    const int64_t id = c.ids[k], prefix = id / tb.p3;
    if (t != prev_t || prefix != prev_prefix) {
      p.group_offsets[p.G] = p.U;
      p.g_i1[p.G] = (int32_t)(tb.o1 + prefix / tb.p2);
      p.g_i2[p.G] = (int32_t)(tb.o2 + prefix % tb.p2);
      ++p.G;
      prev_t = t;
      prev_prefix = prefix;
    }
    p.u_i3[p.U] = (int32_t)(tb.o3 + id % tb.p3);
    p.ut[p.U] = t;
    p.uid[p.U] = (int32_t)id;
    ++p.U;
  }
  for (int64_t g = p.G; g <= n; ++g) p.group_offsets[g] = p.U;
  p.counts = {p.U, p.G};
  return p;
}

inline std::vector<float> TbRandom(size_t count, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(count);
  for (float& x : v) x = d(rng);
  return v;
}

struct TbCores {
  std::vector<float> g1, g2, g3;
};

inline TbCores TbRandomCores(const TbShape& s, uint64_t seed) {
  return {TbRandom(s.p1 * s.q1 * s.r1, seed), TbRandom(s.p2 * s.r1 * s.q2 * s.r2, seed + 1),
          TbRandom(s.p3 * s.r2 * s.q3, seed + 2)};
}

// Packed rows (i1, i2, i3) of unique u, from its (table, id).
inline void TbRowsOf(const TbCase& c, const TbHostPlan& p, int64_t u, int64_t* i1, int64_t* i2,
                     int64_t* i3) {
  const TbTable& tb = c.tables[p.ut[u]];
  const int64_t id = p.uid[u];
  *i1 = tb.o1 + id / (tb.p2 * tb.p3);
  *i2 = tb.o2 + (id / tb.p3) % tb.p2;
  *i3 = tb.o3 + id % tb.p3;
}

// float64 oracle of op 1: rows [U, D].
inline std::vector<double> TbRefRows(const TbCase& c, const TbHostPlan& p, const TbCores& k) {
  const TbShape& s = c.s;
  const int64_t D = s.dim(), K = s.q2 * s.r2;
  std::vector<double> rows(p.U * D, 0.0), P(s.q1 * K);
  for (int64_t u = 0; u < p.U; ++u) {
    int64_t i1, i2, i3;
    TbRowsOf(c, p, u, &i1, &i2, &i3);
    std::fill(P.begin(), P.end(), 0.0);
    for (int64_t x1 = 0; x1 < s.q1; ++x1)
      for (int64_t a = 0; a < s.r1; ++a)
        for (int64_t j = 0; j < K; ++j)
          P[x1 * K + j] +=
              (double)k.g1[(i1 * s.q1 + x1) * s.r1 + a] * k.g2[(i2 * s.r1 + a) * K + j];
    for (int64_t m = 0; m < s.q1 * s.q2; ++m)
      for (int64_t b = 0; b < s.r2; ++b)
        for (int64_t z = 0; z < s.q3; ++z)
          rows[u * D + m * s.q3 + z] += P[m * s.r2 + b] * k.g3[(i3 * s.r2 + b) * s.q3 + z];
  }
  return rows;
}

// float64 oracle of op 2: gradients of sum(d_rows[:U] * rows[:U]) w.r.t. the packed cores.
inline void TbRefGrads(const TbCase& c, const TbHostPlan& p, const TbCores& k,
                       const std::vector<float>& d_rows, std::vector<double>* dg1,
                       std::vector<double>* dg2, std::vector<double>* dg3) {
  const TbShape& s = c.s;
  const int64_t D = s.dim(), K = s.q2 * s.r2, M = s.q1 * s.q2;
  dg1->assign(k.g1.size(), 0.0);
  dg2->assign(k.g2.size(), 0.0);
  dg3->assign(k.g3.size(), 0.0);
  std::vector<double> P(M * s.r2), dP(M * s.r2);
  for (int64_t u = 0; u < p.U; ++u) {
    int64_t i1, i2, i3;
    TbRowsOf(c, p, u, &i1, &i2, &i3);
    const float* dr = d_rows.data() + u * D;
    const float* a1 = k.g1.data() + i1 * s.q1 * s.r1;
    const float* b2 = k.g2.data() + i2 * s.r1 * K;
    const float* c3 = k.g3.data() + i3 * s.r2 * s.q3;
    std::fill(P.begin(), P.end(), 0.0);
    for (int64_t x1 = 0; x1 < s.q1; ++x1)
      for (int64_t a = 0; a < s.r1; ++a)
        for (int64_t j = 0; j < K; ++j) P[x1 * K + j] += (double)a1[x1 * s.r1 + a] * b2[a * K + j];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < s.r2; ++b) {
        double t = 0.0;
        for (int64_t z = 0; z < s.q3; ++z) {
          t += (double)dr[m * s.q3 + z] * c3[b * s.q3 + z];
          (*dg3)[(i3 * s.r2 + b) * s.q3 + z] += P[m * s.r2 + b] * dr[m * s.q3 + z];
        }
        dP[m * s.r2 + b] = t;
      }
    for (int64_t x1 = 0; x1 < s.q1; ++x1)
      for (int64_t a = 0; a < s.r1; ++a) {
        double t = 0.0;
        for (int64_t j = 0; j < K; ++j) {
          t += dP[x1 * K + j] * b2[a * K + j];
          (*dg2)[(i2 * s.r1 + a) * K + j] += (double)a1[x1 * s.r1 + a] * dP[x1 * K + j];
        }
        (*dg1)[(i1 * s.q1 + x1) * s.r1 + a] += t;
      }
  }
}

// ||x - ref|| / max(||ref||, 1e-30) over `count` elements; +inf if any x is not finite.
inline double TbRelErr(const float* x, const double* ref, size_t count) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// The test cases shared by the CPU test and the CUDA harness (small enough for a float64
// check of every element): several tables per group with different row shapes, padding
// rows, hot prefixes, ids at each table's last row, tables sharing packed g2 rows, one
// group holding every id, no ids at all, n = 1.
inline std::vector<TbCase> TbStandardCases() {
  std::vector<TbCase> cases;
  std::mt19937_64 rng(20261201);
  auto last_rows = [](TbCase* c) {
    for (size_t t = 0; t < c->tables.size(); ++t) TbAddId(c, (int)t, c->tables[t].N - 1);
  };
  {  // D = 32 (2,4,4), r = 32 (compiled-in dims of the CUDA kernels): five tables, hot
     // prefixes, padding rows
    TbCase c = TbStack("d32_five_tables", 2, 4, 4, 32, 32,
                       {{1000, 10, 10, 10},
                        {5000, 20, 16, 16},
                        {7, 1, 2, 4},
                        {300, 6, 7, 8},
                        {20000, 30, 25, 27}});
    const int64_t counts[] = {3000, 4000, 20, 500, 9000};
    for (int t = 0; t < 5; ++t) TbAddIds(&c, t, counts[t], t % 2 ? 3.0 : 1.5, &rng);
    last_rows(&c);
    std::vector<size_t> order(c.ids.size());  // positions in random order
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    TbCase shuffled = c;
    for (size_t k = 0; k < order.size(); ++k) {
      shuffled.ids[k] = c.ids[order[k]];
      shuffled.tab[k] = c.tab[order[k]];
    }
    cases.push_back(shuffled);
  }
  {  // D = 128 (4,4,8), r = 32: a hot table (most ids in a few prefixes)
    TbCase c =
        TbStack("d128_hot", 4, 4, 8, 32, 32, {{4096, 16, 16, 16}, {900, 9, 10, 10}, {64, 4, 4, 4}});
    TbAddIds(&c, 0, 6000, 6.0, &rng);
    TbAddIds(&c, 1, 800, 1.0, &rng);
    TbAddIds(&c, 2, 100, 2.0, &rng);
    last_rows(&c);
    cases.push_back(c);
  }
  {  // odd shapes: q = (3,1,5), r = (5,7) (the CUDA scalar paths)
    TbCase c = TbStack("odd_q3_r57", 3, 1, 5, 5, 7, {{500, 8, 8, 8}, {77, 3, 5, 6}, {1, 1, 1, 1}});
    TbAddIds(&c, 0, 700, 2.0, &rng);
    TbAddIds(&c, 1, 200, 1.0, &rng);
    last_rows(&c);
    cases.push_back(c);
  }
  {  // tables 0 and 1 share their packed g2 rows (groups of two tables in one dg2 run);
     // q1 = 1, q2 = 8, r1 = 64, r2 = 8
    TbCase c = TbStack("shared_g2", 1, 8, 2, 64, 8, {{640, 8, 8, 10}, {800, 10, 8, 10}});
    c.tables[1].o2 = 0;
    c.s.p2 = 8;
    TbAddIds(&c, 0, 900, 2.0, &rng);
    TbAddIds(&c, 1, 900, 2.0, &rng);
    last_rows(&c);
    cases.push_back(c);
  }
  {  // one group holding every unique id (p1 = p2 = 1), plus a small table
    TbCase c = TbStack("one_group", 2, 2, 4, 16, 16, {{3000, 1, 1, 3000}, {50, 5, 5, 2}});
    TbAddIds(&c, 0, 5000, 1.0, &rng);
    TbAddIds(&c, 1, 10, 1.0, &rng);
    last_rows(&c);
    cases.push_back(c);
  }
  {  // n = 1
    TbCase c = TbStack("n1", 2, 4, 4, 8, 8, {{100, 5, 5, 4}});
    TbAddId(&c, 0, 57);
    cases.push_back(c);
  }
  {  // K = q2*r2 = 12: K/4 not a multiple of 8 (the dg1 terms' last quad partials empty)
    TbCase c = TbStack("k12", 2, 3, 4, 8, 4, {{2000, 10, 10, 20}, {300, 6, 5, 10}});
    TbAddIds(&c, 0, 1500, 2.0, &rng);
    TbAddIds(&c, 1, 400, 1.0, &rng);
    last_rows(&c);
    cases.push_back(c);
  }
  return cases;
}

// Standard case 1 under a plan with num_unique = num_groups = 0 (group_offsets all 0, the
// index arrays all `pad`): rows and gradients all zero, nothing read.
inline std::pair<TbCase, TbHostPlan> TbNoUniqueIdsCase(int32_t pad) {
  TbCase c = TbStandardCases()[1];
  c.name = "no_unique_ids";
  TbHostPlan p = TbMakePlan(c, pad);
  std::fill(p.group_offsets.begin(), p.group_offsets.end(), 0);
  std::fill(p.u_i3.begin(), p.u_i3.end(), pad);
  std::fill(p.g_i1.begin(), p.g_i1.end(), pad);
  std::fill(p.g_i2.begin(), p.g_i2.end(), pad);
  p.U = p.G = 0;
  p.counts = {0, 0};
  return {c, p};
}

// The invalid plans the kernels must run to completion without a fault (indices outside
// their cores, g_i1 unsorted, counts past n or negative, garbage group_offsets): for each,
// `good` edited and check(what, plan). `pad` is the out-of-range index used.
template <typename Check>
void TbForEachInvalidPlan(const TbHostPlan& good, int32_t pad, Check&& check) {
  std::mt19937_64 rng(9);
  auto run = [&](const std::string& what, auto edit) {
    TbHostPlan p = good;
    edit(p);
    check(what, p);
  };
  run("u_i3 out of range", [&](TbHostPlan& p) {
    for (int u = 0; u < p.U; u += 7) p.u_i3[u] = (u % 2) ? -1000 : pad;
  });
  run("g_i1, g_i2 out of range", [&](TbHostPlan& p) {
    for (int g = 0; g < p.G; g += 5) p.g_i1[g] = -3, p.g_i2[g] = pad;
  });
  run("g_i1 not sorted",
      [&](TbHostPlan& p) { std::shuffle(p.g_i1.begin(), p.g_i1.begin() + p.G, rng); });
  run("counts past n", [&](TbHostPlan& p) { p.counts = {(int32_t)p.n + 9, pad}; });
  run("counts negative", [&](TbHostPlan& p) { p.counts = {-4, -9}; });
  run("no groups (num_groups 0, unique ids left)", [&](TbHostPlan& p) { p.counts = {p.U, 0}; });
  run("garbage group_offsets", [&](TbHostPlan& p) {
    for (int32_t& o : p.group_offsets) o = (int32_t)(rng() % (3 * p.n)) - (int32_t)p.n;
  });
}

}  // namespace flowtt::tb::testing
